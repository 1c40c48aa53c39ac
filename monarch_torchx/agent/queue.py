"""The pool's queue: apps that did not fit when they were submitted, held by host 0's agent and
started as capacity frees, whether or not the client that submitted them is still there.

Where it lives: in host 0's agent, and in one file per app under the pool's state dir
(``queue/APP.json``, 0600), written before a submit is answered. A host 0 that is lost and started
again (the next run repairs it) reads them back, so the queue outlives its holder wherever the
state dir does: local and SLURM pools keep it on the submitting user's file system. A Kubernetes
host's state dir is its pod's own: a lost host 0 loses its queue there, and each app it held then
reads FAILED with that reason (``apps.py``), never PENDING forever.

How it learns that capacity freed: it watches every host's load (the ``capacity`` operation with
``after``, answered at the next change), so an ended replica starts the next app at once; it
also passes over the queue every few seconds regardless. Order: ``scheduling.schedule``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..app_queue import QUEUE_HOST, QueueBacklog, QueueEntry, QueueState, SubmittedApp, WaitingApp
from ..errors import MonarchError
from ..history import ReplicaEnd, record_end
from ..net import RemoteError, WireError
from ..net.blocking import Client
from ..net.fanout import Target
from ..private import PrivatePathError, private_dir
from ..registry import Placement, Registry, write_private
from ..resources import CapacityRefused, Holding, HostLoad, NeverFits, Resources
from ..scheduling import AppAsk, ReplicaKey, check_fits_somewhere, schedule
from ..specs import CANCELLED, FAILED, may_requeue
from .procs import owner

if TYPE_CHECKING:
    from .server import Agent

log = logging.getLogger("monarch_torchx.agent")

PASS_EVERY_S = 2.0  # a pass over the queue at least this often while it holds apps
WATCH_S = 20.0  # how long one watch of a host's load waits for a change
KEEP_DONE = 2000  # apps that left the queue, remembered for `torchx status` (the oldest forgotten first)
CALL_TIMEOUT_S = 30.0


@dataclass
class _Waiting:
    app: SubmittedApp
    reason: str = "waits to be placed"
    ask: AppAsk = field(init=False)
    since: float = field(default_factory=time.monotonic)  # (this agent's clock: a client's may be skewed)

    def __post_init__(self) -> None:
        self.ask = self.app.ask()  # (once: a pass reads every waiting app's)


@dataclass
class _Watch:
    generation: int = -1
    failures: int = 0
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class PoolQueue:
    """The ``queue.*`` operations and the loop that starts queued apps (see the module's docstring)."""

    def __init__(self, agent: Agent):
        self.agent = agent
        self.dir = agent.state_dir / "queue"
        self._dir_made = False  # made and checked once: it is inside the agent's own private state dir
        self.waiting: dict[str, _Waiting] = {}  # in order of submission: first come, first served
        self.done: dict[str, QueueEntry] = {}
        self.targets: dict[int, Target] = {}
        self.loads: dict[int, HostLoad] = {}
        self._watches: dict[int, _Watch] = {}
        self._clients: dict[int, list[Client]] = {}
        self._threads: ThreadPoolExecutor | None = None
        self._wake = asyncio.Event()
        self._pass_lock = asyncio.Lock()

    def operations(self) -> dict[str, Any]:
        return {
            "queue.submit": self.op_submit,
            "queue.status": self.op_status,
            "queue.cancel": self.op_cancel,
            "queue.stranded": self.op_stranded,
        }

    @property
    def holder(self) -> bool:
        return self.agent.index == QUEUE_HOST

    def require_holder(self) -> None:
        if not self.holder:
            raise ValueError(f"the pool's queue is on host {QUEUE_HOST}, not host {self.agent.index}")

    # ------------------------------------------------------------ operations

    async def op_submit(self, peer: Any, apps: list[dict], targets: list[dict]) -> list[dict]:
        """Queues ``apps`` (``SubmittedApp``s, in order) and passes over the queue at once: each
        answer says STARTED (with its placement) or QUEUED (what it waits for, its place in line)."""
        self.require_holder()
        if self.agent.stopping.is_set():
            raise ValueError(f"agent {self.agent.index} is shutting down ({self.agent.stop_reason})")
        subs = [SubmittedApp.from_wire(a) for a in apps]  # (all checked before any is queued)
        for sub in subs:
            if sub.app_id in self.waiting or sub.app_id in self.done:
                raise ValueError(f"app {sub.app_id} was already submitted to this pool's queue")
        self.set_targets(targets)
        for sub in subs:
            self.waiting[sub.app_id] = _Waiting(sub)
            self._save(sub.app_id)  # before the answer: a queued app is never only in memory
        await self._pass()
        return [self.entry(sub.app_id).to_wire() for sub in subs]

    def take(self, sub: SubmittedApp) -> None:
        """Queues an app this agent made itself (a task group's worker: ``agent/tasks.py``); it
        starts at the next pass that finds room for it, as a submitted one would."""
        self.require_holder()
        self.waiting[sub.app_id] = _Waiting(sub)
        self._save(sub.app_id)
        self._wake.set()

    async def op_status(self, peer: Any, app_ids: list[str], targets: list[dict] | None = None) -> list[dict]:
        """What the queue says of each app (UNKNOWN: it has no such app); ``targets``: the
        pool's hosts as the asking client knows them (a replaced host's new address)."""
        self.require_holder()
        if targets:
            self.set_targets(targets)
        return [self.entry(a).to_wire() for a in app_ids]

    async def op_cancel(self, peer: Any, app_id: str, reason: str = "cancelled") -> dict:
        """Takes a waiting app out of the queue (ENDED, cancelled); an app already started is
        answered as STARTED, for the caller to end its replicas."""
        self.require_holder()
        if app_id in self.waiting:
            self.end_waiting(app_id, reason, cancelled=True)
        return self.entry(app_id).to_wire()

    def backlog(self) -> QueueBacklog:
        """What waits, and the hosts' loads as the last pass knew them (``QueueBacklog``)."""
        now = time.monotonic()
        return QueueBacklog(
            [WaitingApp(a, w.ask, now - w.since) for a, w in self.waiting.items()],
            [self.loads[i] for i in sorted(self.loads) if i in self.targets],
            len(self.targets),
        )

    async def op_stranded(self, peer: Any, hosts: int) -> list[str]:
        """The waiting apps that could never start on the pool's first ``hosts`` hosts (a shrink
        to that many would leave them waiting forever), each with why; asked before a shrink."""
        self.require_holder()
        await self.fill_loads()
        out = []
        for app_id, w in self.waiting.items():
            kept = [h for i, h in sorted(self.loads.items()) if i < hosts and (w.ask.hosts is None or i in w.ask.hosts)]
            if not kept:
                out.append(f"{app_id} (it may start only on host(s) {sorted(w.ask.hosts or ())})")
                continue
            try:
                check_fits_somewhere(w.ask, kept, self.agent.pool)
            except NeverFits as e:
                out.append(f"{app_id} ({e})")
        return out

    def entry(self, app_id: str) -> QueueEntry:
        w = self.waiting.get(app_id)
        if w is not None:
            return QueueEntry(app_id, QueueState.QUEUED, w.reason)
        done = self.done.get(app_id)
        if done is not None:
            return done
        return QueueEntry(
            app_id,
            QueueState.UNKNOWN,
            f"the pool's queue (host {QUEUE_HOST}, incarnation {self.agent.incarnation}) has no record of it: "
            f"its holder was lost with the queue's files",
        )

    # ------------------------------------------------------------ the loop

    async def run(self) -> None:
        """Reads back what a previous holder left, then passes over the queue whenever a host's
        load changes, and every PASS_EVERY_S."""
        if not self.holder:
            return
        self._read_back()
        while not self.agent.stopping.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=PASS_EVERY_S)
            self._wake.clear()
            if self.waiting:
                try:
                    await self._pass()
                except Exception:  # noqa: BLE001 (a bad pass must not end the queue: the next one tries again)
                    log.exception("a pass over the pool's queue failed")

    async def _pass(self) -> None:
        async with self._pass_lock:
            if not self.waiting:
                return
            await self.fill_loads()
            self._watch_all()
            loads = [self.loads[i] for i in sorted(self.loads) if i in self.targets]
            plan = schedule([w.ask for w in self.waiting.values()], loads)
            for app_id, placement in plan.start:
                if app_id in self.waiting:
                    await self._start(app_id, placement)
            missing = len(loads) < len(self.targets)  # (with every host answering, all of them fit some day)
            for app_id, why in plan.waiting.items():
                w = self.waiting.get(app_id)
                if w is None:
                    continue
                w.reason = why
                if missing:
                    try:
                        check_fits_somewhere(w.ask, loads, self.agent.pool)
                    except NeverFits as e:
                        w.reason = (
                            f"cannot start on the {len(loads)} of {len(self.targets)} host(s) that answer now: {e}"
                        )
            self.agent.ledger.set_queued(len(self.waiting))

    async def _start(self, app_id: str, placement: dict[ReplicaKey, int]) -> None:
        """Launches a placed app, all or nothing. A host that refuses for capacity (its load had
        changed) leaves the app waiting; any other failure ends it FAILED with the reason."""
        sub = self.waiting[app_id].app
        hosts = sorted(set(placement.values()))
        addresses = {i: self.targets[i].host for i in hosts}
        try:
            ports = {}
            for role, h in sub.store_hosts(placement).items():
                ports[role] = await self._call(h, "reserve_port", hold_for=app_id)
            by_host: dict[int, list[dict]] = {}
            for h, spec in sub.launches(placement, addresses, ports):
                by_host.setdefault(h, []).append({"spec": dict(vars(spec))})
        except Exception as e:  # noqa: BLE001 (a store host that did not answer: tried again at the next pass)
            if app_id in self.waiting:
                self.waiting[app_id].reason = f"its store host could not be reached: {e}"
            return
        results = await asyncio.gather(
            *(self._calls(h, "launch", calls) for h, calls in by_host.items()), return_exceptions=True
        )
        if app_id not in self.waiting:  # ended (cancelled) while it was being started: what started goes
            await asyncio.gather(*(self.quiet_call(h, "kill", app_id=app_id) for h in by_host), return_exceptions=True)
            return
        failed = {h: r for h, r in zip(by_host, results) if isinstance(r, BaseException)}
        if failed:
            await asyncio.gather(*(self.quiet_call(h, "kill", app_id=app_id) for h in by_host), return_exceptions=True)
            # a host whose load was old, or that did not answer (replaced, or gone): the app waits on
            if all(isinstance(e, (CapacityRefused, WireError, OSError)) for e in failed.values()):
                for h in failed:  # (asked afresh before the next pass)
                    self.loads.pop(h, None)
                self._wake.set()
                return
            self.end_waiting(app_id, "; ".join(f"could not start on host {h}: {e}" for h, e in sorted(failed.items())))
            return
        full = sub.per_replica(placement)
        for spec in sub.specs:  # counted now, before the host's own word on it arrives
            load = self.loads.get(full[(spec.role, spec.replica_id)])
            if load is not None:
                ask = Resources.from_wire(spec.resources).within(load.capacity.total)
                load.holdings.append(Holding(owner(spec), ask))
        self.done[app_id] = QueueEntry(
            app_id,
            QueueState.STARTED,
            placement=[Placement(role, k, h, self._incarnation(h)) for (role, k), h in sorted(full.items())],
            retry_specs=[c["spec"] for calls in by_host.values() for c in calls if may_requeue(c["spec"], 0)],
        )
        del self.waiting[app_id]
        self._save(app_id)
        self._trim_done()
        log.info("queued app %s started on host(s) %s", app_id, hosts)

    def end_waiting(self, app_id: str, reason: str, cancelled: bool = False) -> None:
        """Takes an app out of the queue without starting it; each replica's end is recorded
        (CANCELLED or FAILED, with ``reason``), as a started replica's would be."""
        w = self.waiting.pop(app_id)
        self.done[app_id] = QueueEntry(app_id, QueueState.ENDED, reason, cancelled=cancelled)
        now = time.time()
        for s in w.app.specs:
            with contextlib.suppress(OSError, ValueError):
                record_end(
                    self.agent.state_dir,
                    ReplicaEnd(
                        s.app_id, s.role, s.replica_id, CANCELLED if cancelled else FAILED, None, reason, 0, None, now
                    ),
                )
        self._save(app_id)
        self._trim_done()
        self.agent.ledger.set_queued(len(self.waiting))

    def stop(self) -> None:
        """The agent stops. Asked to (`pool stop`): every waiting app ends CANCELLED with the
        reason. Otherwise (a signal, a successor): the queue stays on file for the next holder."""
        if self.agent.stop_requested:
            for app_id in list(self.waiting):
                self.end_waiting(
                    app_id, f"its pool was stopped ({self.agent.stop_reason}) while it waited", cancelled=True
                )
        for conns in self._clients.values():
            for c in conns:
                c.close()
        self._clients.clear()
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ hosts

    def _incarnation(self, index: int) -> str:
        if index == self.agent.index:
            return self.agent.incarnation
        return self.targets[index].identity.rsplit("/", 1)[-1]

    def set_targets(self, targets: list[dict]) -> None:
        fresh = {t.index: t for t in (Target(**d) for d in targets)}
        if set(fresh) - set(self.targets):  # hosts that joined (a grow): what waits may start there now
            self._wake.set()
        for i, t in fresh.items():
            old = self.targets.get(i)
            if old is not None and old != t:  # replaced: its old connections and load are not its own
                self.loads.pop(i, None)
                for c in self._clients.pop(i, []):
                    c.close()
        self.targets = fresh

    def _follow_move(self, index: int) -> None:
        """A host that stopped answering may have moved (a successor took it over at a renewal, a
        repair restarted it): its own file says where it is now, and the queue dials it there."""
        try:
            h = Registry.read_host(self.agent.state_dir, index)
        except MonarchError:
            return
        if h is None or h.exited or h.via or index not in self.targets:
            return
        moved = Target(index, h.host, h.port, h.identity(self.agent.pool).decode())
        if moved != self.targets[index]:
            self.set_targets([t.as_dict() for t in {**self.targets, index: moved}.values()])

    def _pool(self) -> ThreadPoolExecutor:
        if self._threads is None:
            self._threads = ThreadPoolExecutor(max_workers=300, thread_name_prefix="queue")
        return self._threads

    async def _call(self, index: int, op: str, **args: Any) -> Any:
        return (await self._calls(index, op, [args]))[0]

    async def _calls(self, index: int, op: str, calls: list[dict], timeout: float = CALL_TIMEOUT_S) -> list[Any]:
        """``op`` with each of ``calls`` on host ``index``: this agent's own handler for itself,
        else one of the connections kept to that host."""
        if index == self.agent.index:
            handler = self.agent.handlers[op]
            return [await handler(None, **args) for args in calls]
        target = self.targets[index]

        def blocking() -> list[Any]:
            kept = self._clients.setdefault(index, [])
            c = (
                kept.pop()
                if kept
                else Client(target.host, target.port, self.agent.creds, 10.0, target.identity.encode())
            )
            try:
                c.settimeout(timeout)
                out = [c.call(op, **args) for args in calls]
            except RemoteError:
                kept.append(c)  # (it answered: the connection is fine)
                raise
            except BaseException:
                c.close()
                raise
            kept.append(c)
            return out

        return await asyncio.get_running_loop().run_in_executor(self._pool(), blocking)

    async def quiet_call(self, index: int, op: str, **args: Any) -> Any:
        with contextlib.suppress(Exception):
            return await self._call(index, op, **args)

    async def fill_loads(self) -> None:
        """Asks each host whose load is not known yet."""
        missing = [i for i in self.targets if i not in self.loads]
        if not missing:
            return
        results = await asyncio.gather(
            *(self._calls(i, "capacity", [{}], 10.0) for i in missing), return_exceptions=True
        )
        for i, r in zip(missing, results):
            if not isinstance(r, BaseException):
                self.loads[i] = HostLoad.from_wire(r[0])

    def _watch_all(self) -> None:
        for i in self.targets:
            w = self._watches.setdefault(i, _Watch())
            if w.task is None or w.task.done():
                w.task = asyncio.get_running_loop().create_task(self._watch(i, w))

    async def _watch(self, index: int, w: _Watch) -> None:
        """Follows one host's load while apps wait; each change wakes the queue."""
        while self.waiting and not self.agent.stopping.is_set() and index in self.targets:
            known = self.loads.get(index)
            after = known.generation if known is not None else -1
            try:
                if index == self.agent.index:
                    live = await self.agent.ledger.changed_after(after, WATCH_S)
                    load = HostLoad.from_wire(live.to_wire())  # (a copy: a pass adds to what it holds)
                else:
                    got = await self._calls(index, "capacity", [{"after": after, "within": WATCH_S}], WATCH_S + 10)
                    load = HostLoad.from_wire(got[0])
                w.failures = 0
            except (WireError, OSError, RemoteError, KeyError):
                w.failures += 1
                self.loads.pop(index, None)  # (out of placement until it answers again)
                self._follow_move(index)
                await asyncio.sleep(min(10.0, 0.5 * w.failures))
                continue
            if known is None or load.generation != known.generation:
                self.loads[index] = load
                self._wake.set()

    # ------------------------------------------------------------ files

    def _path(self, app_id: str) -> Path:
        return self.dir / f"{app_id}.json"

    def _save(self, app_id: str) -> None:
        """The app's file: its submission while it waits, then how it left the queue."""
        try:
            if not self._dir_made:
                private_dir(self.dir, from_=self.agent.state_dir)
                self._dir_made = True
            w = self.waiting.get(app_id)
            record: dict[str, Any] = {"entry": self.entry(app_id).to_wire()}
            if w is not None:
                record["app"] = w.app.to_wire()
                record["targets"] = [t.as_dict() for t in self.targets.values()]
            write_private(self._path(app_id), json.dumps(record))
        except (OSError, PrivatePathError) as e:
            log.error("cannot keep the queue's file for %s: %s", app_id, e)

    def _read_back(self) -> None:
        """The queue a previous holder left: waiting apps wait again, in their order."""
        if not self.dir.is_dir():
            return
        found = []
        for p in self.dir.glob("*.json"):
            try:
                record = json.loads(p.read_text())
                entry = QueueEntry.from_wire(record["entry"])
                if entry.state == QueueState.QUEUED:
                    found.append((SubmittedApp.from_wire(record["app"]), record.get("targets", [])))
                else:
                    self.done[entry.app_id] = entry
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.error("unreadable queue file %s: %s", p, e)
        for sub, targets in sorted(found, key=lambda f: f[0].submitted):
            self.waiting[sub.app_id] = _Waiting(sub, "waits (read back from the previous holder's files)")
            if targets and not self.targets:
                self.set_targets(targets)
        if found:
            log.info("read back %d queued app(s) from %s", len(found), self.dir)
            self._wake.set()

    def _trim_done(self) -> None:
        while len(self.done) > KEEP_DONE:
            oldest = next(iter(self.done))
            self.done.pop(oldest)
            with contextlib.suppress(OSError):
                self._path(oldest).unlink()
