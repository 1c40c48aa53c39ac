"""Agent module of a SLURM pool made with ``-cfg max_nodes=N``: host 0 grows the pool by itself.

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

from ..app_queue import QueueBacklog
from ..errors import MonarchError
from ..pool import grow_pool
from ..registry import Registry
from ..scheduling import hosts_to_add
from ..seam import AgentHost
from ..syncfs.replay import replay_syncs
from .slurm import AllocatorPhase, AllocatorState

log = logging.getLogger("monarch_torchx.agent.slurm_allocator")

CHECK_EVERY_S = 0.25  # (a look at its own queue, in memory: cheap)
PAUSE_AFTER = 3  # grows that failed in a row
RETRY_AFTER_S = 10.0  # after a failed grow, times the failures so far


class Allocator:
    """Host 0's watch of its pool's queue (``AgentModule``: one background task)."""

    def __init__(self, agent: AgentHost, registry: Registry, max_nodes: int, backlog_s: float):
        self.agent, self.registry = agent, registry
        self.max_nodes, self.backlog_s = max_nodes, backlog_s
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
        while not self.agent.stopping.is_set():
            await asyncio.sleep(CHECK_EVERY_S)
            if time.monotonic() < self.not_before:
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
            self.state.failures += 1
            why = str(e) if isinstance(e, MonarchError) else f"{type(e).__name__}: {e}"
            self.not_before = time.monotonic() + RETRY_AFTER_S * self.state.failures
            if self.state.failures >= PAUSE_AFTER:
                self.state.paused_at = self._size()
                self._set(
                    AllocatorPhase.PAUSED,
                    f"paused after {self.state.failures} failed grows; the last: {why}. "
                    f"`monarch-torchx pool resize {self.agent.pool} --hosts N` resumes it",
                )
            else:
                self._set(AllocatorPhase.WATCHING, f"a grow for {app_id} failed ({why}); trying again")
            log.warning("growing the pool failed: %s", why)
            return
        self.state.failures = 0
        self.state.grown += 1
        self._set(AllocatorPhase.WATCHING, f"grew to {size} host(s) for {app_id}")

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
    """Host 0 of a pool made with ``max_nodes`` (the batch script names this module for it)."""
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
    if not rec.options.get("max_nodes"):
        return
    agent.install(Allocator(agent, registry, int(rec.options["max_nodes"]), float(rec.options.get("backlog_s", 30.0))))
