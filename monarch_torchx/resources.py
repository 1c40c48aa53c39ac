"""What a replica asks of a host and what a host has: CPUs, memory, GPUs.

One vocabulary for every front end (TorchX's ``Role.resource``, submitit's ``cpus_per_task`` /
``gpus_per_node`` / ``mem_gb``, an actor mesh's ``per_host``), for the agent that admits work
on its host (``agent/admission.py``) and for the placement that picks hosts (``scheduling.py``).
These are the wire forms too: plain dataclasses, sent as their fields.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from .net import RemoteError


@dataclass(frozen=True)
class Resources:
    """An amount of each resource: what one replica asks, or what a host has free or in use.
    GPUs are whole devices, held by one replica at a time; CPUs may be fractional."""

    cpus: float = 0.0
    gpus: int = 0
    mem_mb: int = 0

    def __post_init__(self) -> None:
        for name in ("cpus", "gpus", "mem_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise ValueError(f"{name}={value!r} is not a number")

    @classmethod
    def from_torchx(cls, cpu: float | None, gpu: float | None, mem_mb: float | None) -> Resources:
        """From TorchX's ``Resource`` fields: a negative value (``NULL_RESOURCE``) asks nothing."""
        return cls(
            cpus=max(0.0, float(cpu or 0)),
            gpus=max(0, int(gpu or 0)),
            mem_mb=max(0, int(mem_mb or 0)),
        )

    @classmethod
    def from_wire(cls, d: dict[str, Any] | None) -> Resources:
        if not d:
            return cls()
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __add__(self, other: Resources) -> Resources:
        return Resources(self.cpus + other.cpus, self.gpus + other.gpus, self.mem_mb + other.mem_mb)

    def __sub__(self, other: Resources) -> Resources:
        return Resources(self.cpus - other.cpus, self.gpus - other.gpus, self.mem_mb - other.mem_mb)

    def within(self, capacity: Resources) -> Resources:
        """This ask on a host of ``capacity``: CPUs beyond the host's own are the whole host's
        (a replica asking 2 CPUs on a 1-CPU node holds that node's CPU); GPUs and memory are as
        asked (a host without enough never fits them)."""
        return Resources(min(self.cpus, capacity.cpus), self.gpus, self.mem_mb)

    def fits_in(self, free: Resources) -> bool:
        # (a small tolerance: fractional CPUs summed in floating point)
        return self.cpus <= free.cpus + 1e-9 and self.gpus <= free.gpus and self.mem_mb <= free.mem_mb

    def short_of(self, free: Resources) -> list[str]:
        """The kinds ``free`` lacks for this ask, by name ("gpus", "cpus", "mem_mb")."""
        out = []
        if self.gpus > free.gpus:
            out.append("gpus")
        if self.cpus > free.cpus + 1e-9:
            out.append("cpus")
        if self.mem_mb > free.mem_mb:
            out.append("mem_mb")
        return out

    @property
    def empty(self) -> bool:
        return self.cpus <= 0 and self.gpus <= 0 and self.mem_mb <= 0

    def describe(self) -> str:
        """E.g. "4 GPUs, 2 CPUs, 1024 MB" (what is asked; "nothing" when nothing is)."""
        parts = []
        if self.gpus:
            parts.append(f"{self.gpus} GPU{'s' if self.gpus != 1 else ''}")
        if self.cpus:
            cpus = f"{self.cpus:g}"
            parts.append(f"{cpus} CPU{'s' if cpus != '1' else ''}")
        if self.mem_mb:
            parts.append(f"{self.mem_mb} MB")
        return ", ".join(parts) or "nothing"


@dataclass(frozen=True)
class GpuDevice:
    """One GPU a host may hand out. ``visible_id`` is what goes in a replica's
    ``CUDA_VISIBLE_DEVICES`` (the id the allocation granted it by: an index or a UUID)."""

    visible_id: str
    uuid: str = ""
    name: str = ""
    healthy: bool = True
    problem: str = ""  # why it is out of placement (a failed health check)


@dataclass
class HostCapacity:
    """What one host has for replicas, and how each number was found (``sources``: "cgroup",
    "affinity", "SLURM_CPUS_ON_NODE", "declared", "NVML", ...). ``gpu_note``: why the host has
    no GPUs, when it has none (no NVML library, none granted)."""

    cpus: float
    mem_mb: int
    gpus: list[GpuDevice] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)
    gpu_note: str = ""

    @property
    def usable_gpus(self) -> list[GpuDevice]:
        return [g for g in self.gpus if g.healthy]

    @property
    def total(self) -> Resources:
        """What placement may count on: healthy GPUs only."""
        return Resources(self.cpus, len(self.usable_gpus), self.mem_mb)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> HostCapacity:
        d = dict(d)
        d["gpus"] = [GpuDevice(**g) for g in d.get("gpus", [])]
        return cls(**d)


@dataclass
class Holding:
    """What one live replica (or actor proc) holds on its host: its ask and its GPUs."""

    owner: str  # "APP/ROLE/REPLICA"
    resources: Resources
    gpu_ids: list[str] = field(default_factory=list)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Holding:
        return cls(d["owner"], Resources.from_wire(d["resources"]), list(d.get("gpu_ids", [])))


@dataclass
class HostLoad:
    """A host's capacity and what is held of it now: the agent's ``capacity`` answer, which
    `pool status` shows and placement reads. ``generation`` grows with every change, so a
    watcher asks "anything after N?". ``queued``: apps waiting in the pool's queue (host 0)."""

    index: int
    capacity: HostCapacity
    holdings: list[Holding] = field(default_factory=list)
    generation: int = 0
    queued: int = 0

    @property
    def used(self) -> Resources:
        total = Resources()
        for h in self.holdings:
            total = total + h.resources
        return total

    @property
    def free(self) -> Resources:
        used = self.used
        held = {g for h in self.holdings for g in h.gpu_ids}
        gpus = sum(1 for g in self.capacity.usable_gpus if g.visible_id not in held)
        return Resources(self.capacity.cpus - used.cpus, gpus, self.capacity.mem_mb - used.mem_mb)

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> HostLoad:
        return cls(
            index=int(d["index"]),
            capacity=HostCapacity.from_wire(d["capacity"]),
            holdings=[Holding.from_wire(h) for h in d.get("holdings", [])],
            generation=int(d.get("generation", 0)),
            queued=int(d.get("queued", 0)),
        )


class CapacityRefused(RemoteError):
    """A host would not admit a replica: what it asks is not free there now (another client
    took it first). The launch that met it waits in the pool's queue instead; its peers branch
    on this type, never on the text."""


class NeverFits(ValueError):
    """What is asked is more than any host of the pool has: waiting would never end."""
