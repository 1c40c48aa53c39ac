"""A kept worker of submitit's worker mode (``task_groups.py``): ``python -m monarch_torchx.submitit_worker``.

Started by the pool's queue like any app, it asks host 0's agent for one task after another
(``tasks.next``, which also carries the end of the task before) and runs each in this process as
submitit's ``_submit`` would (``submission.process_job``): the job's environment variables set,
its stdout and stderr on the job's files, its result or its traceback pickled beside them. It exits
when no task comes for a while, giving its slot back.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
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


@contextlib.contextmanager
def _as_the_job(task: Task) -> Iterator[None]:
    """The job's environment variables, and fds 1 and 2 on its files, for as long as it runs."""
    old_env = {k: os.environ.get(k) for k in task.env}
    os.environ.update(task.env)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        out = os.open(task.stdout_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        err = (
            out
            if task.stderr_path == task.stdout_path
            else os.open(task.stderr_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        )
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in {out, err}:
            os.close(fd)
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_task(folder: str, task: Task, worker: str) -> TaskStatus:
    """Runs one task here; its end (SUCCEEDED, or FAILED with why)."""
    from submitit.core.submission import process_job

    started = time.time()
    state, msg = SUCCEEDED, ""
    try:
        with _as_the_job(task):
            process_job(folder)
    except SystemExit as e:
        if e.code not in (0, None):
            state, msg = FAILED, f"exited with code {e.code}" if isinstance(e.code, int) else str(e.code)
    except Exception as e:  # noqa: BLE001 (the job's own error: its traceback is in its result file)
        state, msg = FAILED, f"{type(e).__name__}: {e}"
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
        ended.append(run_task(folder, got.task, worker))


if __name__ == "__main__":
    sys.exit(main())
