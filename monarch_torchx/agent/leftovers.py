"""What a dead agent left on its node, found and ended when its pool stops.

An agent that stops cleans up after itself; one that was SIGKILLed (or OOM-killed) cannot. Its
FUSE servers end on their own when they see it gone, but its sync store, a mount whose server
was killed with it, and its temp directories stay on the node's disk. ``pool stop`` runs this on
each host whose agent is gone: on the client's machine for ``monarch_local``, as a job step on
the host's node for ``monarch_slurm`` (Kubernetes pods take their emptyDirs with them).

    python -m monarch_torchx.agent.leftovers --pool NAME --pool-id ID --index N [--index M ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path


def end_host(pool: str, pool_id: str, index: int, keep: tuple[str, ...] = ()) -> list[str]:
    """Ends and removes what host ``index`` of the pool left here; returns what it found. ``keep``:
    incarnations of live agents for that host (a successor on standby) whose stores stay."""
    from ..private import sync_store_base

    found: list[str] = []
    base = sync_store_base()[0] / f"{pool}-{pool_id}-host{index}"
    # (a successor's store is named after its incarnation too: syncfs.host.store_root)
    for store in [base, *base.parent.glob(f"{base.name}-*")]:
        if store.name.removeprefix(f"{base.name}-") not in keep:
            found += _end_store(store)
    return found + remove_dead_temp_dirs(pool, index)


def _end_store(store: Path) -> list[str]:
    """Ends the FUSE servers serving from one host's sync store, unmounts, and removes it."""
    from .. import procfs

    found: list[str] = []
    if store.is_dir() and store.stat().st_uid == os.getuid():
        servers = procfs.pids_with(os.fsencode(str(store)))
        for pid in servers:
            try:
                os.kill(pid, signal.SIGTERM)
                found.append(f"FUSE server {pid}")
            except ProcessLookupError:
                pass
        deadline = time.time() + 5
        while procfs.pids_with(os.fsencode(str(store))) and time.time() < deadline:
            time.sleep(0.05)
        for m in procfs.mounts_under(store):
            subprocess.run(["fusermount3", "-u", "-z", m], capture_output=True)
            if os.path.ismount(m):
                subprocess.run(["umount", "-l", m], capture_output=True)
            found.append(f"mount {m}")
        for d in store.glob("targets/*/gen-*"):  # generations are read-only trees
            for sub, dirs, _files in os.walk(d):  # noqa: B007
                os.chmod(sub, 0o700)
        shutil.rmtree(store, ignore_errors=True)
        found.append(f"sync store {store}")
    return found


def remove_dead_temp_dirs(pool: str, index: int) -> list[str]:
    """Removes the temp dirs (``private.agent_temp_dir``) that processes of host ``index`` of the
    pool made on this node and left when they died without cleaning up: an agent SIGKILLed, or a
    Monarch worker killed in its runtime's code, where no signal handler runs (its TLS key
    included). The agent calls it as it stops, once its processes are ended."""
    from .. import procfs
    from ..private import node_temp_root

    found = []
    host = os.uname().nodename
    root = node_temp_root()
    for kind in root.iterdir() if root.is_dir() else []:
        for d in kind.glob(f"{pool}-{index}-{host}-*") if kind.is_dir() else []:
            pid = d.name.rpartition("-")[2]
            if pid.isdigit() and not procfs.alive(int(pid)) and d.lstat().st_uid == os.getuid():
                shutil.rmtree(d, ignore_errors=True)
                found.append(f"temp dir {d}")
    return found


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool", required=True)
    ap.add_argument("--pool-id", required=True)
    ap.add_argument("--index", type=int, action="append", required=True)
    ap.add_argument("--keep", action="append", default=[], help="a live agent's incarnation: its store stays")
    args = ap.parse_args(argv)
    print(json.dumps({i: end_host(args.pool, args.pool_id, i, tuple(args.keep)) for i in args.index}))


if __name__ == "__main__":
    main(sys.argv[1:])
