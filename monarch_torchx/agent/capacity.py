"""What this host has for replicas: CPUs, memory and GPUs, found once as the agent starts.

Each number comes from the narrowest source that applies, and says which (`pool status`):
- declared by the pool (``-cfg cpus_per_host=``, ``mem_per_host_mb=``, ``gpus_per_host=``):
  what detection cannot see, and what tests use to exercise GPU placement on CPU hosts;
- the allocation: SLURM's ``SLURM_CPUS_ON_NODE`` / ``SLURM_MEM_PER_NODE`` / ``SLURM_JOB_GPUS``,
  ``CUDA_VISIBLE_DEVICES`` (a pod's ``nvidia.com/gpu`` arrives as the devices NVML sees);
- the cgroup (``cpu.max``, ``memory.max``), then CPU affinity and ``MemTotal``.
GPUs come from NVML (``nvml.py``: no CUDA context in the agent), restricted to those granted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ..resources import GpuDevice, HostCapacity
from .nvml import Nvml, NvmlUnavailable


@dataclass(frozen=True)
class Declared:
    """What the pool declares of each host (None: detect it)."""

    cpus: float | None = None
    mem_mb: int | None = None
    gpus: int | None = None

    @classmethod
    def parse(cls, text: str) -> Declared:
        """From the agent's ``--declare cpus=4,gpus=8,mem_mb=1024`` (empty: nothing declared)."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key not in ("cpus", "mem_mb", "gpus"):
                raise ValueError(f"--declare {part!r}: use cpus=N, mem_mb=N or gpus=N")
            values[key] = float(value)
            if values[key] < 0:
                raise ValueError(f"--declare {part!r}: a capacity cannot be negative")
        return cls(
            cpus=values.get("cpus"),
            mem_mb=int(values["mem_mb"]) if "mem_mb" in values else None,
            gpus=int(values["gpus"]) if "gpus" in values else None,
        )

    def render(self) -> str:
        values = (("cpus", self.cpus), ("mem_mb", self.mem_mb), ("gpus", self.gpus))
        return ",".join(f"{k}={v:g}" for k, v in values if v is not None)


def _cgroup_dir(root: Path = Path("/sys/fs/cgroup")) -> Path | None:
    """This process's cgroup v2 directory, if there is one."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                d = root / line[3:].lstrip("/")
                return d if d.is_dir() else root
    except OSError:
        return None
    return None


def _cgroup_limit(d: Path | None, name: str) -> str | None:
    """The first limit file ``name`` set (not "max") from ``d`` up to the cgroup root: a limit
    on a parent cgroup binds its children too."""
    while d is not None:
        try:
            value = (d / name).read_text().strip()
            if not value.startswith("max"):
                return value
        except OSError:
            pass
        if d == d.parent or d == Path("/sys/fs/cgroup"):
            return None
        d = d.parent
    return None


def _cgroup_cpus(d: Path | None) -> float | None:
    """The cgroup's CPU quota (cpu.max "QUOTA PERIOD"), in CPUs; None when unlimited."""
    try:
        value = _cgroup_limit(d, "cpu.max")
        if value is None:
            return None
        quota, period = value.split()[:2]
        return int(quota) / int(period)
    except ValueError:
        return None


def _cgroup_mem_mb(d: Path | None) -> int | None:
    try:
        value = _cgroup_limit(d, "memory.max")
        return None if value is None else int(value) >> 20
    except ValueError:
        return None


def _mem_total_mb() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) >> 10
    except (OSError, ValueError):
        pass
    return 0


def detect_cpus(env: Mapping[str, str], declared: Declared) -> tuple[float, str]:
    if declared.cpus is not None:
        return declared.cpus, "declared"
    slurm = env.get("SLURM_CPUS_ON_NODE", "").strip()
    if slurm.isdigit():
        return float(slurm), "SLURM_CPUS_ON_NODE"
    affinity = float(len(os.sched_getaffinity(0)))
    quota = _cgroup_cpus(_cgroup_dir())
    if quota is not None and quota < affinity:
        return quota, "cgroup cpu.max"
    return affinity, "CPU affinity"


def detect_mem_mb(env: Mapping[str, str], declared: Declared) -> tuple[int, str]:
    if declared.mem_mb is not None:
        return declared.mem_mb, "declared"
    slurm = env.get("SLURM_MEM_PER_NODE", "").strip()
    if slurm.isdigit() and int(slurm) > 0:
        return int(slurm), "SLURM_MEM_PER_NODE"
    total = _mem_total_mb()
    limit = _cgroup_mem_mb(_cgroup_dir())
    if limit is not None and limit < total:
        return limit, "cgroup memory.max"
    return total, "MemTotal"


def granted_gpu_ids(env: Mapping[str, str]) -> tuple[list[str] | None, str]:
    """The devices this host's allocation grants (indices or UUIDs), and where that was read;
    None: no restriction (every device NVML sees)."""
    for var in ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        value = env.get(var)
        if value is not None:
            return [v.strip() for v in value.split(",") if v.strip()], var
    return None, ""


def detect_gpus(
    env: Mapping[str, str], declared: Declared, nvml: Nvml | None, nvml_error: str
) -> tuple[list[GpuDevice], str, str]:
    """(devices, source, note): the note says why there are none, when there are none."""
    if declared.gpus is not None:
        return [GpuDevice(str(i), name="declared") for i in range(declared.gpus)], "declared", ""
    if nvml is None:
        return [], "", f"no GPUs: {nvml_error}"
    try:
        found = nvml.devices()
    except NvmlUnavailable as e:
        return [], "", f"no GPUs: {e}"
    granted, var = granted_gpu_ids(env)
    devices = []
    for g in found:
        if (
            granted is None
            or str(g.index) in granted
            or g.uuid in granted
            or any(x.startswith("GPU-") and g.uuid.startswith(x) for x in granted)
        ):
            devices.append(GpuDevice(str(g.index), uuid=g.uuid, name=g.name))
    note = "" if devices else f"no GPUs: NVML sees {len(found)}, {var or 'the allocation'} grants none of them"
    return devices, "NVML" + (f" within {var}" if var else ""), note


def detect(env: Mapping[str, str], declared: Declared, nvml: Nvml | None, nvml_error: str = "") -> HostCapacity:
    cpus, cpu_src = detect_cpus(env, declared)
    mem, mem_src = detect_mem_mb(env, declared)
    gpus, gpu_src, note = detect_gpus(env, declared, nvml, nvml_error)
    sources = {"cpus": cpu_src, "mem_mb": mem_src}
    if gpu_src:
        sources["gpus"] = gpu_src
    return HostCapacity(cpus=cpus, mem_mb=mem, gpus=gpus, sources=sources, gpu_note=note)
