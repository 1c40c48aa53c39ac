"""Monarch's ``spawn_procs(proc_bind=[...])``: pin each proc to CPUs and NUMA memory.

Monarch wraps the proc's command in ``numactl`` or ``taskset``. Our procs are forks of a warm
fork server, not new commands, so the same settings are applied by the proc to itself before it
runs anything (a fork has one thread, so every thread it starts later inherits them):
``cpus`` and ``physcpubind`` are a CPU list (``taskset -c``), ``cpunodebind`` NUMA nodes whose
CPUs it may run on, ``membind`` NUMA nodes its new memory comes from (``set_mempolicy``). Pages
it shares with the fork server (its pre-imported modules) stay where they are.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from typing import Mapping, Sequence

KEYS = ("cpunodebind", "membind", "physcpubind", "cpus")
ENV = "MONARCH_TORCHX_PROC_PLACEMENT"
NODES = "/sys/devices/system/node"
MPOL_BIND = 2
SYS_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}


def check(proc_bind: Sequence[Mapping[str, str]] | None, procs_per_host: int) -> list[dict[str, str]] | None:
    """Monarch's rules, checked in the controller before anything starts."""
    if proc_bind is None:
        return None
    if len(proc_bind) != procs_per_host:
        raise ValueError(f"proc_bind length ({len(proc_bind)}) must equal procs_per_host ({procs_per_host})")
    out = []
    for i, bind in enumerate(proc_bind):
        if not isinstance(bind, Mapping):
            raise ValueError(f"proc_bind[{i}] must be a dict of {', '.join(KEYS)}, not {bind!r}")
        unknown = sorted(set(bind) - set(KEYS))
        if unknown:
            raise ValueError(f"proc_bind[{i}] has unknown keys {unknown}: use {', '.join(KEYS)}")
        for key, value in bind.items():
            if not isinstance(value, str) or not value:
                raise ValueError(f"proc_bind[{i}][{key!r}] must be a CPU or node list such as '0-3,8', not {value!r}")
            parse_list(value)
        out.append(dict(bind))
    return out


def parse_list(text: str) -> set[int]:
    """``0-3,8,10-11`` as numactl and taskset read it."""
    out: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"bad CPU or node list {text!r}: use numbers and ranges such as '0-3,8'") from None
        if first < 0 or last < first:
            raise ValueError(f"bad CPU or node list {text!r}: range {part!r} is empty or negative")
        out.update(range(first, last + 1))
    return out


def node_cpus(nodes: set[int], root: str = NODES) -> set[int]:
    """The CPUs of ``nodes`` (none for a memory-only node: HBM, CXL, a GPU's memory)."""
    cpus: set[int] = set()
    for node in sorted(nodes):
        where = os.path.join(root, f"node{node}")
        if not os.path.isdir(where):
            raise ValueError(f"NUMA node {node} does not exist on this host")
        try:
            with open(os.path.join(where, "cpulist")) as f:
                text = f.read().strip()
        except FileNotFoundError:
            text = ""
        if text:
            cpus |= parse_list(text)
    return cpus


def apply(bind: Mapping[str, str]) -> None:
    """Binds this process as numactl/taskset would have bound the command."""
    cpus: set[int] | None = None
    for key in ("physcpubind", "cpus"):
        if key in bind:
            cpus = parse_list(bind[key]) if cpus is None else cpus & parse_list(bind[key])
    if "cpunodebind" in bind:
        on_nodes = node_cpus(parse_list(bind["cpunodebind"]))
        cpus = on_nodes if cpus is None else cpus & on_nodes
    if cpus is not None:
        if not cpus:
            raise ValueError(f"proc_bind {dict(bind)} leaves no CPU to run on")
        os.sched_setaffinity(0, cpus)
    if "membind" in bind:
        _bind_memory(parse_list(bind["membind"]))


def _bind_memory(nodes: set[int]) -> None:
    number = SYS_SET_MEMPOLICY.get(platform.machine())
    if number is None:
        raise ValueError(f"proc_bind membind is not supported on {platform.machine()}")
    node_cpus(nodes)  # each node must exist
    width = max(nodes) + 1
    words = (width + 63) // 64
    mask = (ctypes.c_ulong * words)()
    for n in nodes:
        mask[n // 64] |= 1 << (n % 64)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, MPOL_BIND, mask, ctypes.c_ulong(width + 1)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"set_mempolicy(MPOL_BIND, nodes {sorted(nodes)}): {os.strerror(err or errno.EINVAL)}")
