"""The host's GPUs as the agent watches them: NVML's health check of a device before work lands
on it, and the samples behind the ``gpus`` telemetry table (who holds each device, from the
ledger). Without NVML (no driver, or declared GPUs) there is nothing to check or sample."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from .admission import Ledger
from .nvml import Nvml, NvmlUnavailable

SAMPLE_S = 5.0  # how often the GPUs are sampled while a replica holds one
SAMPLES_KEPT = 4096  # samples kept per host (about 1.5 h of 8 GPUs)


class GpuWatch:
    def __init__(self, nvml: Nvml | None):
        self.nvml = nvml
        self.ledger: Ledger | None = None  # (set once the ledger, which calls ``problems``, exists)
        self.samples: deque[dict[str, Any]] = deque(maxlen=SAMPLES_KEPT)

    def problems(self, ids: list[str]) -> dict[str, str]:
        """Devices ``ids`` that fail NVML's check (it does not answer, uncorrectable ECC errors,
        pages waiting to be retired) -> why; the others pass."""
        if self.nvml is None:
            return {}
        uuids = {g.visible_id: g.uuid for g in self.ledger.load.capacity.gpus} if self.ledger else {}
        out = {}
        for gpu in ids:
            try:
                sample = self.nvml.sample(int(gpu), uuids.get(gpu, ""))
            except (NvmlUnavailable, ValueError) as e:
                out[gpu] = f"NVML does not answer for it: {e}"
                continue
            if sample.problem:
                out[gpu] = sample.problem
        return out

    def rows(self) -> list[dict[str, Any]]:
        """The ``gpus`` table's rows from this host: what was sampled, and a sample taken now."""
        self.sample()
        return list(self.samples)

    def sample(self) -> None:
        if self.nvml is None or self.ledger is None:
            return
        load = self.ledger.load
        held = {g: h.owner for h in load.holdings for g in h.gpu_ids}
        for g in load.capacity.gpus:
            try:
                s = self.nvml.sample(int(g.visible_id), g.uuid)
            except (NvmlUnavailable, ValueError):
                continue
            extra = {"gpu": g.visible_id, "name": g.name, "healthy": g.healthy, "held_by": held.get(g.visible_id)}
            self.samples.append({**vars(s), **extra})

    async def run(self) -> None:
        """Samples every SAMPLE_S while a replica holds a GPU (in a worker thread: a driver call can block)."""
        while self.nvml is not None and self.ledger is not None:
            await asyncio.sleep(SAMPLE_S)
            if any(h.gpu_ids for h in self.ledger.load.holdings):
                await asyncio.get_running_loop().run_in_executor(None, self.sample)
