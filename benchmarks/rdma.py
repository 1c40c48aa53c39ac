"""RDMABuffer throughput per backend, side by side with the limits of this machine.

    .venv/bin/python benchmarks/rdma.py [--sizes 1,16,256,1024] [--slurm]

For each size (MiB), in one run, GB/s (decimal) of read_into from an actor's buffer:
  memcpy      numpy copy of the same size between two warm buffers (the same-host limit)
  cma         RDMABuffer, same host: process_vm_readv, one kernel copy
  raw tcp     a plain socket server in the owner's proc, same number of streams, recv_into
  tcp         RDMABuffer forced to tcp (MONARCH_TORCHX_RDMA=tcp)
--slurm adds the same tcp pair across the SLURM lab's veth links (owner on a lab node,
reader in the controller, outside the node's network namespace), on a pool with TLS off and on one with it on.
Median of 5 (3 at 1 GiB) after one warm-up round; the methods take turns, so they share the noise.
Targets (issue 5): tcp >= 80% of raw multi-stream socket throughput (loopback and veth); cma >= 70%
of memcpy. ibverbs: no device here, not run.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _results import record  # noqa: E402

MiB = 1 << 20


def interleaved(nbytes: int, fns: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
    """GB/s of each fn, median of ``reps``; the fns take turns so they share the same noise."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(reps + 1):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            if rep:  # the first round warms up
                times[name].append(time.perf_counter() - t)
    return {name: nbytes / 1e9 / statistics.median(ts) for name, ts in times.items()}


def _with_backend(backend: str, fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        os.environ["MONARCH_TORCHX_RDMA"] = backend
        try:
            fn()
        finally:
            os.environ.pop("MONARCH_TORCHX_RDMA", None)

    return run


def raw_read(host: str, port: int, dst: memoryview, streams: int) -> None:
    n = dst.nbytes
    step = -(-n // streams)

    def one(off: int) -> None:
        k = min(step, n - off)
        with socket.create_connection((host, port)) as s:
            s.sendall(off.to_bytes(8, "big") + k.to_bytes(8, "big"))
            view = dst[off : off + k]
            got = 0
            while got < k:
                got += s.recv_into(view[got:])

    threads = [threading.Thread(target=one, args=(off,)) for off in range(0, n, step)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def measure(pool: str, sizes: list[int], remote: bool) -> list[dict[str, float]]:
    import numpy as np
    import torch

    from monarch_torchx import attach
    from monarch_torchx.rdma.tcp import MAX_STREAMS, STREAM_MIN
    from tests.fixtures.rdma_actors import RawSender, Weights

    rows = []
    hosts = attach(pool)
    for mib in sizes:
        n = mib * MiB
        reps = 3 if mib >= 1024 else 5
        procs = hosts.slice(hosts=0).spawn_procs(per_host={"procs": 1})
        try:
            w = procs.spawn("w", Weights, n // 4).slice(procs=0)
            buf = w.handle_settled.call_one().get()  # steady state: its memory already on huge pages
            raw = procs.spawn("raw", RawSender, n).slice(procs=0)
            streams = 1 if n < STREAM_MIN else min(MAX_STREAMS, n // (STREAM_MIN // 2))
            port = raw.serve.call_one(streams).get()
            dst = torch.empty(n, dtype=torch.uint8)
            view = memoryview(dst.numpy())
            row: dict[str, float] = {"MiB": mib, "streams": streams}
            fns: dict[str, Callable[[], None]] = {}
            if not remote:
                a, b = np.ones(n, dtype=np.uint8), np.empty(n, dtype=np.uint8)
                fns["memcpy"] = lambda: np.copyto(b, a)  # noqa: B023
                fns["cma"] = _with_backend("cma", lambda: buf.read_into(dst).get())  # noqa: B023
            fns["raw tcp"] = lambda: raw_read(buf._h.host, port, view, streams)  # noqa: B023
            fns["tcp"] = _with_backend("tcp", lambda: buf.read_into(dst).get())  # noqa: B023
            row.update(interleaved(n, fns, reps))
            rows.append(row)
            print(row, file=sys.stderr)
        finally:
            procs.stop().get()
    return rows


def table(rows: list[dict[str, float]], remote: bool) -> str:
    cols = ["raw tcp", "tcp"] if remote else ["memcpy", "cma", "raw tcp", "tcp"]
    out = [
        "| MiB | streams | "
        + " | ".join(f"{c} (GB/s)" for c in cols)
        + " | tcp / raw"
        + ("" if remote else " | cma / memcpy")
        + " |",
        "|---" * (len(cols) + 3 + (0 if remote else 1)) + "|",
    ]
    for r in rows:
        cells = [f"{r[c]:.2f}" for c in cols]
        ratio = f"{r['tcp'] / r['raw tcp']:.0%}"
        extra = "" if remote else f" | {r['cma'] / r['memcpy']:.0%}"
        out.append(f"| {r['MiB']} | {r['streams']} | " + " | ".join(cells) + f" | {ratio}{extra} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,16,256,1024", help="MiB, comma-separated")
    ap.add_argument("--slurm", action="store_true", help="also across the SLURM lab's veth links (root)")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    home = Path(tempfile.mkdtemp(prefix="bench-rdma-")) / "home"
    os.environ["MONARCH_TORCHX_HOME"] = str(home)
    os.chdir(Path(__file__).resolve().parents[1])
    from monarch_torchx.pool import PoolRequest, ensure_pool, stop_pool

    ensure_pool(PoolRequest("monarch_local", "bench", {"hosts": 1, "preload": "torch"}))
    try:
        body = "Same host (loopback):\n\n" + table(measure("bench", sizes, remote=False), remote=False)
    finally:
        stop_pool("bench")
    if args.slurm:
        lab = Path(__file__).resolve().parents[1] / "scripts" / "slurmlab"
        subprocess.run(["bash", str(lab / "start-cluster.sh")], check=True, capture_output=True)
        bin_dir = Path(sys.executable).parent
        for tls in (False, True):  # plaintext, then TLS (the default of a SLURM pool): what TLS costs
            subprocess.run(
                [
                    str(bin_dir / "monarch-torchx"),
                    "pool",
                    "create",
                    "labbench",
                    "-s",
                    "monarch_slurm",
                    "-cfg",
                    f"nodes=1,partition=debug,time=00:30:00,tls={tls}",
                ],
                check=True,
                capture_output=True,
            )
            try:
                body += (
                    f"\n\nAcross the SLURM lab's veth link (owner on a lab node, reader outside its namespace), "
                    f"TLS {'on (a SLURM pool’s default)' if tls else 'off (tls=False)'}:\n\n"
                )
                body += table(measure("labbench", sizes, remote=True), remote=True)
            finally:
                stop_pool("labbench")
    body += "\n\nTargets: tcp >= 80% of raw multi-stream socket; cma >= 70% of memcpy. ibverbs: not run (no device)."
    print(body)
    if not args.no_record:
        cmd = (
            "python benchmarks/rdma.py"
            + (f" --sizes {args.sizes}" if args.sizes != "1,16,256,1024" else "")
            + (" --slurm" if args.slurm else "")
        )
        record("rdma", cmd, body)


if __name__ == "__main__":
    main()
