"""monarch_kubernetes on the emulated cluster of the tests (kmock API server, emulated kubelet).

Two questions, each answered side by side in one run:

1. What does a warm pool save? A cold `torchx run` (create the pool's objects, wait for pods to
   become ready, launch) against a warm one (launch only), alternating. On a real cluster the
   cold side also pays scheduling, an image pull and container start, so this ratio is a floor.
2. What does reaching agents through the API server's port-forward cost? One request on a new
   connection (tunnel or TCP connect, handshake, call), port_forward against pod_ip, alternating.

    .venv/bin/python benchmarks/k8s_pools.py [--n 5] [--calls 30]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).parent))

from _results import record  # noqa: E402
from fixtures.k8s_cluster import Cluster  # noqa: E402

TORCHX = str(Path(sys.executable).parent / "torchx")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_echo(cfg: str, sched) -> float:
    """`torchx run` of utils.echo until the app SUCCEEDED; seconds."""
    t = time.perf_counter()
    res = subprocess.run(
        [TORCHX, "run", "-s", "monarch_kubernetes", "-cfg", cfg, "utils.echo", "--msg", "hi"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if res.returncode != 0:
        raise SystemExit(f"torchx run failed:\n{res.stderr[-2000:]}")
    app = res.stdout.strip().splitlines()[-1].rsplit("/", 1)[1]
    while True:
        d = sched.describe(app)
        if d is not None and d.state.name in ("SUCCEEDED", "FAILED"):
            if d.state.name != "SUCCEEDED":
                raise SystemExit(f"echo {d.state.name}: {d.msg}")
            return time.perf_counter() - t
        time.sleep(0.005)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=5, help="cold/warm pairs")
    ap.add_argument("--calls", type=int, default=30, help="requests per access mode")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="mtx-k8s-bench-"))
    os.environ["MONARCH_TORCHX_HOME"] = str(root / "home")
    cluster = Cluster(root).start()
    os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
    from monarch_torchx.pool import attach, stop_pool
    from monarch_torchx.schedulers.kubernetes import create_scheduler

    sched = create_scheduler("bench")
    try:
        cold, warm, warm_ip = [], [], []
        run_echo(f"pool=direct,access=pod_ip,port={free_port()},preload=none", sched)
        for i in range(args.n):
            cfg = f"pool=cold{i},port={free_port()},preload=none"
            cold.append(run_echo(cfg, sched))
            warm.append(run_echo(f"pool=cold{i}", sched))
            warm_ip.append(run_echo("pool=direct", sched))
            stop_pool(f"cold{i}")
            print(
                f"round {i}: cold {cold[-1]:.3f} s, warm {warm[-1]:.3f} s, warm pod_ip {warm_ip[-1]:.3f} s",
                file=sys.stderr,
            )
        stop_pool("direct")

        times = {"pod_ip": [], "port_forward": []}
        for mode in times:
            subprocess.run(
                [
                    TORCHX,
                    "pool",
                    "create",
                    mode.replace("_", "-"),
                    "-s",
                    "monarch_kubernetes",
                    "-cfg",
                    f"access={mode},port={free_port()},preload=none",
                ],
                check=True,
                capture_output=True,
            )
        pools = {mode: attach(mode.replace("_", "-")) for mode in times}
        for _ in range(args.calls):
            for mode, pool in pools.items():
                t = time.perf_counter()
                pool.call(0, "info", timeout=10)
                times[mode].append(time.perf_counter() - t)
        for mode in times:
            stop_pool(mode.replace("_", "-"))
    finally:
        cluster.stop()

    med = {k: statistics.median(v) for k, v in times.items()}
    cm, wm, wim = statistics.median(cold), statistics.median(warm), statistics.median(warm_ip)
    body = f"""Emulated cluster (`tests/fixtures/k8s_cluster.py`: kmock API server, controllers and a kubelet
that starts each pod's agent as a local process), official kubernetes client. Pods start in well
under a second here; on a real cluster a cold pool also waits for scheduling, an image pull and
the container, so the cold/warm ratio below is a floor.

| run | median (s) | runs |
|---|---:|---:|
| `torchx run utils.echo`, cold pool (objects created, pods started, then launch) | {cm:.3f} | {len(cold)} |
| `torchx run utils.echo`, warm pool (launch only), port-forward (default outside a cluster) | {wm:.3f} | {len(warm)} |
| `torchx run utils.echo`, warm pool, `access=pod_ip` | {wim:.3f} | {len(warm_ip)} |

| one request on a new connection | median (ms) | calls |
|---|---:|---:|
| pod_ip (TCP connect + handshake + `info`) | {med["pod_ip"] * 1e3:.1f} | {args.calls} |
| port_forward (API server websocket tunnel + handshake + `info`) | {med["port_forward"] * 1e3:.1f} | {args.calls} |

Ratios (same run):
- a warm run is **{cm / wm:.1f}x** faster than a cold one through port-forward, **{cm / wim:.1f}x** with pod_ip
  (all include the torchx CLI's own start, about 0.3 s; port-forward also imports the kubernetes
  client, about 0.4 s, which pod_ip does not need; each poll of the app's state opens a tunnel too)
- a request through port-forward costs **{med["port_forward"] / med["pod_ip"]:.1f}x** one to the pod IP
"""
    print(body)
    record("k8s_pools", f".venv/bin/python benchmarks/k8s_pools.py --n {args.n} --calls {args.calls}", body)


if __name__ == "__main__":
    main()
