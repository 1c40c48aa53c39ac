"""CPU time per GB that a cold sync costs the client and each host (issue 17's sync targets).

    .venv/bin/python benchmarks/sync_cpu.py [--mib 512] [--hosts 2] [--no-record]

Writes ``--mib`` MiB of incompressible files (8 MiB each), syncs them cold to a fresh
``monarch_local`` pool of ``--hosts`` hosts with `monarch-torchx sync` (one chain: the client
sends to host 0, which stores, verifies and forwards to host 1, ...), and reports the client's
CPU seconds per GB (chunk + hash + send) and the hosts' CPU per GB per hop (receive + verify +
store + forward), from ``getrusage`` and the agents' sessions (see ``scale.py``). Then the same
for a no-op resync of the same tree.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _results import record  # noqa: E402
from scale import BIN, Meter  # noqa: E402

TARGET_HOST_S_PER_GB = 0.6  # per hop: verify + store + forward
TARGET_CLIENT_S_PER_GB = 1.2  # cold tree: chunk + hash


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="sync-cpu-"))
    env = dict(os.environ, MONARCH_TORCHX_HOME=str(home), PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    tx, mtx = [str(BIN / "torchx")], [str(BIN / "monarch-torchx")]
    m = Meter(home)
    try:
        src = home / "src"
        src.mkdir()
        for i in range(max(1, args.mib // 8)):
            (src / f"blob{i}.bin").write_bytes(os.urandom(8 << 20))
        gb = sum(p.stat().st_size for p in src.iterdir()) / 1e9
        m.run(tx + ["pool", "create", "synccpu", "-cfg", f"hosts={args.hosts},preload=none"], env)
        cold, _ = m.run(mtx + ["sync", "--pool", "synccpu", "--to", "data", str(src)], env)
        again, _ = m.run(mtx + ["sync", "--pool", "synccpu", "--to", "data", str(src)], env)
        m.run(tx + ["pool", "stop", "synccpu"], env)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    host_cold = cold["agents_cpu"] / args.hosts / gb
    client_cold = cold["client_cpu"] / gb
    body = "\n".join([
        f"{gb:.2f} GB of incompressible files to {args.hosts} hosts of one `monarch_local` pool (one chain), "
        "CPU seconds per GB:", "",
        "| | wall | client CPU / GB | host CPU / GB (per hop) |", "|---|---:|---:|---:|",
        f"| cold sync | {cold['wall']:.2f} s ({gb / cold['wall']:.2f} GB/s) | {client_cold:.2f} s | {host_cold:.2f} s |",
        f"| no-op resync | {again['wall']:.2f} s | {again['client_cpu'] / gb:.2f} s | "
        f"{again['agents_cpu'] / args.hosts / gb:.2f} s |", "",
        f"Targets (issue 17): a host <= {TARGET_HOST_S_PER_GB} s of CPU per GB per hop: "
        f"{'met' if host_cold <= TARGET_HOST_S_PER_GB else 'NOT met'}; the client <= {TARGET_CLIENT_S_PER_GB} s per GB "
        f"for a cold tree: {'met' if client_cold <= TARGET_CLIENT_S_PER_GB else 'NOT met'}. The hosts' figure "
        "includes their agents' other work during the sync (heartbeats, telemetry), which is small.",
    ])
    print(body)
    if not args.no_record:
        record("sync-cpu", ".venv/bin/python benchmarks/sync_cpu.py " + " ".join(sys.argv[1:]), body)


if __name__ == "__main__":
    main()
