"""A SLURM pool's renewal, on the agents' side: a successor takes a host's index over.

A pool made with ``renew=True`` submits, before an allocation's walltime ends, a successor
allocation (``schedulers/slurm_allocator.py``) whose agents start with ``--standby``: each
listens and warms up like any agent, but publishes its address in ``hosts/N.next.json``, not in
host N's file, and starts no background work (host 0's queue, modules' tasks) yet. Once what was
synced to the pool was replayed to it, the allocator arms it (the ``handover.arm`` operation).

The handover is the serving agent's to make, because only it knows for sure that it is idle:
at a heartbeat where nothing runs on it, nothing was asked of it lately and an armed successor
waits, it writes the successor's address as host N's file and stops; clients then reach the
successor, whose warm processes serve the next run. A busy agent keeps its host until it is idle
or its walltime ends it; then (its file says it exited, or its heartbeats stopped) the successor
takes the index over by itself. The promoted successor starts its background work (host 0: the
queue, read back from the state dir) and counts its idle time from then. A predecessor that left
by the idle timeout took the pool (or its allocation) with it: its successor leaves too.
"""

from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass
from pathlib import Path

from ..errors import MonarchError
from ..registry import HostAddr, Registry

ARM_OP = "handover.arm"
PROBE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class TakeOver:
    """What a successor on standby is to do now that host N's agent is gone or handed over."""

    why: str
    leave: bool = False  # the predecessor left idle: so does the successor (the pool idled out)
    # when its host last had work, as its predecessor last said: a renewal does not restart the
    # idle timeout (0: not known)
    last_work: float = 0.0


def handing_over_to(state_dir: Path, index: int, incarnation: str) -> HostAddr | None:
    """The armed successor that host ``index``'s serving agent (``incarnation``) may hand over
    to now, or None. Read at each of its heartbeats while it is idle: one stat when none waits."""
    path = Registry.host_path(state_dir, index, standby=True)
    if not path.exists():
        return None
    try:
        succ = Registry.read_host(state_dir, index, standby=True)
    except MonarchError:
        return None
    if succ is None or not succ.armed or succ.exited or succ.incarnation == incarnation:
        return None
    return succ


def hand_over(state_dir: Path, succ: HostAddr, last_work: float) -> str:
    """Makes ``succ`` host N's agent (its address as host N's file, with when the host last had
    work); returns the reason the old agent stops with."""
    Registry.publish_host(state_dir, dataclasses.replace(succ, armed=False, last_work=last_work), moved=True)
    return f"handed host {succ.index} over to its successor (pid {succ.pid} on {succ.hostname}): its walltime ends soon"


def take_over_due(state_dir: Path, index: int, incarnation: str, stale_after: float) -> TakeOver | None:
    """Whether the successor on standby for host ``index`` takes it over now, and why."""
    try:
        current = Registry.read_host(state_dir, index)
    except MonarchError:
        return None  # (being rewritten, or damaged: its agent rewrites it)
    if current is None:
        return TakeOver(f"host {index} has no agent (its allocation was replaced by this one)")
    if current.incarnation == incarnation:
        return TakeOver(f"host {index}'s agent handed it over", last_work=current.last_work)
    if current.exited and current.exited_idle:
        return TakeOver(f"host {index}'s agent left idle ({current.exit_reason}): leaving with it", leave=True)
    if current.exited:
        return TakeOver(f"host {index}'s agent exited ({current.exit_reason})", last_work=current.last_work)
    age = Registry.host_file_age(state_dir, index)
    if age is not None and age > stale_after and not _listening(current):
        return TakeOver(
            f"host {index}'s agent has not written its heartbeat for {age:.0f} s", last_work=current.last_work
        )
    return None


def _listening(addr: HostAddr) -> bool:
    """Whether something still accepts connections at ``addr``: an old heartbeat alone (a slow or
    full shared file system) is no proof that an agent is gone, and taking its host over while
    it lives would end what runs there."""
    if addr.via or not addr.port:
        return False
    try:
        with socket.create_connection((addr.host, addr.port), timeout=PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False
