"""The agent's table of replicas: their attempts, states, exit codes and captured output.

Output is read from pipes by the agent (not written by the child straight to a file) so each
line gets a timestamp on arrival: that is what lets ``torchx log --since/--until`` and live
tailing work, and what the telemetry module will index. On disk each line is ``TS LINE``, in
segments bounded per replica and per host (``logstore``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import json
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path
from typing import AsyncIterator, Callable, Iterable, Sequence

from ..history import ReplicaEnd, forget_end, record_end
from ..private import private_dir
from ..resources import Resources
from ..specs import CANCELLED, FAILED, PENDING, RUNNING, SUCCEEDED, TERMINAL, LaunchSpec
from .admission import Ledger, gpu_env
from .launcher import Launcher, SpawnError
from .logstore import STREAMS, DropCount, LogLimits, LogStore, ReplicaLog, Segment, StreamLog, mib, parse_line

MAX_PARTIAL = 64 * 1024  # a line longer than this is split rather than buffered forever
BATCH_LINES = 2000
MAX_REQUEUES = 100  # a safety net: submitit counts a job's requeues itself
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


def read_error_file(path: Path) -> str:
    """The one-line message of a torchelastic error file (``{"message": {"message": ...}}``), or ""."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(1 << 20))
        msg = data["message"]
        text = msg.get("message", "") if isinstance(msg, dict) else str(msg)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ""
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1][:500] if lines else ""


def last_stderr_line(log: StreamLog, limit: int = 200) -> str:
    """The last non-empty line the replica wrote to stderr, bounded: most often the cause of a
    failure (Python's exception line, "can't open file", a shell's "command not found"), so a
    failed replica's status says it, not only `torchx log`. Read from disk, where every whole
    line the agent has read already is (each is written as it arrives); "" when there is none."""
    for seg in reversed(log.segments):
        try:
            with open(seg.path, "rb") as f:
                f.seek(max(0, seg.size - 8192))
                data = f.read(min(seg.size, 8192))
        except OSError:  # dropped by the log limits meanwhile
            continue
        for raw in reversed(data.split(b"\n")):
            line = parse_line(raw)[1].strip() if raw.strip() else ""
            if line:
                return line if len(line) <= limit else line[: limit - 3] + "..."
    return ""


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


KILL_REAP_S = 1.0  # how long ``kill`` waits for SIGKILLed replicas' ends to be heard

# signals that end a whole job from outside (scancel, walltime, a node's shutdown), as an exit code
# from the process itself (-N) or from a shell that ran it (128 + N)
_JOB_SIGNALS = frozenset({signal.SIGTERM, signal.SIGKILL, signal.SIGINT, signal.SIGHUP})
# how long an exit by such a signal waits for the agent's own signal handler to say the job is ending
SIGNAL_SETTLE_S = 0.5


def killed_by_job_signal(code: int) -> bool:
    """Whether exit ``code`` is a death by a signal that ends whole jobs (see ``_JOB_SIGNALS``)."""
    n = -code if code < 0 else code - 128
    return n in {s.value for s in _JOB_SIGNALS}


class _Capture(asyncio.Protocol):
    """Timestamps each line of one pipe and appends it to the stream's log."""

    def __init__(self, log: StreamLog, notify: Callable[[], None], tee: str | None = None):
        self._tee = open(tee, "ab", buffering=0) if tee else None
        self._log = log
        log.writers += 1
        self._partial = b""
        self._notify = notify
        self.closed = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        if self._tee:
            self._tee.write(data)
        ts = b"%.6f " % time.time()
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > MAX_PARTIAL:
            lines.append(self._partial)
            self._partial = b""
        if lines:
            self._log.write(b"".join(ts + line + b"\n" for line in lines), len(lines))
            self._notify()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.closed.done():
            return
        if self._partial:
            self._log.write(b"%.6f " % time.time() + self._partial + b"\n", 1)
            self._partial = b""
        self._log.writers -= 1
        if not self._log.writers:
            self._log.close_file()
        self._log.owner.settle()
        if self._tee:
            self._tee.close()
        if not self.closed.done():
            self.closed.set_result(None)
        self._notify()


