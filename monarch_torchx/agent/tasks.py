"""Task groups, held by host 0's agent: submitit's worker mode (``task_groups.py``), where each
task is a call in a kept worker process rather than a process of its own.

Workers are apps of the pool's queue (``agent/queue.py``), so they start where they fit and wait
when nothing does, each holding one task's ask of its host while it lives: a group asks for as many
as it has tasks for, at most ``max_workers`` (else as many as the hosts' capacity holds). A worker
calls ``tasks.next`` with the ends of the tasks it ran and gets the next one; a worker that finds
none for WORKER_IDLE_S exits, so its slot frees for other work.

What is watched: each task that has run CHECK_AFTER_S, every CHECK_EVERY_S, by asking its
worker's host: a worker that ended (crashed, killed) fails its task; a task past its timeout has
its worker ended. A worker's launch that failed fails the tasks that wait for one.

Files, 0600 in the pool's private state dir: ``tasks/GROUP.json`` (the group), ``GROUP.tasks`` (its
tasks, a JSON line each, as submitted), ``GROUP.ends`` (each end, a JSON line). A host 0 started
again (the next run repairs it) reads them back, and the tasks without an end run again: a task
may so run twice (at least once), never silently lost. `pool stop` ends what is left CANCELLED.

A pool lives for days and runs map_arrays of any size: the groups whose tasks all ended are
forgotten, oldest first (memory and files), once they hold more than KEEP_ENDED_TASKS tasks in
all. A forgotten task's result, where it left one, is still in submitit's folder, which is what
its job reads first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..app_queue import QueueState, SubmittedApp
from ..private import PrivatePathError, private_dir
from ..registry import write_private
from ..resources import HostLoad, Resources
from ..specs import CANCELLED, FAILED, PENDING, RUNNING, LaunchSpec, ReplicaStatus
from ..task_groups import (
    FOLDER_ENV,
    GROUP_ENV,
    HOLDER_ENV,
    HOLDER_IDENTITY_ENV,
    HOLDER_PORT_ENV,
    WORKER_ENV,
    WORKER_ROLE,
    Assignment,
    Task,
    TaskGroup,
    TaskStatus,
)

if TYPE_CHECKING:
    from .server import Agent

log = logging.getLogger("monarch_torchx.agent")

WORKER_IDLE_S = 2.0  # a worker with nothing to do this long exits (its slot frees)
CHECK_EVERY_S = 1.0
CHECK_AFTER_S = 2.0  # a task that ran this long has its worker's host asked whether it still lives
KEEP_ENDED_TASKS = int(os.environ.get("MONARCH_TORCHX_KEEP_ENDED_TASKS", "100000"))


@dataclass
class _Worker:
    app_id: str
    task: str | None = None  # the task it runs now
    ended: bool = False  # exited, or is about to (told there is no work), or was ended
    asking: bool = False  # in a call to ``tasks.next`` now (so alive)
    took: int = 0  # tasks it was given
    seen: float = field(default_factory=time.time)  # when it was made or last called in
    host: int | None = None  # where the queue started it


@dataclass
class _Group:
    spec: TaskGroup
    tasks: dict[str, Task] = field(default_factory=dict)
    status: dict[str, TaskStatus] = field(default_factory=dict)
    pending: deque[str] = field(default_factory=deque)
    workers: dict[str, _Worker] = field(default_factory=dict)
    made: int = 0  # workers made so far (they are numbered)
    gone: set[str] = field(default_factory=set)  # workers ended and forgotten (a late call is told so)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    ended: int = 0  # tasks with a final state

    @property
    def finished(self) -> bool:
        """Every task ended and no worker is left: nothing of the group runs or will."""
        return self.ended == len(self.tasks) and not self.pending and not self.live_workers

    def wake(self) -> None:
        """Wakes the workers that wait for a task (each waits on the event it found)."""
        self.changed.set()
        self.changed = asyncio.Event()

    @property
    def live_workers(self) -> list[_Worker]:
        return [w for w in self.workers.values() if not w.ended]


class TaskHolder:
    """The ``tasks.*`` operations and the watch over running tasks (see the module's docstring)."""

    def __init__(self, agent: Agent):
        self.agent = agent
        self.dir = agent.state_dir / "tasks"
        self._dir_made = False
        self.groups: dict[str, _Group] = {}
        self.forgotten: set[str] = set()  # (ids only: what a late status of one is told)

    def operations(self) -> dict[str, Any]:
        return {
            "tasks.submit": self.op_submit,
            "tasks.next": self.op_next,
            "tasks.status": self.op_status,
            "tasks.cancel": self.op_cancel,
        }

    # ------------------------------------------------------------ operations

    async def op_submit(self, peer: Any, group: dict, tasks: list[dict], targets: list[dict]) -> int:
        """Adds ``tasks`` to ``group`` (made at its first submit) and asks the pool's queue for
        the workers they need; every task is on file before the answer. Returns how many it took."""
        self.agent.queue.require_holder()
        if self.agent.stopping.is_set():
            raise ValueError(f"agent {self.agent.index} is shutting down ({self.agent.stop_reason})")
        spec = TaskGroup.from_wire(group)
        new = [Task.from_wire(t) for t in tasks]  # (all checked before any is taken)
        g = self.groups.get(spec.group_id)
        if g is None:
            self.forgotten.discard(spec.group_id)
            g = self.groups[spec.group_id] = _Group(spec)
            self._write(self._path(spec.group_id, "json"), json.dumps({"group": group, "targets": targets}))
        for t in new:
            if t.task_id in g.tasks:
                raise ValueError(f"task {t.task_id} was already submitted to group {spec.group_id}")
        self._append(spec.group_id, "tasks", [t.to_wire() for t in new])
        for t in new:
            g.tasks[t.task_id] = t
            g.status[t.task_id] = TaskStatus(t.task_id)
            g.pending.append(t.task_id)
        self.agent.queue.set_targets(targets)
        await self.agent.queue.fill_loads()
        self._fill(g)
        g.wake()
        return len(new)

    async def op_next(self, peer: Any, group_id: str, worker: str, ended: list[dict], wait_s: float = 0.0) -> dict:
        """A worker's ends (``TaskStatus``es of the tasks it ran) and its next task (``Assignment``);
        with none pending it waits up to ``wait_s`` (at most WORKER_IDLE_S) for one."""
        self.agent.queue.require_holder()
        g = self.groups.get(group_id)
        if g is None:
            return Assignment(None, f"group {group_id} is not held here (its holder lost it)").to_wire()
        if worker in g.gone:
            return Assignment(None, "it was ended").to_wire()
        w = g.workers.setdefault(worker, _Worker(worker))  # (one made by a holder before this one: kept)
        ends = [TaskStatus.from_wire(e) for e in ended]
        self._ended(g, worker, ends)
        lost = w.task  # given to it, yet not among its ends: the answer that gave it was lost
        if lost is not None and lost not in {e.task_id for e in ends} and g.status[lost].state == RUNNING:
            g.status[lost] = TaskStatus(lost)
            g.pending.appendleft(lost)
        w.task = None
        deadline = time.monotonic() + max(0.0, min(float(wait_s), WORKER_IDLE_S))
        w.asking = True
        try:
            while not w.ended:
                if g.pending:
                    tid = g.pending.popleft()
                    st = g.status[tid]
                    st.state, st.started, st.worker = RUNNING, time.time(), worker
                    w.task = tid
                    w.took += 1
                    if not g.pending:  # (the workers still queued for the group are not needed now)
                        self._fill(g)
                    return Assignment(g.tasks[tid]).to_wire()
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(g.changed.wait(), timeout=left)
            why = "it was ended" if w.ended else f"no task came for {WORKER_IDLE_S:.0f} s"
            w.ended = True
            return Assignment(None, why).to_wire()
        finally:
            w.asking = False
            w.seen = time.time()

    async def op_status(self, peer: Any, group_id: str, task_ids: list[str]) -> list[dict]:
        """Each task's ``TaskStatus`` (FAILED, with why, for one this holder does not know)."""
        self.agent.queue.require_holder()
        g = self.groups.get(group_id)
        return [self._status(g, group_id, tid).to_wire() for tid in task_ids]

    async def op_cancel(self, peer: Any, group_id: str, task_ids: list[str] | None, reason: str = "cancelled") -> list:
        """Cancels tasks (all of the group's: None): a pending one does not run, a running one has
        its worker ended. Returns their ``TaskStatus``es."""
        self.agent.queue.require_holder()
        g = self.groups.get(group_id)
        if g is None:
            return [self._status(None, group_id, tid).to_wire() for tid in task_ids or []]
        ids = list(g.tasks) if task_ids is None else task_ids
        kills = []
        for tid in ids:
            st = g.status.get(tid)
            if st is None or st.terminal:
                continue
            if st.state == RUNNING and st.worker in g.workers:
                kills.append(self._end_worker(g, g.workers[st.worker], f"its task {tid} was cancelled"))
            with contextlib.suppress(ValueError):
                g.pending.remove(tid)
            self._record(g, TaskStatus(tid, CANCELLED, reason, st.started, time.time(), st.worker))
        await asyncio.gather(*kills, return_exceptions=True)
        self._fill(g)
        return [self._status(g, group_id, tid).to_wire() for tid in ids]

    def _status(self, g: _Group | None, group_id: str, tid: str) -> TaskStatus:
        st = g.status.get(tid) if g is not None else None
        if st is None:
            why = "group" if g is None else "task"
            return TaskStatus(
                tid,
                FAILED,
                f"the pool's queue (host 0) has no record of this {why} ({group_id}): it keeps the states of "
                f"the last {KEEP_ENDED_TASKS} ended tasks, and a result a task left is in submitit's folder",
                forgotten=group_id in self.forgotten,
            )
        return st

    # ------------------------------------------------------------ workers

    def _cap(self, g: _Group) -> int:
        """How many workers the group may have: ``max_workers``, else how many of one task's ask
        the pool's hosts hold in all (one per CPU for a task that asks nothing)."""
        if g.spec.max_workers:
            return g.spec.max_workers
        ask = Resources.from_wire(g.spec.worker.resources)
        loads = [ld for i, ld in self.agent.queue.loads.items() if i in self.agent.queue.targets]
        return max(1, sum(_fits(ask, ld) for ld in loads)) if loads else max(1, len(self.agent.queue.targets))

    def _fill(self, g: _Group) -> None:
        """Asks the queue for the workers the group's tasks need, or takes back queued ones it no
        longer needs."""
        live = g.live_workers
        busy = sum(1 for w in live if w.task is not None)
        want = min(len(g.pending) + busy, self._cap(g))
        for _ in range(want - len(live)):
            self._make_worker(g)
        surplus = len(live) - want
        for w in reversed(live):
            if surplus <= 0:
                break
            if w.app_id in self.agent.queue.waiting:  # (never started: nothing of it runs)
                self.agent.queue.end_waiting(w.app_id, "its task group needs no more workers", cancelled=True)
                w.ended = True
                surplus -= 1

    def _make_worker(self, g: _Group) -> None:
        spec = g.spec
        app_id = f"{spec.group_id}-{self.agent.incarnation[:6]}-w{g.made}"  # (unique across holders)
        g.made += 1
        addr = self.agent.addr
        assert addr is not None  # (it serves: it has an address)
        t = spec.worker
        env = {
            **t.env,
            HOLDER_ENV: addr.host,
            HOLDER_PORT_ENV: str(addr.port),
            HOLDER_IDENTITY_ENV: self.agent.server.identity.decode(),
            GROUP_ENV: spec.group_id,
            WORKER_ENV: app_id,
            FOLDER_ENV: spec.folder,
        }
        launch = LaunchSpec(
            app_id=app_id,
            role=WORKER_ROLE,
            replica_id=0,
            argv=list(t.argv),
            env=env,
            inherited_env=dict(t.inherited_env),
            cwd=t.cwd,
            resources=t.resources,
        )
        role = {"name": WORKER_ROLE, "image": spec.folder, "entrypoint": t.argv[0], "args": t.argv[1:]}
        g.workers[app_id] = _Worker(app_id)
        self.agent.queue.take(SubmittedApp(app_id, f"{spec.name}-worker", [role | {"num_replicas": 1}], [launch]))

    async def _end_worker(self, g: _Group, w: _Worker, reason: str) -> None:
        """Ends a worker (its task, if any, is ended by the caller)."""
        w.ended = True
        w.task = None
        if w.app_id in self.agent.queue.waiting:
            self.agent.queue.end_waiting(w.app_id, reason, cancelled=True)
            return
        host = self._host_of(w)
        if host is not None:
            await self.agent.queue.quiet_call(host, "kill", app_id=w.app_id, grace=1.0, reason=reason)

    def _host_of(self, w: _Worker) -> int | None:
        """Where the queue started ``w`` (kept: the queue forgets the oldest apps it started)."""
        if w.host is None:
            entry = self.agent.queue.done.get(w.app_id)
            if entry is not None and entry.state == QueueState.STARTED and entry.placement:
                w.host = entry.placement[0].host_index
        return w.host

    # ------------------------------------------------------------ ends

    def _ended(self, g: _Group, worker: str, ends: list[TaskStatus]) -> None:
        """A worker's word on the tasks it ran: each recorded, unless the task ended otherwise
        meanwhile (cancelled, timed out: those are final)."""
        for e in ends:
            st = g.status.get(e.task_id)
            if st is not None and st.state == RUNNING and st.worker == worker:
                self._record(g, e)

    def _record(self, g: _Group, st: TaskStatus) -> None:
        was = g.status.get(st.task_id)
        if st.terminal and (was is None or not was.terminal):
            g.ended += 1
        g.status[st.task_id] = st
        self._append(g.spec.group_id, "ends", [st.to_wire()])

    def _forget_finished(self) -> None:
        """Forgets the oldest finished groups (memory and files) while the finished ones hold more
        than KEEP_ENDED_TASKS tasks in all (see the module's docstring)."""
        finished = [g for g in self.groups.values() if g.finished]
        held = sum(len(g.tasks) for g in finished)
        for g in finished:  # (oldest first: groups are kept in the order they came)
            if held <= KEEP_ENDED_TASKS:
                break
            held -= len(g.tasks)
            del self.groups[g.spec.group_id]
            self.forgotten.add(g.spec.group_id)
            for kind in ("json", "tasks", "ends"):
                with contextlib.suppress(OSError):
                    self._path(g.spec.group_id, kind).unlink()
            log.info("forgot task group %s: its %d task(s) ended", g.spec.group_id, len(g.tasks))

    async def _check(self) -> None:
        """One look at the workers: a task that has run CHECK_AFTER_S, or a worker that has not
        called in that long (started, but not yet asking), has its worker asked of its host."""
        self._forget_finished()
        now = time.time()
        asks: list[tuple[int, _Group, _Worker]] = []
        for g in list(self.groups.values()):
            for w in list(g.workers.values()):
                if w.ended and w.task is None:
                    del g.workers[w.app_id]
                    g.gone.add(w.app_id)
                    continue
                if w.ended or w.asking:
                    continue
                entry = self.agent.queue.done.get(w.app_id)
                if entry is None and w.host is None:
                    continue  # (waits in the queue)
                if entry is not None and entry.state == QueueState.ENDED:
                    self._worker_gone(g, w, f"no worker could start: {entry.reason}", entry.cancelled)
                    continue
                st = g.status.get(w.task) if w.task else None
                if st is not None and st.started is not None and now - st.started > g.spec.timeout_s:
                    why = f"timed out after {g.spec.timeout_s:.0f} s"
                    self._record(g, TaskStatus(st.task_id, FAILED, why, st.started, now, w.app_id))
                    await self._end_worker(g, w, f"its task {st.task_id} {why}")
                    self._fill(g)
                    continue
                since = st.started if st is not None and st.started is not None else w.seen
                host = self._host_of(w)
                if now - since >= CHECK_AFTER_S and host is not None:
                    asks.append((host, g, w))
        for host, g, w in asks:
            got = await self.agent.queue.quiet_call(host, "describe", app_id=w.app_id)
            if got is None or w.ended or w.asking:
                continue  # (the host did not answer, or the worker called in meanwhile: looked at again)
            if got:
                rep = ReplicaStatus.from_wire(got[0])
                if not rep.state.terminal:
                    continue
                said = rep.msg or rep.state.value
            else:
                said = f"host {host} has no such process (it was replaced)"
            if w.task is not None:
                st = g.status[w.task]
                why = f"its worker {w.app_id} ended while it ran: {said}"
                self._record(g, TaskStatus(st.task_id, FAILED, why, st.started, time.time(), w.app_id))
                w.ended, w.task = True, None
                self._fill(g)
            else:
                self._worker_gone(g, w, f"its worker {w.app_id} exited before it took a task: {said}", w.took > 0)

    def _worker_gone(self, g: _Group, w: _Worker, reason: str, expected: bool) -> None:
        """A worker that will take no task: one that ran tasks before, or was cancelled, is
        replaced if need be; one that never took a task failed to start, and when no worker is
        left the tasks that wait fail with why, rather than wait forever for a broken worker."""
        w.ended = True
        if expected:
            self._fill(g)
            return
        if g.live_workers:
            return
        now = time.time()
        while g.pending:
            tid = g.pending.popleft()
            self._record(g, TaskStatus(tid, FAILED, reason, None, now))

    async def run(self) -> None:
        """Reads back what a previous holder left, then looks over running tasks every CHECK_EVERY_S."""
        if not self.agent.queue.holder:
            return
        self._read_back()  # (the queue read its own files back first: it was started first)
        if any(g.pending for g in self.groups.values()):
            await self.agent.queue.fill_loads()
            for g in self.groups.values():
                if g.pending:
                    self._fill(g)
        while not self.agent.stopping.is_set():
            await asyncio.sleep(CHECK_EVERY_S)
            try:
                await self._check()
            except Exception:  # noqa: BLE001 (a bad look must not end the watch: the next one tries again)
                log.exception("a look over the pool's task groups failed")

    def stop(self) -> None:
        """The agent stops. Asked to (`pool stop`): what is left of each group ends CANCELLED.
        Otherwise (a signal, a successor) the files stay for the next holder."""
        if not self.agent.stop_requested:
            return
        now = time.time()
        for g in self.groups.values():
            for st in list(g.status.values()):
                if not st.terminal:
                    why = f"its pool was stopped ({self.agent.stop_reason})"
                    self._record(g, TaskStatus(st.task_id, CANCELLED, why, st.started, now, st.worker))
            g.pending.clear()

    # ------------------------------------------------------------ files

    def _path(self, group_id: str, kind: str) -> Path:
        return self.dir / f"{group_id}.{kind}"

    def _ensure_dir(self) -> None:
        if not self._dir_made:
            private_dir(self.dir, from_=self.agent.state_dir)
            self._dir_made = True

    def _write(self, path: Path, data: str) -> None:
        try:
            self._ensure_dir()
            write_private(path, data)
        except (OSError, PrivatePathError) as e:
            log.error("cannot keep the task group file %s: %s", path, e)

    def _append(self, group_id: str, kind: str, records: list[dict]) -> None:
        """Appends JSON lines (one write: a reader sees whole lines)."""
        try:
            self._ensure_dir()
            fd = os.open(self._path(group_id, kind), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, "".join(json.dumps(r) + "\n" for r in records).encode())
            finally:
                os.close(fd)
        except (OSError, PrivatePathError) as e:
            log.error("cannot keep the task group file %s.%s: %s", group_id, kind, e)

    def _read_back(self) -> None:
        """The groups a previous holder left: their tasks without an end are pending again."""
        if not self.dir.is_dir():
            return
        for p in sorted(self.dir.glob("*.json")):
            group_id = p.stem
            try:
                head = json.loads(p.read_text())
                g = _Group(TaskGroup.from_wire(head["group"]))
                for line in _lines(self._path(group_id, "tasks")):
                    t = Task.from_wire(line)
                    g.tasks[t.task_id] = t
                    g.status[t.task_id] = TaskStatus(t.task_id)
                for line in _lines(self._path(group_id, "ends")):
                    st = TaskStatus.from_wire(line)
                    if st.task_id in g.status:
                        g.status[st.task_id] = st
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.error("unreadable task group %s: %s", p, e)
                continue
            g.pending.extend(tid for tid, st in g.status.items() if st.state in (PENDING, RUNNING))
            for tid in g.pending:
                g.status[tid] = TaskStatus(tid)
            g.ended = sum(1 for st in g.status.values() if st.terminal)
            self.groups[group_id] = g
            for app_id in [a for a in self.agent.queue.waiting if a.startswith(f"{group_id}-")]:
                # a previous holder's workers, queued: they would dial it, not this one
                self.agent.queue.end_waiting(app_id, "its task group's holder was replaced", cancelled=True)
            if g.pending:
                if not self.agent.queue.targets:
                    self.agent.queue.set_targets(head.get("targets", []))
                log.info("read back task group %s: %d task(s) to run", group_id, len(g.pending))


def _fits(ask: Resources, load: HostLoad) -> int:
    """How many of ``ask`` the host's capacity holds (one per CPU for an ask of nothing)."""
    total = load.capacity.total
    ask = ask.within(total)  # (more CPUs than a host has is the whole host: see scheduling)
    counts = []
    if ask.cpus:
        counts.append(int(total.cpus // ask.cpus))
    if ask.gpus:
        counts.append(total.gpus // ask.gpus)
    if ask.mem_mb:
        counts.append(total.mem_mb // ask.mem_mb)
    return min(counts) if counts else max(1, int(total.cpus))


def _lines(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]
