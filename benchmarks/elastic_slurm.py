"""Elastic SLURM pools (issue 42): a 1-node pool grows to 3 and runs a 3-replica app, against a
stock `torchx run -s slurm` of the same app, on the project's SLURM lab (as root).

    .venv/bin/python benchmarks/elastic_slurm.py [--n 3]

The app: `utils.python --num_replicas 3` of a script that imports torch and prints "done".
Side by side in one run, median of N interleaved rounds, each from invoking `torchx run` to the
last replica's "done" line:
  slurm (stock)            `torchx run -s slurm`: one fresh 3-node allocation, cold Python
  monarch_slurm grow 1->3  a warm 1-node pool; `-cfg nodes=3,grow=True` submits a 2-node
                           allocation whose agents join (and preload torch) while host 0 stays
  monarch_slurm auto 1->3  a warm 1-node pool made with `max_nodes=3,backlog=0s`: the run waits
                           in the pool's queue and host 0 grows the pool for it (no client)
  monarch_slurm cold 3     no pool yet: the pool of 3 is made by the run (what `replace=True`
                           cost before a pool could grow: every warm host lost)
  monarch_slurm warm 3     the grown pool, run again
  monarch_slurm renewed 3  a warm 3-node pool made with `time=2,renew=True`, once its first
                           allocation ended: the first run on its successor allocation (whose
                           agents started on standby, preloaded torch and took the hosts over)
Line times: stock, when the line shows in its slurm-*.out file (polled every 2 ms); monarch, the
agent's own per-line arrival stamp. The lab's 3 nodes share this machine's cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _results import record  # noqa: E402

BIN = Path(sys.executable).parent
LAB = Path(__file__).resolve().parents[1] / "scripts" / "slurmlab"
SCRIPT = """\
import torch
print("ready", torch.__version__, flush=True)
torch.ones(1000).sum()
print("done", flush=True)
"""
APP = ["utils.python", "--num_replicas", "3", "--script", "bench_torch.py"]
POOL_CFG = "partition=debug,time=00:30:00"


def _env(home: Path) -> dict[str, str]:
    return {**os.environ, "MONARCH_TORCHX_HOME": str(home), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}


def _cli(home: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    res = subprocess.run(argv, cwd=cwd, env=_env(home), capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])} failed: {res.stderr.strip()[-800:]}")
    return res


def _replica_done_times(home: Path, handle: str, timeout: float = 300) -> list[float]:
    """When each replica's "done" line reached its agent (the agent stamps every line), from the
    replicas' log files wherever they ran (an app the pool's queue started is not placed in its
    record until someone asks)."""
    from monarch_torchx.registry import Registry

    pool, app = handle.rsplit("/", 1)[1].split(":", 1)
    deadline = time.time() + timeout
    while time.time() < deadline:
        rec = Registry(home).require(pool)
        done = []
        for path in rec.path.glob(f"logs/host*/{app}/*/*/stdout.log"):
            lines = path.read_text().splitlines()
            stamps = [float(ts) for ts, _, text in (raw.partition(" ") for raw in lines) if text.startswith("done")]
            done.extend(stamps[:1])
        if len(done) == 3:
            return done
        time.sleep(0.01)
    raise SystemExit(f"{handle}: not every replica printed 'done' within {timeout:.0f} s")


def run_monarch(home: Path, cwd: Path, cfg: str) -> float:
    t0 = time.time()
    res = _cli(home, cwd, str(BIN / "torchx"), "run", "-s", "monarch_slurm", "-cfg", cfg, *APP)
    return max(_replica_done_times(home, res.stdout.strip().splitlines()[-1])) - t0


def run_stock(home: Path, base: Path) -> float:
    cwd = Path(tempfile.mkdtemp(prefix="stock-", dir=base))
    (cwd / "bench_torch.py").write_text(SCRIPT)
    t0 = time.time()
    # (not checked: torchx's own status poll right after sbatch can raise KeyError 'job_resources'
    # on the squeue JSON of a pending job of slurm 22.05; the job was submitted and runs all the same)
    subprocess.run(
        [str(BIN / "torchx"), "run", "-s", "slurm", "-cfg", "partition=debug", *APP],
        cwd=cwd,
        env=_env(home),
        capture_output=True,
        timeout=600,
    )
    deadline = time.time() + 300
    while time.time() < deadline:
        outs = list(cwd.glob("slurm-*-python-*.out"))
        done = [f for f in outs if any(line.startswith("done") for line in f.read_text(errors="replace").splitlines())]
        if len(done) == 3:
            return time.time() - t0
        time.sleep(0.002)
    raise SystemExit(f"stock slurm: not every replica printed 'done' in {cwd} within 300 s")


def warm_pool(home: Path, base: Path, pool: str, nodes: int, extra: str = "", cfg: str = POOL_CFG) -> None:
    """A pool of ``nodes`` hosts, torch preloaded on each, before any timing starts."""
    _cli(home, base, str(BIN / "monarch-torchx"), "pool", "create", pool, "-s", "monarch_slurm", "-cfg",
         f"nodes={nodes},{cfg}{extra}")  # fmt: skip
    from monarch_torchx.pool import attach

    p = attach(pool)
    deadline = time.time() + 180
    while time.time() < deadline:
        if all(p.call(i, "info")["warm"]["ready"] for i in range(nodes)):
            return
        time.sleep(0.1)
    raise SystemExit(f"pool {pool} did not warm within 180 s")


def renewed(home: Path, pool: str, timeout: float = 240) -> None:
    """Waits until the pool's first allocation has ended and its successor serves every host."""
    from monarch_torchx.pool import attach
    from monarch_torchx.registry import Registry
    from monarch_torchx.schedulers.slurm import allocations, jobs_states

    first = allocations(Registry(home).require(pool))[0].job_id
    deadline = time.time() + timeout
    while time.time() < deadline:
        if jobs_states([first])[first][0] not in ("RUNNING", "COMPLETING", "PENDING"):
            p = attach(pool)
            if all(p.call(i, "info")["warm"]["ready"] for i in range(p.record.num_hosts)):
                return
        time.sleep(0.5)
    raise SystemExit(f"pool {pool}: allocation {first} was not renewed within {timeout:.0f} s")


