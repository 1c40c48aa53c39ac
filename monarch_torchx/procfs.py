"""What ``/proc`` says about this node's processes and mounts: the one place that reads it.

Finding our own processes by command line (agents of a pool, FUSE servers of a store) is how a
client or an agent ends what a killed process left, so every such search reads the same way:
a process that exits mid-read simply is not there, and a zombie is not alive.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator


def cmdline(pid: int) -> list[bytes] | None:
    """A process's argv (None when it is gone or not readable)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None


def owned(pid: int) -> bool:
    """Whether process ``pid`` runs as this user (its real and effective uid are ours). On a shared
    node anyone can start a process whose command line looks like one of ours: only a process
    that is ours may be judged by its command line, and signalled."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    real, effective = line.split()[1:3]
                    return int(real) == int(effective) == os.getuid()
    except (OSError, ValueError):
        pass
    return False


def processes() -> Iterator[tuple[int, list[bytes]]]:
    """(pid, argv) of every process of this user, except this one (see ``owned``)."""
    me = os.getpid()
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != me:
            argv = cmdline(int(p.name))
            if argv is not None and owned(int(p.name)):
                yield int(p.name), argv


def pids_with(*needles: bytes) -> list[int]:
    """The processes whose argv holds every one of ``needles`` (each as a substring of an argument
    or of the whole command line)."""
    out = []
    for pid, argv in processes():
        joined = b"\0".join(argv)
        if all(n in joined for n in needles):
            out.append(pid)
    return out


def alive(pid: int) -> bool:
    """Running: it exists and is not a zombie that no one reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def mounts_under(root: Path) -> list[str]:
    """Mount points below ``root`` in this process's mount namespace, deepest first. Read from
    the mount table: a FUSE mount whose server died still shows there (stat on it fails)."""
    prefix = str(root).rstrip("/") + "/"
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return []
    points = [line.split()[1].replace("\\040", " ") for line in lines if len(line.split()) > 1]
    return sorted((m for m in points if m.startswith(prefix)), key=len, reverse=True)
