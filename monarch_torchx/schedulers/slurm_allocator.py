"""Agent module of a SLURM pool made with ``-cfg max_nodes=N`` or ``renew=True``: host 0 grows the
pool by itself, and renews its allocations before their walltime ends.

When the app at the head of the pool's queue has waited ``backlog`` and would start with more
hosts, host 0's agent submits one further allocation sized for it (``scheduling.hosts_to_add``:
the fewest nodes like host 0's that let it start), up to ``max_nodes`` hosts in all. It does so
through the code `pool resize` runs (``pool.grow_pool``: the pool's lock, ``sbatch``, the new
agents awaited and warmed, the queue handed them), so no client needs to be around, as with
HyperQueue's automatic allocation. One allocation at a time. A grow that fails (SLURM refuses
it, or it does not start within the pool's ``start_timeout``) is given back; after
``PAUSE_AFTER`` failures in a row the allocator pauses, with the reason in `pool status`, until
the pool's size is changed by hand (`pool resize`). Shrinking is the idle timeout's: a further
allocation leaves once its hosts have been idle for it (``Agent.pool_idle_seconds``).

Renewal (``renew=True``): when an allocation has less than ``renew_before`` (default
``renew_lead_s``) of its walltime left,
host 0 submits its successor (as many nodes, the pool's walltime) whose agents start on standby
for the same hosts; once they are up and warm it replays what was synced to the pool to them
and arms them. Each host's agent then hands its index over as soon as it is idle, or its
walltime ends it (``agent/handover.py``): the pool stays warm across walltimes, its hosts keep
their numbers, and the old allocation ends as its agents leave. A successor that does not start
within ``start_timeout`` is cancelled and counted as a failure, as a failed grow is.

It needs the pool's record, so the batch script exports the registry home
(``MONARCH_TORCHX_HOME``) to host 0's agent; that home must be on a file system the nodes share,
as the pool's state dir already is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from ..agent.handover import ARM_OP
from ..app_queue import QueueBacklog
from ..errors import MonarchError
from ..pool import Pool, grow_pool, warming_hosts
from ..registry import Registry
from ..scheduling import hosts_to_add
from ..seam import AgentHost
from ..syncfs.replay import replay_syncs
from .slurm import ALIVE, Allocation, AllocatorPhase, AllocatorState, SlurmProvisioner, allocations, jobs_states

log = logging.getLogger("monarch_torchx.agent.slurm_allocator")

CHECK_EVERY_S = 0.25  # (a look at its own queue, in memory: cheap)
PAUSE_AFTER = 3  # grows that failed in a row
RETRY_AFTER_S = 5.0  # after a failed grow or renewal, times the failures so far
RENEW_CHECK_S = 5.0  # how often the walltime left is asked (one squeue)


def renew_lead_s(walltime_s: float) -> float:
    """How long before an allocation's walltime ends its successor is submitted: a tenth of the
    walltime (time to wait in SLURM's queue, start and warm up), at least a minute, at most half."""
    return min(walltime_s / 2, max(60.0, walltime_s / 10))


class Allocator:
    """Host 0's watch of its pool's queue (``AgentModule``: one background task)."""

    def __init__(self, agent: AgentHost, registry: Registry, max_nodes: int, backlog_s: float, renew: bool = False):
        self.agent, self.registry = agent, registry
        self.max_nodes, self.backlog_s, self.renew = max_nodes, backlog_s, renew
        self.next_renew_check = 0.0  # monotonic
        self.state = AllocatorState.read(agent.state_dir) or AllocatorState()  # (a restarted host 0 keeps a pause)
        self.not_before = 0.0  # monotonic: no grow before this (after a failure)

    def operations(self) -> dict[str, Any]:
        return {}

    def background_tasks(self) -> list[Any]:
        return [self.run()]

    def warm_imports(self) -> list[str]:
        return []

    def stop(self) -> None:
        pass

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.state = AllocatorState.read(self.agent.state_dir) or self.state  # (as its predecessor left it)
        if self.agent.successor and self.state.phase != AllocatorPhase.PAUSED:  # (its predecessor's word is stale)
            self._set(AllocatorPhase.WATCHING, "host 0's successor took it over; renewing as its walltime ends")
        while not self.agent.stopping.is_set():
            await asyncio.sleep(CHECK_EVERY_S)
            if time.monotonic() < self.not_before:
                continue
            if self.renew and time.monotonic() >= self.next_renew_check:
                self.next_renew_check = time.monotonic() + RENEW_CHECK_S
                try:
                    await loop.run_in_executor(None, self.renew_due)
                except Exception as e:  # noqa: BLE001 (a bad check must not end the allocator: said, tried again)
                    self._failed("a renewal check", f"{type(e).__name__}: {e}")
            if not self.max_nodes:
                continue
            backlog = self.agent.queue_backlog()
            assert isinstance(backlog, QueueBacklog)
            extra = self.wanted(backlog)
            if extra is None:
                continue
            head = backlog.waiting[0]
            self._set(
                AllocatorPhase.GROWING,
                f"submitting {extra} node(s) for {head.app_id}, which waited {head.waited_s:.0f}s",
            )
            await loop.run_in_executor(None, self.grow, extra, head.app_id)

    def wanted(self, backlog: QueueBacklog) -> int | None:
        """How many hosts to add for the head of the queue now, or None."""
        if not backlog.waiting or backlog.waiting[0].waited_s < self.backlog_s:
            return None
        if self.state.phase == AllocatorPhase.PAUSED and not self._resumed():
            return None
        if len(backlog.loads) < backlog.hosts:  # a host's load is not known: the queue learns it first
            return None
        head = backlog.waiting[0]
        room = self.max_nodes - backlog.hosts
        if room <= 0:
            self._set(AllocatorPhase.WATCHING, f"{head.app_id} waits; the pool is at max_nodes={self.max_nodes}")
            return None
        extra = hosts_to_add(head.ask, backlog.loads, room)
        if extra is None and head.ask.hosts is not None:
            self._set(
                AllocatorPhase.WATCHING,
                f"{head.app_id} waits for the hosts its workspace was synced to: the pool does not grow for it",
            )
        elif extra is None:
            self._set(
                AllocatorPhase.WATCHING,
                f"{head.app_id} waits, and would not start on max_nodes={self.max_nodes} hosts either",
            )
        return extra

    def grow(self, extra: int, app_id: str) -> None:
        """(On a thread: it waits for the new hosts.)"""
        try:
            size = grow_pool(
                self.agent.pool, extra, self.registry, progress=lambda m: log.info("%s", m), on_join=replay_syncs
            )
        except Exception as e:  # noqa: BLE001 (whatever stopped it is the reason shown; the next try may work)
            self._failed(f"a grow for {app_id}", str(e) if isinstance(e, MonarchError) else f"{type(e).__name__}: {e}")
            return
        self.state.failures = 0
        self.state.grown += 1
        self._set(AllocatorPhase.WATCHING, f"grew to {size} host(s) for {app_id}")

    # ------------------------------------------------------------ renewal

    def renew_due(self) -> None:
        """(On a thread.) Records the successors that took their hosts over; renews each
        allocation with less than ``renew_lead_s`` left that has no successor yet."""
        prov = SlurmProvisioner()
        with self.registry.lock(self.agent.pool, wait=False) as had:
            rec = self.registry.get(self.agent.pool)
            if rec is None:
                return
            settled = prov.settle_renewals(rec) if had else []
            if settled:
                self.registry.save(rec)
                log.info("%s", "; ".join(settled))
                self._set(AllocatorPhase.WATCHING, "; ".join(settled))
        if self.state.phase == AllocatorPhase.PAUSED and not self._resumed():
            return
        lead = rec.options.get("renew_before_s") or renew_lead_s(float(rec.options.get("walltime_s") or 0))
        for alloc, left in prov.time_left(rec):
            if not alloc.successor and left is not None and left <= lead:
                self.renew_one(prov, alloc, left)
                return  # (one at a time: the next check renews the next)

    def renew_one(self, prov: SlurmProvisioner, alloc: Allocation, left: int) -> None:
        name = self.agent.pool
        self._set(
            AllocatorPhase.RENEWING,
            f"allocation {alloc.job_id} ({alloc.label()}) has {left}s left: submitting its successor",
        )
        with self.registry.lock(name):
            rec = self.registry.require(name)
            now = next((a for a in prov.time_left(rec) if a[0].job_id == alloc.job_id), None)
            if now is None or now[0].successor:  # (released or renewed meanwhile)
                return
            try:
                renewed = prov.renew(rec, now[0])
            except MonarchError as e:
                self._failed(f"renewing allocation {alloc.job_id}", str(e))
                return
            self.registry.save(rec)
        seen: dict[int, str] = {}  # the successor's agents' incarnations, as they come up
        try:
            self._ready_successor(rec, renewed, seen)
        except Exception as e:  # noqa: BLE001 (whatever stopped it is the reason shown; the next try may work)
            why = str(e) if isinstance(e, MonarchError) else f"{type(e).__name__}: {e}"
            now_rec = self.registry.get(name)  # (a shrink or stop may have released it meanwhile)
            held = allocations(now_rec) if now_rec is not None else []
            if not any(a.first == renewed.first and renewed.successor in a.jobs for a in held):
                self._set(AllocatorPhase.WATCHING, f"allocation {renewed.job_id} was released while it was renewed")
                return
            if self._serving(rec, renewed, seen):  # never cancel what took hosts over: it is the pool now
                self._set(AllocatorPhase.WATCHING, f"allocation {renewed.successor} took hosts over unreadied ({why})")
                return
            with self.registry.lock(name):
                rec = self.registry.require(name)
                prov.drop_successor(rec, renewed)
                self.registry.save(rec)
            self._failed(f"renewing allocation {alloc.job_id}", why)
            return
        self.state.failures = 0
        self.state.renewed += 1
        self._set(
            AllocatorPhase.WATCHING,
            f"allocation {renewed.successor} waits to take {renewed.label()} over from allocation "
            f"{renewed.job_id} (each host as it goes idle, or at its walltime)",
        )

    @staticmethod
    def _serving(rec: Any, alloc: Allocation, seen: dict[int, str]) -> bool:
        """Whether the successor serves any host already, or must: its predecessor has ended."""
        if jobs_states([alloc.job_id])[alloc.job_id][0] not in ALIVE:
            return True
        for i, inc in seen.items():
            with contextlib.suppress(MonarchError):
                h = Registry.read_host(rec.state_dir, i)
                if h is not None and h.incarnation == inc:
                    return True
        return False

    def _ready_successor(self, rec: Any, alloc: Allocation, seen: dict[int, str]) -> None:
        """Waits for the successor's agents on standby, warm; replays the pool's syncs to them and
        arms them (host 0's last: it hands over, and this module with it, once armed and idle).
        Done early when the predecessor ended first: its agents then take the hosts over as they
        come up (there is nothing to hand over)."""
        indices = list(alloc.indices)
        timeout = float(rec.options.get("start_timeout") or 600)
        deadline = time.time() + timeout
        while True:
            up = Registry.standby_hosts(rec.state_dir, indices)
            seen.update({i: h.incarnation for i, h in up.items()})
            if len(up) == len(indices):
                break
            states = jobs_states(alloc.jobs)
            if states[alloc.job_id][0] not in ALIVE:
                log.info("allocation %s ended before its successor was up: it takes the hosts over", alloc.job_id)
                return
            state, reason, _ = states[alloc.successor]
            if state not in ALIVE:
                raise MonarchError(f"successor allocation {alloc.successor} is {state or 'gone'}")
            if time.time() > deadline:
                raise MonarchError(
                    f"successor allocation {alloc.successor} still {state} ({reason}) after {timeout:.0f} s: "
                    f"cancelled it"
                )
            time.sleep(1.0)
        view = Pool(rec, self.registry).successors(indices)
        while time.time() < deadline:  # warm: its first runs start as warm as its predecessor's
            infos = [view.call(i, "info", timeout=10.0) for i in indices]
            if not warming_hosts(infos):
                break
            time.sleep(0.5)
        replay_syncs(view, indices, lambda m: log.info("%s", m))
        for i in reversed(indices):
            view.call(i, ARM_OP, timeout=10.0)

    def _failed(self, what: str, why: str) -> None:
        self.state.failures += 1
        self.not_before = time.monotonic() + RETRY_AFTER_S * self.state.failures
        if self.state.failures >= PAUSE_AFTER:
            self.state.paused_at = self._size()
            self._set(
                AllocatorPhase.PAUSED,
                f"paused after {self.state.failures} failures; the last, {what}: {why}. "
                f"`monarch-torchx pool resize {self.agent.pool} --hosts N` resumes it",
            )
        else:
            self._set(AllocatorPhase.WATCHING, f"{what} failed ({why}); trying again")
        log.warning("%s failed: %s", what, why)

    def _resumed(self) -> bool:
        """A paused allocator resumes once the pool's size was changed by hand."""
        if self._size() == self.state.paused_at:
            return False
        self.state.failures = 0
        self._set(AllocatorPhase.WATCHING, "resumed: the pool was resized")
        return True

    def _size(self) -> int:
        try:
            rec = self.registry.get(self.agent.pool)
        except MonarchError:
            return self.state.paused_at
        return rec.num_hosts if rec is not None else 0

    def _set(self, phase: AllocatorPhase, reason: str) -> None:
        if (phase, reason) == (self.state.phase, self.state.reason):
            return
        self.state.phase, self.state.reason = phase, reason
        try:
            self.state.save(self.agent.state_dir)
        except OSError as e:
            log.warning("cannot write the allocator's state: %s", e)


def setup(agent: AgentHost) -> None:
    """Host 0 of a pool made with ``max_nodes`` or ``renew`` (the batch script names this module for it)."""
    if agent.index != 0:
        return
    try:
        registry = Registry()
        rec = registry.get(agent.pool)
        why = (
            ""
            if rec is not None and Path(rec.state_dir).resolve() == agent.state_dir.resolve()
            else f"the registry home {registry.root} does not hold this pool"
        )
    except MonarchError as e:
        rec, why = None, str(e)
    if why or rec is None:
        why = (
            f"host 0 cannot read the pool's record ({why}): the registry home must be on a file system "
            f"the nodes share; the pool does not grow by itself"
        )
        log.error("%s", why)
        with contextlib.suppress(OSError):  # (so `pool status` says why, not "watching")
            AllocatorState(AllocatorPhase.OFF, why).save(agent.state_dir)
        return
    if not rec.options.get("max_nodes") and not rec.options.get("renew"):
        return
    agent.install(
        Allocator(
            agent,
            registry,
            int(rec.options.get("max_nodes") or 0),
            30.0 if rec.options.get("backlog_s") is None else float(rec.options["backlog_s"]),
            renew=bool(rec.options.get("renew")),
        )
    )