class Replica:
    """One LaunchSpec and what became of it (across ``max_retries`` attempts)."""

    def __init__(self, spec: LaunchSpec, log_dir: Path, log: ReplicaLog):
        self.spec = spec
        self.log_dir = log_dir
        self.log = log  # its output on disk, across its attempts
        self.state = PENDING
        self.pid: int | None = None
        self.exit_code: int | None = None
        self.msg = ""
        self.attempts = 0
        self.started = time.time()
        self.ended: float | None = None
        self.cancelled = False
        self.cancel_reason = "cancelled"
        self.record_end = True  # (an end its agent cannot vouch for, a signal's: the client records it)
        self.recorded = False  # its end is in the pool's state dir (so a client need not record it)
        self.timed_out = False
        self.requeues = 0
        self.timers: list[asyncio.TimerHandle] = []
        self.captures: list[_Capture] = []
        self._changed = asyncio.Event()

    def notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_change(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def change_event(self) -> asyncio.Event:
        """The event the next change sets: taken before awaiting, so no change falls in between."""
        return self._changed

    @property
    def output_done(self) -> bool:
        return self.state in TERMINAL and all(c.closed.done() for c in self.captures)

    def status(self) -> dict:
        return {
            "app_id": self.spec.app_id,
            "role": self.spec.role,
            "replica_id": self.spec.replica_id,
            "state": self.state,
            "pid": self.pid,
            "exit_code": self.exit_code,
            "msg": self.msg,
            "attempts": self.attempts,
            "started": self.started,
            "ended": self.ended,
            # how long ago it ended, on this host's clock (a client compares no clocks)
            "age_s": None if self.ended is None else max(0.0, time.time() - self.ended),
            "recorded": self.recorded,
            "argv": self.spec.argv,
            "log_dir": str(self.log_dir),
        }


class _Tail:
    """Reads whole new lines of one stream from where it left off, segment after segment, and
    counts what was dropped before it could be read (``gap``: taken by the caller)."""

    def __init__(self, log: StreamLog):
        self.log = log
        self.seq = -1  # before the first segment: the first read counts what was dropped earlier
        self.offset = 0
        self.lines = 0  # the stream's lines before the read position
        self.bytes = 0
        self.gap = DropCount()

    def _skip_to(self, seg: Segment) -> None:
        if seg.lines_before > self.lines:
            self.gap.add(
                DropCount(
                    seg.lines_before - self.lines,
                    seg.bytes_before - self.bytes,
                    self.log.dropped_until,
                    self.log.reason,
                )
            )
        self.seq, self.offset, self.lines, self.bytes = seg.seq, 0, seg.lines_before, seg.bytes_before

    def read(self) -> list[tuple[float, str]]:
        while True:
            seg = self.log.segment(self.seq)
            if seg is None:  # not begun, or dropped since: on at the oldest one left
                seg = self.log.segments[0]
                self._skip_to(seg)
            if self.offset < seg.size:
                try:
                    with open(seg.path, "rb") as f:
                        f.seek(self.offset)
                        data = f.read(min(seg.size - self.offset, 4 << 20))
                except FileNotFoundError:  # deleted by someone else: what it held is lost
                    data = b""
                end = data.rfind(b"\n")
                if end >= 0:
                    lines = [parse_line(raw) for raw in data[:end].split(b"\n")]
                    self.offset += end + 1
                    self.lines += len(lines)
                    self.bytes += end + 1
                    return lines
                if seg is self.log.segments[-1]:
                    return []
            elif seg is self.log.segments[-1]:
                return []
            nxt = self.log.segment(seg.seq + 1)  # this one is complete (or unreadable): the next one
            if nxt is None:
                return []
            self._skip_to(nxt)


class ProcTable:
    """Replicas by (app_id, role, replica_id), started through the one Launcher."""

    def __init__(
        self,
        launcher: Launcher,
        log_root: Path,
        base_env: dict[str, str],
        log_limits: LogLimits | None = None,
        history_dir: Path | None = None,
        ledger: Ledger | None = None,
    ):
        """``history_dir``: the pool's state dir, where each replica's end is recorded as it ends
        (``history.py``); None: not recorded (a table without a pool)."""
        self._launcher = launcher
        self._history_dir = history_dir
        self.ledger = ledger  # what replicas hold of the host: taken at launch, given back at their end
        self._history_checked: set = set()  # app dirs of ended/ made and checked (history.record_end)
        self.history_error = ""  # the last failed record of an end, for `pool status`
        self._log_root = log_root
        self.log_store = LogStore(log_root, log_limits or LogLimits())
        self._base_env = base_env
        self.replicas: dict[tuple[str, str, int], Replica] = {}
        self._by_pid: dict[int, Replica] = {}
        # an exit can be reported before the spawn's caller resumes and registers the pid
        self._early_exits: dict[int, int] = {}
        self._ignored: set = set()  # spawned, then killed because the rest of the start failed
        self._tasks: set = set()
        self.last_change = time.time()
        # set by the agent when it ends for a reason it cannot vouch for (a signal: scancel,
        # walltime): the ends of replicas that die of that signal are then not recorded, so the
        # client records the engine's word for them ("allocation 12 is CANCELLED")
        self.ending_unrecorded = False

    @property
    def gpus_here(self) -> int:
        return len(self.ledger.load.capacity.gpus) if self.ledger is not None else 0

    @property
    def running(self) -> int:
        return sum(1 for r in self.replicas.values() if r.state in (PENDING, RUNNING))

    async def launch(self, spec: LaunchSpec) -> dict:
        key = (spec.app_id, spec.role, spec.replica_id)
        old = self.replicas.get(key)
        if old and old.state not in TERMINAL:
            raise ValueError(f"replica {spec.role}/{spec.replica_id} of {spec.app_id} is already running")
        if spec.resources is not None and self.ledger is not None:  # (CapacityRefused: nothing is started)
            holding = self.ledger.admit(owner(spec), Resources.from_wire(spec.resources))
            spec = dataclasses.replace(spec, env={**spec.env, **gpu_env(holding)})
        try:
            return await self._launch(spec, old)
        except BaseException:  # before the replica was in the table (once it is, its end gives them back)
            if self.ledger is not None and spec.resources is not None and self.replicas.get(key) is old:
                self.ledger.release(owner(spec))
            raise

    async def _launch(self, spec: LaunchSpec, old: Replica | None) -> dict:
        key = (spec.app_id, spec.role, spec.replica_id)
        log_dir = self._log_root / spec.app_id / spec.role / str(spec.replica_id)
        private_dir(log_dir, check=False)  # logs may hold secrets from env or args
        if old is not None:  # the same replica again: its log goes on
            old.log.restart()
        if self._history_dir is not None:  # (a start made again: the end of the first no longer holds)
            with contextlib.suppress(OSError):
                forget_end(self._history_dir, spec.app_id, spec.role, spec.replica_id)
        rep = Replica(spec, log_dir, old.log if old is not None else self.log_store.open(log_dir))
        self.replicas[key] = rep
        # shielded: a client that goes away mid-launch must not leave a half-started process behind
        await asyncio.shield(self._start(rep))
        return rep.status()

    def _start(self, rep: Replica) -> asyncio.Task[None]:
        task = asyncio.ensure_future(self._attempt(rep))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _attempt(self, rep: Replica) -> None:
        """One attempt; never raises: whatever goes wrong ends as the replica's FAILED reason."""
        if rep.cancelled:
            self._finish(rep, CANCELLED, None, rep.cancel_reason)
            return
        loop = asyncio.get_running_loop()
        rep.attempts += 1
        env = {**self._base_env, **rep.spec.inherited_env, **rep.spec.env}
        if "PATH" in rep.spec.inherited_env and "PATH" not in rep.spec.env:  # the pool's python first, as in base_env
            env["PATH"] = os.pathsep.join(
                (os.path.dirname(os.path.abspath(sys.executable)), rep.spec.inherited_env["PATH"])
            )
        # where a torchrun (or any @record entrypoint) writes why it failed, as TorchX's local_cwd sets it
        env.setdefault(ERROR_FILE_ENV, str(rep.log_dir / "error.json"))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(rep.log_dir / "error.json")
        fds: list[int] = []
        pid: int | None = None
        captures: list[_Capture] = []
        try:
            for _ in STREAMS:
                fds += os.pipe()
            pid = await self._launcher.spawn(rep.spec.argv, env, rep.spec.cwd, fds[1], fds[3])
            for w in (fds[1], fds[3]):
                os.close(w)
            reads, fds = [fds[0], fds[2]], [fds[0], fds[2]]
            tees = (rep.spec.stdout_path, rep.spec.stderr_path)
            for r, name, tee in zip(reads, STREAMS, tees):
                proto = _Capture(rep.log.streams[name], rep.notify, tee)
                captures.append(proto)  # (from here on it counts as a writer of its stream: ended below if need be)
                pipe = os.fdopen(r, "rb", buffering=0)
                fds.remove(r)

                def capture(p: _Capture = proto) -> _Capture:
                    return p

                try:
                    await loop.connect_read_pipe(capture, pipe)
                except BaseException:
                    pipe.close()
                    raise
        except Exception as e:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            for c in captures:
                c.connection_lost(None)
            if pid is not None:
                self._ignored.add(pid)
                _signal_group(pid, signal.SIGKILL)
            reason = str(e) if isinstance(e, SpawnError) else f"could not start: {type(e).__name__}: {e}"
            self._finish(rep, FAILED, 127 if isinstance(e, SpawnError) else None, reason)
            return
        rep.captures = captures
        if rep.spec.timeout_s:
            t = rep.spec.timeout_s
            rep.timers = [
                loop.call_later(max(0.0, t - rep.spec.signal_delay_s), _signal_proc, pid, signal.SIGUSR2),
                loop.call_later(t, self._time_out, rep, pid),
            ]
        rep.pid = pid
        rep.state = RUNNING
        self._by_pid[pid] = rep
        self.last_change = time.time()
        rep.notify()
        if pid in self._early_exits:
            self.on_exit(pid, self._early_exits.pop(pid))
        elif rep.cancelled:  # cancelled while it was starting
            _signal_group(pid, signal.SIGTERM)

    def _finish(self, rep: Replica, state: str, code: int | None, msg: str) -> None:
        rep.state, rep.exit_code, rep.msg, rep.ended = state, code, msg, time.time()
        self.last_change = time.time()
        rep.log.finish()
        self._record_end(rep)
        if self.ledger is not None:
            self.ledger.release(owner(rep.spec))
        rep.notify()

    def _record_end(self, rep: Replica) -> None:
        """Writes how ``rep`` ended where it outlives this agent (``history.py``). Before anyone
        is told (``notify``), so a client that saw the end can always read it back."""
        if self._history_dir is None or not rep.record_end:
            return
        s = rep.spec
        try:
            record_end(
                self._history_dir,
                ReplicaEnd(
                    s.app_id,
                    s.role,
                    s.replica_id,
                    rep.state,
                    rep.exit_code,
                    rep.msg,
                    rep.attempts,
                    rep.started,
                    rep.ended,
                    socket.gethostname(),
                ),
                self._history_checked,
            )
            rep.recorded = True
        except OSError as e:  # a full disk: the agent still answers while it lives
            self.history_error = f"cannot record replica ends in {self._history_dir}: {e.strerror or e}"

    @property
    def base_env(self) -> dict[str, str]:
        """What every process this host starts begins with (a copy)."""
        return dict(self._base_env)

    def take_early_exit(self, pid: int) -> int | None:
        """The exit code of ``pid`` if its end came before whoever started it knew its pid (a
        process not of this table: ``agent/shell.py``), taken off the table."""
        return self._early_exits.pop(pid, None)

    def forget(self, key: tuple[str, str, int]) -> None:
        """Drops an ended replica from the table; its files stay, counted in the host's log limit."""
        rep = self.replicas.pop(key, None)
        if rep is not None:
            self.log_store.forget(rep.log)

    def _time_out(self, rep: Replica, pid: int) -> None:
        if self._by_pid.get(pid) is rep:
            rep.timed_out = True
            _signal_group(pid, signal.SIGTERM)
            rep.timers.append(asyncio.get_running_loop().call_later(3.0, self._kill_if_live, pid, rep))

    def _kill_if_live(self, pid: int, rep: Replica) -> None:
        if self._by_pid.get(pid) is rep:
            _signal_group(pid, signal.SIGKILL)

    def on_exit(self, pid: int, code: int) -> None:
        if pid in self._ignored:
            self._ignored.discard(pid)
            return
        rep = self._by_pid.pop(pid, None)
        if rep is None:
            self._early_exits[pid] = code
            return
        for timer in rep.timers:
            timer.cancel()
        # the leader is gone: what it left in its process group goes too (as SLURM does for a step),
        # so nothing holds the output pipes open or outlives the replica
        if _signal_group(pid, signal.SIGTERM):
            asyncio.get_running_loop().call_later(3.0, _signal_group, pid, signal.SIGKILL)
        if killed_by_job_signal(code) and not (rep.cancelled or rep.timed_out or self.ending_unrecorded):
            # a signal this agent did not send: one to the whole job (scancel) reaches the agent a
            # moment apart, and its handler, not this exit, should say what ended the replica
            asyncio.get_running_loop().call_later(SIGNAL_SETTLE_S, self._settle_exit, rep, code)
        else:
            self._settle_exit(rep, code)

    def _settle_exit(self, rep: Replica, code: int) -> None:
        """What ``rep``'s exit with ``code`` means: its end, or its next attempt."""
        if rep.cancelled:
            self._finish(rep, CANCELLED, code, rep.cancel_reason)
        elif self.ending_unrecorded and killed_by_job_signal(code):
            rep.record_end = False  # (the job's end, not the replica's: see ``ending_unrecorded``)
            self._finish(rep, FAILED, code, f"{describe_exit(code)}: its agent is ending too")
        elif rep.timed_out:
            self._finish(rep, FAILED, code, f"timed out after {rep.spec.timeout_s:.0f} s")
        elif code == rep.spec.requeue_code and rep.requeues < MAX_REQUEUES:
            rep.requeues += 1
            rep.msg = f"requeued ({rep.requeues})"
            self._start(rep)
        elif code == 0:
            self._finish(rep, SUCCEEDED, 0, "")
        elif rep.attempts - rep.requeues <= rep.spec.max_retries:
            rep.msg = f"attempt {rep.attempts} {describe_exit(code)}; retrying"
            rep.exit_code = code
            self._start(rep)
        else:
            retries = f" after {rep.attempts} attempts" if rep.attempts > 1 else ""

            def fail() -> None:
                reason = read_error_file(rep.log_dir / "error.json") or last_stderr_line(rep.log.streams["stderr"])
                self._finish(rep, FAILED, code, f"{describe_exit(code)}{retries}" + (f": {reason}" if reason else ""))

            self._after_output(rep, fail)

    def _after_output(self, rep: Replica, then: Callable[[], None], timeout: float = 1.0) -> None:
        """Runs ``then`` once the replica's pipes have been read to their end (at most ``timeout``
        seconds on: a child of it may hold them): a quick failure's exit can be heard before its
        last stderr line is read, and that line is what its FAILED message quotes."""
        pending = [c.closed for c in rep.captures if not c.closed.done()]
        if not pending:
            then()
            return

        async def wait() -> None:
            try:
                await asyncio.wait(pending, timeout=timeout)
            finally:
                then()

        task = asyncio.ensure_future(wait())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def on_launcher_death(self, reason: str, pids: Iterable[int]) -> None:
        """The fork server that started these pids is gone (and took its children with it)."""
        for pid in pids:
            rep = self._by_pid.pop(pid, None)
            if rep is not None:
                for timer in rep.timers:
                    timer.cancel()
                # not recorded: a signal to the whole job (scancel) kills the fork servers first, and
                # the engine's word for it is the truer end (the client records it, or this agent's answer)
                rep.record_end = False
                self._finish(rep, FAILED, None, reason)

    def select(self, app_id: str | None, role: str | None = None, replica_id: int | None = None) -> list[Replica]:
        return [
            r
            for (a, ro, i), r in self.replicas.items()
            if (app_id is None or a == app_id)
            and (role is None or ro == role)
            and (replica_id is None or i == replica_id)
        ]

    async def kill(
        self, reps: list[Replica], grace: float = 5.0, reason: str = "cancelled", record: bool = True
    ) -> int:
        """SIGTERM the replicas' process groups, SIGKILL what is left after ``grace`` seconds.
        ``reason``: what their end says (``torchx cancel``, the agent stopping and why);
        ``record``: whether that end is recorded (``history.py``)."""
        live = [r for r in reps if r.state in (PENDING, RUNNING)]
        for r in live:
            r.cancelled = True  # a start in progress sees this and stops its process
            r.cancel_reason = reason
            r.record_end = record
        live = [r for r in live if r.pid is not None and self._by_pid.get(r.pid) is r]
        for r in live:
            _signal_group(r.pid, signal.SIGTERM)  # type: ignore[arg-type]
        deadline = time.time() + grace
        while time.time() < deadline and any(r.state == RUNNING for r in live):
            await asyncio.sleep(0.05)
        for r in live:
            if r.state == RUNNING:
                _signal_group(r.pid, signal.SIGKILL)  # type: ignore[arg-type]
        # and their ends heard (briefly): what a stopping agent removes of theirs next (their temp
        # dirs, ``remove_dead_temp_dirs``) must find them dead, not dying
        deadline = time.time() + KILL_REAP_S
        while time.time() < deadline and any(r.state == RUNNING for r in live):
            await asyncio.sleep(0.02)
        return len(live)

    async def logs(
        self,
        rep: Replica,
        streams: str,
        since: float | None,
        until: float | None,
        regex: str | None,
        follow: bool,
    ) -> AsyncIterator[list[str]]:
        """Batches of lines (each ending in a newline), in time order; follows until the replica ends."""
        names = STREAMS if streams == "combined" else (streams,)
        if any(n not in STREAMS for n in names):
            raise ValueError(f"unknown stream {streams!r}: use stdout, stderr or combined")
        pattern = re.compile(regex) if regex else None
        tails = [_Tail(rep.log.streams[n]) for n in names]
        failed = rep.log.failed(names)
        if failed.lines:
            yield [_lost_notice(failed, names)]
        first = True
        while True:
            done = rep.output_done  # read before draining, so no line written after it is missed
            batches = [t.read() for t in tails]
            gap = DropCount()
            for t in tails:
                gap.add(t.gap)
                t.gap = DropCount()
            if gap.lines and (since is None or since <= gap.until):
                yield [_drop_notice(gap, names, first)]
            first = False
            lines = list(heapq.merge(*batches, key=lambda x: x[0])) if len(batches) > 1 else batches[0]
            out = [
                line + "\n"
                for ts, line in lines
                if (since is None or ts >= since)
                and (until is None or ts <= until)
                and (pattern is None or pattern.search(line))
            ]
            for i in range(0, len(out), BATCH_LINES):
                yield out[i : i + BATCH_LINES]
            if lines:
                continue
            if not follow or done:
                return
            await rep.wait_change(1.0)


def owner(spec: LaunchSpec) -> str:
    """Who holds a replica's resources on its host: "APP/ROLE/REPLICA"."""
    return f"{spec.app_id}/{spec.role}/{spec.replica_id}"


def _what(names: Sequence[str]) -> str:
    return "this replica's output" if len(names) > 1 else f"this replica's {names[0]}"


def _drop_notice(gap: DropCount, names: Sequence[str], first: bool) -> str:
    """The line ``torchx log`` shows where output was dropped to keep the log within its limit."""
    where = "earlier lines" if first else "lines here"
    return (
        f"[monarch-torchx: {gap.lines:,} {where} ({mib(gap.bytes)}) of {_what(names)} were dropped: "
        f"over the {gap.reason}]\n"
    )


def _lost_notice(failed: DropCount, names: Sequence[str]) -> str:
    return (
        f"[monarch-torchx: {failed.lines:,} lines ({mib(failed.bytes)}) of {_what(names)} could not be "
        f"written ({failed.reason}) and are lost]\n"
    )


def _signal_proc(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def _signal_group(pid: int, sig: int) -> bool:
    """Signals the process group led by pid; False when the group no longer exists."""
    try:
        os.killpg(pid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        try:
            os.kill(pid, sig)
            return True
        except OSError:
            return False
