"""Actor mesh: monarch_torchx side by side with Ray, Monarch (torchmonarch) and raw asyncio TCP.

    .venv/bin/python benchmarks/actors.py [--calls 2000] [--only ours]

One run, each framework in its own process, the same four measurements (see
benchmarks/actors_peers.py for the peers' side); ours twice, plaintext (a loopback pool's
default) and TLS (the default of pools that span machines), to show what TLS costs:
  rtt_ms       call_one round trip to an actor in another process, median of --calls
  rtt_async_ms the same to an actor's `async def` endpoint (ours only)
  call8_ms     call() to 8 actors in 8 procs, all answers gathered, median of 200
  tensor_gbps  a 64 MiB CPU tensor as the argument of one call (GB/s, median of 5)
  spawn8_s     8 new procs that import torch, one actor each, until all 8 answered
               (ours: on a warm pool: created before timing, as a pool is in real use)
Targets (issue 4): rtt <= 1/3 of the faster of Monarch and Ray; call8 <= 2x our rtt;
tensor >= 1.5 GB/s; spawn8 < 0.5 s; (issue 15) rtt with TLS <= 1.3x without. Peers missing
(pip install -e .[bench-peers]) are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).parent))
from _results import record  # noqa: E402

HERE = Path(__file__).parent
MIB64 = 64 << 20


def _median_ms(fn: Callable[[], Any], n: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def run_ours(calls: int, tls: bool = False) -> dict[str, float | None]:
    """Our side, in this process (a private registry home and a warm 1-host monarch_local pool)."""
    home = Path(tempfile.mkdtemp(prefix="bench-actors-")) / "home"
    os.environ["MONARCH_TORCHX_HOME"] = str(home)
    sys.path.insert(0, str(HERE))
    import torch
    from bench_actor_classes import AsyncEcho, Echo, TorchEcho  # importable by the procs (benchmarks/ is on their path)

    from monarch_torchx import attach
    from monarch_torchx.pool import PoolRequest, ensure_pool, stop_pool

    out: dict[str, float | None] = {}
    ensure_pool(PoolRequest("monarch_local", "bench", {"hosts": 1, "preload": "torch", "tls": tls}))
    try:
        host = attach("bench")
        env = {"PYTHONPATH": str(HERE)}
        procs = host.spawn_procs(per_host={"procs": 8}, env=env)
        echo = procs.spawn("echo", Echo)
        one = echo.slice(procs=0)
        out["rtt_ms"] = _median_ms(lambda: one.ping.call_one().get(), calls, 50)
        aecho = procs.slice(procs=1).spawn("aecho", AsyncEcho)
        out["rtt_async_ms"] = _median_ms(lambda: aecho.ping.call_one().get(), calls, 50)
        out["call8_ms"] = _median_ms(lambda: echo.ping.call().get(), 200, 20)
        t = torch.ones(MIB64, dtype=torch.uint8)
        ms = _median_ms(lambda: one.numel.call_one(t).get(), 5, 1)
        out["tensor_gbps"] = MIB64 / 1e9 / (ms / 1e3)
        procs.stop().get()
        t0 = time.perf_counter()
        fresh = host.spawn_procs(per_host={"procs": 8}, env=env)
        fresh.spawn("torch_echo", TorchEcho).ping.call().get()
        out["spawn8_s"] = time.perf_counter() - t0
        fresh.stop().get()
    finally:
        stop_pool("bench")
    return out


def run_peer(peer: str, calls: int) -> dict[str, Any]:
    t0 = time.time()
    res = subprocess.run(
        [sys.executable, str(HERE / "actors_peers.py"), peer, "--calls", str(calls)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    try:
        data = json.loads(res.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        data = {"error": (res.stderr.strip().splitlines() or ["no output"])[-1]}
    print(f"  {peer}: {time.time() - t0:.0f} s", file=sys.stderr)
    return data


def fmt(v: float | None, digits: int = 3) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--only", choices=["ours"], help="skip the peers")
    ap.add_argument("--no-record", action="store_true", help="do not write benchmarks/RESULTS.md")
    args = ap.parse_args()
    results: dict[str, dict[str, Any]] = {}
    for name, tls in (("monarch_torchx", False), ("monarch_torchx (TLS)", True)):
        print(f"running {name} ...", file=sys.stderr)
        child = subprocess.run(
            [
                sys.executable,
                "-c",
                f"import sys, json; sys.path.insert(0, {str(HERE)!r}); "
                f"import actors; print(json.dumps(actors.run_ours({args.calls}, tls={tls})))",
            ],
            capture_output=True,
            text=True,
            timeout=900,
        )
        try:
            results[name] = json.loads(child.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            raise SystemExit(f"our side failed:\n{child.stderr[-3000:]}")  # noqa: B904
    if args.only != "ours":
        for peer in ("asyncio", "monarch", "ray"):
            print(f"running {peer} ...", file=sys.stderr)
            results[peer] = run_peer(peer, args.calls)
    ours = results["monarch_torchx"]
    rows = [
        "| | rtt (ms) | call 8 procs (ms) | 64 MiB tensor (GB/s) | spawn 8 torch procs (s) |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if "error" in r:
            rows.append(f"| {name} | not run: {r['error']} | | | |")
            continue
        rows.append(
            f"| {name} | {fmt(r.get('rtt_ms'))} | {fmt(r.get('call8_ms'))} | {fmt(r.get('tensor_gbps'), 2)} "
            f"| {fmt(r.get('spawn8_s'), 2)} |"
        )
    peers_rtt = [results[p]["rtt_ms"] for p in ("monarch", "ray") if results.get(p, {}).get("rtt_ms")]
    lines = ["", "Targets (issue 4), from this run:"]
    if peers_rtt:
        best = min(peers_rtt)
        lines.append(
            f"- rtt: {ours['rtt_ms']:.3f} ms = 1/{best / ours['rtt_ms']:.1f} of the faster peer "
            f"({best:.3f} ms); target <= 1/3: {'met' if ours['rtt_ms'] * 3 <= best else 'NOT met'}"
        )
    lines.append(
        f"- call to 8 procs: {ours['call8_ms'] / ours['rtt_ms']:.2f}x our rtt; target <= 2x: "
        f"{'met' if ours['call8_ms'] <= 2 * ours['rtt_ms'] else 'NOT met'}"
    )
    floor = results.get("asyncio", {})
    if floor.get("rtt_ms") and floor.get("call8_ms"):
        lines.append(
            f"  (the floor: raw asyncio TCP needs {floor['call8_ms'] / floor['rtt_ms']:.2f}x its own rtt to "
            f"answer from 8 server processes on this machine; ours is {ours['call8_ms'] / floor['call8_ms']:.1f}x "
            f"its time)"
        )
    lines.append(
        f"- 64 MiB tensor: {ours['tensor_gbps']:.2f} GB/s; target >= 1.5: "
        f"{'met' if ours['tensor_gbps'] >= 1.5 else 'NOT met'}"
    )
    lines.append(
        f"- spawn 8 torch procs on a warm pool: {ours['spawn8_s']:.2f} s; target < 0.5 s: "
        f"{'met' if ours['spawn8_s'] < 0.5 else 'NOT met'}"
    )
    tls = results["monarch_torchx (TLS)"]
    cost = tls["rtt_ms"] / ours["rtt_ms"]
    lines.append(
        f"- TLS (issue 15): rtt {cost:.2f}x without TLS, call8 {tls['call8_ms'] / ours['call8_ms']:.2f}x, "
        f"64 MiB tensor {tls['tensor_gbps'] / ours['tensor_gbps']:.2f}x the throughput; "
        f"target rtt <= 1.3x: {'met' if cost <= 1.3 else 'NOT met'}"
    )
    for peer in ("monarch", "ray"):
        r = results.get(peer, {})
        if r.get("rtt_ms"):
            lines.append(
                f"- vs {peer}: rtt {r['rtt_ms'] / ours['rtt_ms']:.1f}x faster, call8 "
                f"{r['call8_ms'] / ours['call8_ms']:.1f}x, tensor {ours['tensor_gbps'] / r['tensor_gbps']:.1f}x, "
                f"spawn8 {r['spawn8_s'] / ours['spawn8_s']:.1f}x"
            )
    body = "\n".join(rows + lines)
    print(body)
    if not args.no_record:  # ours alone (TLS off and on) is its own section: the peers' table stays
        section = "actors" if args.only is None else "actors-tls"
        record(
            section,
            f".venv/bin/python benchmarks/actors.py --calls {args.calls}" + (" --only ours" if args.only else ""),
            body,
        )


if __name__ == "__main__":
    main()
