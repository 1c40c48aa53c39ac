"""Reading a synced file through the syncfs FUSE mount, against reading the same bytes directly.

The issue's reference: a minimal pyfuse3 read-only file system serves ~1 GB/s with 128 KiB
requests, and the page cache 4-6 GB/s. A local pool of one host gets a 1 GiB file (4 MiB
content-defined chunks in the host's store) and a tree of 2,000 small files (packed chunks);
then, alternating, each is read (a) through the mount with the page cache dropped (every byte
passes through the FUSE server, from the store on disk), (b) through the mount again (the
kernel's cache: contents are immutable, so it stays valid), and (c) directly from the client's
source files with the page cache dropped (the disk's own rate). Needs root (drop_caches).

    sudo .venv/bin/python benchmarks/sync_read.py [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).parent))


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def read_all(paths: list[Path]) -> int:
    n = 0
    buf = bytearray(1 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while k := f.readinto(buf):
                n += k
    return n


COLUMNS = ("fuse, cold", "fuse, store cached", "fuse, cached", "source files, cold")


def timed(fn: Callable[[], int]) -> float:
    """Seconds for one read of the tree."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (drop_caches)")
    from _results import record

    from monarch_torchx.pool import PoolRequest, ensure_pool, stop_pool
    from monarch_torchx.registry import Registry

    work = Path(tempfile.mkdtemp(prefix="mtx-syncread-"))
    os.environ["MONARCH_TORCHX_HOME"] = str(work / "home")
    os.environ["MONARCH_TORCHX_SYNC_STORE"] = str(work / "store")
    big, small = work / "big", work / "small"
    big.mkdir()
    with open(big / "weights.bin", "wb") as f:
        for _ in range(1024):
            f.write(os.urandom(1 << 20))
    for d in range(20):
        (small / f"pkg{d}").mkdir(parents=True)
        for k in range(100):
            (small / f"pkg{d}" / f"m{k}.py").write_bytes(os.urandom(4096 + 61 * k))
    rows: dict[str, dict[str, list[float]]] = {}
    try:
        pool = ensure_pool(PoolRequest("monarch_local", "syncread", {"hosts": 1, "preload": ""}))
        for name, src in (("1 GiB file", big), ("2,000 small files", small)):
            rep = pool.sync(str(src), name.split()[1])
            assert rep.ok and rep.hosts[0].served_by == "fuse", rep
            mount = Path(rep.hosts[0].path)
            via_fuse = sorted(p for p in mount.rglob("*") if p.is_file())
            direct = sorted(p for p in src.rglob("*") if p.is_file())
            store = sorted(
                p
                for p in (work / "store").rglob("*")  # chunk and pack files (not the mount itself)
                if p.is_file() and ("chunks" in p.parts or "packs" in p.parts) and "mounts" not in p.parts
            )
            r = rows.setdefault(name, {k: [] for k in COLUMNS})
            for _ in range(args.reps):
                drop_caches()
                r["fuse, cold"].append(timed(lambda: read_all(via_fuse)))  # noqa: B023
                r["fuse, cached"].append(timed(lambda: read_all(via_fuse)))  # noqa: B023
                drop_caches()
                read_all(store)  # the store's files in the page cache, the mount's own cache empty
                r["fuse, store cached"].append(timed(lambda: read_all(via_fuse)))  # noqa: B023
                drop_caches()
                r["source files, cold"].append(timed(lambda: read_all(direct)))  # noqa: B023
    finally:
        try:
            stop_pool("syncread", Registry(work / "home"))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    lines = [
        f"Median of {args.reps} rounds, the ways of reading alternating. The 1 GiB file in GB/s, the small "
        "files in files/s.",
        "",
        "| tree | " + " | ".join(COLUMNS) + " | fuse cold / source cold |",
        "|---|" + "---:|" * (len(COLUMNS) + 1),
    ]
    for name, r in rows.items():
        amount = (1 << 30) / 1e9 if name.startswith("1 GiB") else 2000
        rate = {k: amount / med(r[k]) for k in COLUMNS}
        fmt = "{:.2f}" if name.startswith("1 GiB") else "{:,.0f}"
        lines.append(
            f"| {name} | "
            + " | ".join(fmt.format(rate[k]) for k in COLUMNS)
            + f" | {rate['fuse, cold'] / rate['source files, cold']:.2f} |"
        )
    lines += [
        "",
        "- cold: the page cache dropped first, so bytes come from disk (the store's chunk and pack files "
        "through the FUSE server, or the source files directly); store cached: the store's files in the page "
        "cache, the mount's own cache empty (the FUSE server's own rate; the issue's reference for a minimal "
        "pyfuse3 file system: ~1 GB/s); cached: a second read through the mount, served by the kernel",
    ]
    body = "\n".join(lines)
    print(body)
    record("sync-read", f"sudo .venv/bin/python benchmarks/sync_read.py --reps {args.reps}", body)


if __name__ == "__main__":
    main()
