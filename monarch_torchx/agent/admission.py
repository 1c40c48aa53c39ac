"""The host's own account of what its replicas hold: the last word on whether one may start.

Placement (``scheduling.py``) picks hosts from loads that may be a moment old, and two clients
may pick the same free GPU at once; the agent admits a replica only if what it asks is free
here now, hands it its own GPUs (``CUDA_VISIBLE_DEVICES``), and takes them back when it ends.
A refusal is ``CapacityRefused``: the launch then waits in the pool's queue.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from ..resources import CapacityRefused, Holding, HostCapacity, HostLoad, Resources

# what a replica that holds GPUs gets in its environment: CUDA's device order as NVML's, so the
# ids placement hands out name the same devices CUDA opens
GPU_ENV = "CUDA_VISIBLE_DEVICES"
GPU_ORDER_ENV = ("CUDA_DEVICE_ORDER", "PCI_BUS_ID")


class Ledger:
    """Capacity and holdings of one host (see the module's docstring). Single-threaded: the
    agent's event loop is its only caller."""

    def __init__(
        self, index: int, capacity: HostCapacity, check_gpus: Callable[[list[str]], dict[str, str]] | None = None
    ):
        """``check_gpus``: the health check of devices about to be handed out (ids -> problem, for
        those that fail it); a failing device leaves placement and another is taken."""
        self.load = HostLoad(index, capacity)
        self._changed = asyncio.Event()
        self._check_gpus = check_gpus

    def holding(self, owner: str) -> Holding | None:
        return next((h for h in self.load.holdings if h.owner == owner), None)

    def admit(self, owner: str, ask: Resources) -> Holding:
        """Takes ``ask`` for ``owner`` (an ended owner's holding must have been released), with
        the GPUs it gets; ``CapacityRefused`` naming what is short and who holds it."""
        if self.holding(owner) is not None:
            raise ValueError(f"{owner} already holds resources on host {self.load.index}")
        ask = ask.within(self.load.capacity.total)  # (more CPUs than the host has: all of them)
        free = self.load.free
        if not ask.fits_in(free):
            held = ", ".join(
                f"{h.owner} ({h.resources.describe()})" for h in self.load.holdings if not h.resources.empty
            )
            short = ", ".join(ask.short_of(free))
            raise CapacityRefused(
                f"host {self.load.index} cannot start {owner}: it asks {ask.describe()}, and {short} "
                f"are short (free: {free.describe() if not free.empty else 'nothing'} of "
                f"{self.load.capacity.total.describe()}" + (f"; held by {held})" if held else ")"),
                CapacityRefused.__name__,
            )
        taken = {g for h in self.load.holdings for g in h.gpu_ids}
        gpus = [g.visible_id for g in self.load.capacity.usable_gpus if g.visible_id not in taken][: ask.gpus]
        problems = self._check_gpus(gpus) if gpus and self._check_gpus is not None else {}
        if problems:  # before work lands on a device: one that fails its check is out, not the host
            for gpu, problem in problems.items():
                self.take_out_gpu(gpu, problem)
            return self.admit(owner, ask)
        holding = Holding(owner, ask, gpus)
        self.load.holdings.append(holding)
        self._bump()
        return holding

    def release(self, owner: str) -> None:
        before = len(self.load.holdings)
        self.load.holdings = [h for h in self.load.holdings if h.owner != owner]
        if len(self.load.holdings) != before:
            self._bump()

    def take_out_gpu(self, visible_id: str, problem: str) -> None:
        """A device that failed its health check leaves placement (not the whole host)."""
        gpus = self.load.capacity.gpus
        for i, g in enumerate(gpus):
            if g.visible_id == visible_id and (g.healthy or g.problem != problem):
                gpus[i] = type(g)(g.visible_id, g.uuid, g.name, healthy=False, problem=problem)
                self._bump()

    def set_queued(self, n: int) -> None:
        if n != self.load.queued:
            self.load.queued = n
            self._bump()

    def _bump(self) -> None:
        self.load.generation += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed_after(self, generation: int, within: float) -> HostLoad:
        """The load once its generation is past ``generation``, or after ``within`` seconds."""
        if self.load.generation <= generation and within > 0:
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=within)
            except asyncio.TimeoutError:
                pass
        return self.load


def gpu_env(holding: Holding) -> dict[str, str]:
    """What a replica holding ``holding`` gets in its environment (nothing if it holds no GPU)."""
    if not holding.gpu_ids:
        return {}
    return {GPU_ENV: ",".join(holding.gpu_ids), GPU_ORDER_ENV[0]: GPU_ORDER_ENV[1]}
