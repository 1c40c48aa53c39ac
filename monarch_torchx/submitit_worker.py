"""A kept worker of submitit's worker mode (``task_groups.py``): ``python -m monarch_torchx.submitit_worker``.

Started by the pool's queue like any app, it asks host 0's agent for one task after another
(``tasks.next``, which also carries the end of the task before) and runs each in this process as
submitit's ``_submit`` would (``run_task``): the job's environment variables set,
its output to the job's files (made when it first prints: ``_Output``), its result or its
traceback pickled beside them. It exits
when no task comes for a while, giving its slot back.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .credentials import PoolCredentials
from .net import WireError
from .net.blocking import Client
from .specs import FAILED, SUCCEEDED
from .task_groups import (
    FOLDER_ENV,
    GROUP_ENV,
    HOLDER_ENV,
    HOLDER_IDENTITY_ENV,
    HOLDER_PORT_ENV,
    WORKER_ENV,
    Assignment,
    Task,
    TaskStatus,
)

ASK_WAIT_S = 2.0  # how long one ask for work may wait at the holder for a task to come
CALL_TIMEOUT_S = 30.0


class _Output:
    """The worker's fds 1 and 2 on pipes, read by a thread that writes what comes to the running
    job's files, each made at its first byte: a task that prints nothing makes no file (on a
    slow disk the files, not the calls, are what many small tasks cost), and one that prints is
    followed live. Between tasks, output goes where the worker's own does (its agent's log)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.own: dict[int, int] = {}  # pipe -> the worker's own fd for that stream
        self.paths: dict[int, str | None] = {}  # pipe -> the running job's file for it
        self.files: dict[int, int] = {}  # pipe -> the file open for it now
        self.pipes: list[int] = []
        for fd in (1, 2):
            r, w = os.pipe()
            os.set_blocking(r, False)
            self.own[r] = os.dup(fd)
            os.dup2(w, fd)
            os.close(w)
            self.pipes.append(r)
            self.paths[r] = None
        threading.Thread(target=self._pump, name="monarch-torchx-output", daemon=True).start()

    def _pump(self) -> None:
        while True:
            ready, _, _ = select.select(self.pipes, [], [])
            with self.lock:
                for r in ready:
                    self._drain(r)

    def _drain(self, r: int) -> None:
        """(under ``lock``) Everything in pipe ``r`` now, to where its stream goes now."""
        while True:
            try:
                data = os.read(r, 1 << 16)
            except BlockingIOError:
                return
            if not data:
                return
            try:
                fd = self.files.get(r)
                if fd is None:
                    path = self.paths[r]
                    fd = self.own[r] if path is None else os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                    self.files[r] = fd
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            except OSError:  # (a full disk: the job's output is lost, the worker goes on)
                pass

    def route(self, stdout_path: str | None, stderr_path: str | None) -> None:
        """What was written so far goes where it was going; what comes next, to these files
        (None: the worker's own streams)."""
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        with self.lock:
            for r in self.pipes:
                self._drain(r)
            for r, fd in self.files.items():
                if fd != self.own[r]:
                    os.close(fd)
            self.files = {}
            self.paths = dict(zip(self.pipes, (stdout_path, stderr_path)))

    def close(self) -> None:
        """Drains what is left and puts fds 1 and 2 back: what the worker writes as it exits (a
        traceback) is not left in a pipe no thread reads any more."""
        self.route(None, None)
        with self.lock:
            for fd, r in zip((1, 2), self.pipes):
                os.dup2(self.own[r], fd)


@contextlib.contextmanager
def _as_the_job(task: Task, folder: str, output: _Output) -> Iterator[None]:
    """The job's environment variables, and its output to its files, for as long as it runs."""
    env = {**task.env, "SUBMITIT_FOLDER": folder}  # (``JobEnvironment().paths`` reads it, as in ``_submit``)
    old_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    output.route(task.stdout_path, task.stderr_path)
    try:
        yield
    finally:
        output.route(None, None)
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_task(folder: str, task: Task, worker: str, output: _Output) -> TaskStatus:
    """Runs one task here, by submitit's file contract (its ``_submit`` without the process):
    the job's pickle read, its function called, ``("success", result)`` or ``("error",
    traceback)`` pickled to its result file (written aside, then moved in place, so a reader
    never sees half of it). Returns its end: SUCCEEDED, or FAILED with why."""
    from submitit.core import utils

    started = time.time()
    state, msg = SUCCEEDED, ""
    paths = utils.JobPaths(folder, job_id=task.task_id, task_id=0)
    with _as_the_job(task, folder, output):
        try:
            try:
                outcome: tuple[str, Any] = ("success", utils.DelayedSubmission.load(paths.submitted_pickle).result())
            except Exception as e:  # noqa: BLE001 (the job's own error: its traceback goes back to its caller)
                state, msg = FAILED, f"{type(e).__name__}: {e}"
                outcome = ("error", traceback.format_exc())
            with utils.temporary_save_path(paths.result_pickle) as tmp:
                utils.cloudpickle_dump(outcome, tmp)
        except SystemExit as e:  # (no result: as a process that exits without one)
            if e.code not in (0, None):
                state, msg = FAILED, f"exited with code {e.code}" if isinstance(e.code, int) else str(e.code)
        except Exception as e:  # noqa: BLE001 (a result that cannot be pickled, a full disk)
            state, msg = FAILED, f"its result could not be written: {type(e).__name__}: {e}"
            print(traceback.format_exc(), file=sys.stderr, flush=True)
    return TaskStatus(task.task_id, state, msg, started, time.time(), worker)


class _Holder:
    """The connection to host 0's agent, dialled again when it breaks (a dropped idle connection,
    a blip): a worker gives up only after RETRIES tries, so a task's end is not lost to one."""

    RETRIES = 4

    def __init__(self, env: os._Environ[str] | dict[str, str]):
        self.creds = PoolCredentials.load(Path(env["MONARCH_TORCHX_STATE_DIR"]))
        self.where = (env[HOLDER_ENV], int(env[HOLDER_PORT_ENV]), env[HOLDER_IDENTITY_ENV].encode())
        self.client: Client | None = None

    def call(self, op: str, **args: Any) -> Any:
        for attempt in range(self.RETRIES + 1):
            try:
                if self.client is None:
                    host, port, identity = self.where
                    self.client = Client(host, port, self.creds, CALL_TIMEOUT_S, identity)
                self.client.settimeout(CALL_TIMEOUT_S + ASK_WAIT_S)
                return self.client.call(op, **args)
            except (WireError, OSError):
                if self.client is not None:
                    self.client.close()
                    self.client = None
                if attempt == self.RETRIES:
                    raise
                time.sleep(0.25 * 2**attempt)
        raise AssertionError("unreachable")


def main() -> int:
    env = os.environ
    group, worker, folder = env[GROUP_ENV], env[WORKER_ENV], env[FOLDER_ENV]
    holder = _Holder(env)
    output = _Output()
    try:
        ended: list[TaskStatus] = []
        while True:
            try:
                answer = holder.call(
                    "tasks.next", group_id=group, worker=worker, ended=[e.to_wire() for e in ended], wait_s=ASK_WAIT_S
                )
            except (WireError, OSError) as e:
                print(f"worker {worker}: the pool's queue (host 0) is unreachable ({e}); exiting", file=sys.stderr)
                return 1
            got = Assignment.from_wire(answer)
            ended = []
            if got.task is None:
                print(f"worker {worker} exits: {got.why}", flush=True)
                return 0
            ended.append(run_task(folder, got.task, worker, output))

    finally:
        output.close()


if __name__ == "__main__":
    sys.exit(main())