def stop(home: Path, pool: str) -> None:
    subprocess.run([str(BIN / "monarch-torchx"), "pool", "stop", pool], env=_env(home), capture_output=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=3, help="rounds (each: every case once)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("this benchmark needs root (it uses the project's SLURM lab)")
    try:
        up = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10)
        started = up.returncode != 0 or not up.stdout.split()  # (stopped at the end only if started here)
    except (OSError, subprocess.TimeoutExpired):
        started = True
    subprocess.run(["bash", str(LAB / "start-cluster.sh")], check=True, capture_output=True)
    home = Path(tempfile.mkdtemp(prefix="bench-home-"))
    base = Path(tempfile.mkdtemp(prefix="bench-elastic-"))
    (base / "bench_torch.py").write_text(SCRIPT)
    os.environ["MONARCH_TORCHX_HOME"] = str(home)
    times: dict[str, list[float]] = {}
    pools: list[str] = []
    try:
        for i in range(args.n):
            print(f"round {i + 1}/{args.n}", file=sys.stderr, flush=True)
            times.setdefault("slurm (stock)", []).append(run_stock(home, base))
            grow = f"bench-grow-{i}"
            pools.append(grow)
            warm_pool(home, base, grow, 1)
            times.setdefault("monarch_slurm grow 1->3", []).append(
                run_monarch(home, base, f"pool={grow},nodes=3,grow=True")
            )
            times.setdefault("monarch_slurm warm 3", []).append(run_monarch(home, base, f"pool={grow}"))
            stop(home, grow)
            auto = f"bench-auto-{i}"
            pools.append(auto)
            warm_pool(home, base, auto, 1, ",max_nodes=3,backlog=0s")
            times.setdefault("monarch_slurm auto 1->3", []).append(run_monarch(home, base, f"pool={auto}"))
            stop(home, auto)
            cold = f"bench-cold-{i}"
            pools.append(cold)
            times.setdefault("monarch_slurm cold 3", []).append(
                run_monarch(home, base, f"pool={cold},nodes=3,{POOL_CFG}")
            )
            stop(home, cold)
            renew = f"bench-renew-{i}"
            pools.append(renew)
            warm_pool(home, base, renew, 3, cfg="partition=debug,time=2,renew=True")
            renewed(home, renew)
            times.setdefault("monarch_slurm renewed 3", []).append(run_monarch(home, base, f"pool={renew}"))
            stop(home, renew)
    finally:
        for p in pools:
            stop(home, p)
        if started:
            subprocess.run(["bash", str(LAB / "stop-cluster.sh")], capture_output=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    stock = med["slurm (stock)"]
    rows = ["| case | to the last replica's done (s), median | runs (s) | vs stock |", "|---|---:|---|---:|"]
    for case, v in times.items():
        runs = ", ".join(f"{t:.2f}" for t in v)
        rows.append(f"| {case} | {med[case]:.2f} | {runs} | {stock / med[case]:.1f}x |")
    body = "\n".join(
        [
            f"SLURM lab (3 nodes in network namespaces, slurm 22.05), {args.n} interleaved rounds; the app: "
            "`utils.python --num_replicas 3` of a script that imports torch. From invoking `torchx run` to the "
            "last of the 3 replicas' `done` lines.",
            "",
            *rows,
            "",
            f"- Growing a warm 1-node pool to 3 and running the app: **{stock / med['monarch_slurm grow 1->3']:.1f}x** "
            "the stock `torchx run -s slurm` of the same app (the 2 joining hosts preload torch before the app "
            "starts); host 0 and whatever ran there stayed up.",
            f"- Growing by itself (`max_nodes=3,backlog=0s`: the run waits in the queue, host 0 submits the "
            f"allocation): **{stock / med['monarch_slurm auto 1->3']:.1f}x** stock.",
            f"- The same against making a cold pool of 3 (what `replace=True` costs): "
            f"{med['monarch_slurm cold 3'] / med['monarch_slurm grow 1->3']:.1f}x.",
            f"- Once grown, the next run: **{stock / med['monarch_slurm warm 3']:.1f}x** stock.",
            f"- Kept warm across two walltimes (`time=2,renew=True`: the first run once the first allocation "
            f"ended, on its successor): **{stock / med['monarch_slurm renewed 3']:.1f}x** stock, "
            f"**{med['monarch_slurm cold 3'] / med['monarch_slurm renewed 3']:.1f}x** a cold pool of 3.",
        ]
    )
    print(body)
    record("elastic_slurm", f".venv/bin/python benchmarks/elastic_slurm.py --n {args.n}", body)


if __name__ == "__main__":
    main()
