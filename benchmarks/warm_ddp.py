"""Warm distributed training: `torchx run --wait --log dist.ddp` on stock schedulers vs warm pools.

    .venv/bin/python benchmarks/warm_ddp.py [--n 7]
    .venv/bin/python benchmarks/warm_ddp.py --slurm [--n 5]   # adds stock slurm vs monarch_slurm (lab, root)
    .venv/bin/python benchmarks/warm_ddp.py --baseline /tmp/mtx-base [--n 5]  # adds an earlier commit's warm pool

Each case runs the same script (gloo: init_process_group, one all_reduce, print "first-step",
a few more steps, done) through the real torchx CLI, all cases interleaved, median of N:
  first step  from invoking `torchx run` to the first "first-step" line on the CLI's output
  completion  from invoking `torchx run` until it returned (the app SUCCEEDED)
Cases: stock local_cwd -j 1x2; warm monarch_local -j 2x1 and -j 1x2 (pool up and warm before the
first timed run); with --slurm, stock slurm -j 2x1 and warm monarch_slurm -j 2x1 on 2 lab nodes;
with --baseline CHECKOUT (a worktree of an earlier commit), its warm monarch_local cases too, its
code on PYTHONPATH (the CLI, its agents and their processes import it), and the ratio this / baseline.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _results import record  # noqa: E402

BIN = Path(sys.executable).parent
SCRIPT = """\
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(4)
dist.all_reduce(t)
print("first-step", dist.get_rank(), flush=True)
model = torch.nn.Linear(8, 1)
for _ in range(3):
    g = torch.ones(9)
    dist.all_reduce(g)
dist.barrier()
dist.destroy_process_group()
"""


def timed_run(
    args: list[str], cwd: Path, env: dict[str, str], timeout: float = 180, watch: str | None = None
) -> tuple[float, float]:
    """(time to the first "first-step" line, time until the CLI returned), from the CLI's start.

    ``watch``: a glob in ``cwd`` of output files to find the line in instead (stock slurm's CLI
    tails only stderr), polled every 5 ms.
    """
    before = set(cwd.glob(watch)) if watch else set()
    t0 = time.time()
    p = subprocess.Popen(
        [str(BIN / "torchx"), *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    first: list[float] = []
    out: list[str] = []

    def read() -> None:
        assert p.stdout is not None
        for line in p.stdout:
            out.append(line)
            if not first and "first-step" in line:
                first.append(time.time() - t0)

    def watch_files() -> None:
        while not first and p.poll() is None:
            for f in set(cwd.glob(watch or "")) - before:
                try:
                    if "first-step" in f.read_text(errors="replace"):
                        first.append(time.time() - t0)
                        return
                except OSError:
                    pass
            time.sleep(0.005)

    reader = threading.Thread(target=read if not watch else lambda: out.extend(p.stdout or []), daemon=True)
    reader.start()
    watcher = threading.Thread(target=watch_files, daemon=True) if watch else None
    if watcher:
        watcher.start()
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise SystemExit(f"torchx {' '.join(args)} did not finish in {timeout:.0f} s:\n{''.join(out[-20:])}")  # noqa: B904
    done = time.time() - t0
    reader.join(10)
    if watcher:
        watcher.join(10)
        if not first:  # it finished between two polls
            if any("first-step" in f.read_text(errors="replace") for f in set(cwd.glob(watch or "")) - before):
                first.append(done)
    text = "".join(out)
    if p.returncode != 0 or "SUCCEEDED" not in text or not first:
        raise SystemExit(f"torchx {' '.join(args)} failed (exit {p.returncode}):\n{''.join(out[-30:])}")
    return first[0], done


def ddp(scheduler: str, cfg: str, j: str) -> list[str]:
    opts = ["-cfg", cfg] if cfg else []
    return ["run", "--wait", "--log", "-s", scheduler, *opts, "dist.ddp", "-j", j, "--script", "bench_ddp.py"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=7, help="timed runs per case (median reported)")
    ap.add_argument("--slurm", action="store_true", help="also stock slurm vs monarch_slurm on the SLURM lab")
    ap.add_argument("--baseline", type=Path, help="an earlier commit's checkout: its warm cases side by side")
    a = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-ddp-"))
    home = work / "home"
    (work / "bench_ddp.py").write_text(SCRIPT)
    env = {**os.environ, "MONARCH_TORCHX_HOME": str(home), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    pool = f"bench-ddp-{os.getpid()}"
    watch: dict[str, str] = {"slurm -j 2x1 (stock)": "slurm-*-bench_ddp-*.out"}
    cases: dict[str, list[str]] = {
        "local_cwd -j 1x2 (stock)": ddp("local_cwd", f"log_dir={work / 'lcwd'}", "1x2"),
        "monarch_local -j 2x1 (warm)": ddp("monarch_local", f"pool={pool}", "2x1"),
        "monarch_local -j 1x2 (warm)": ddp("monarch_local", f"pool={pool}", "1x2"),
    }
    envs: dict[str, dict[str, str]] = {}
    if a.baseline:
        base_env = {**env, "MONARCH_TORCHX_HOME": str(work / "home-base"), "PYTHONPATH": str(a.baseline.resolve())}
        for j in ("2x1", "1x2"):
            name = f"monarch_local -j {j} (warm, baseline)"
            cases[name] = ddp("monarch_local", f"pool={pool}-b", j)
            envs[name] = base_env
    if a.slurm:
        if os.geteuid() != 0:
            raise SystemExit("--slurm needs root (it uses the project's SLURM lab)")
        lab = Path(__file__).resolve().parents[1] / "scripts" / "slurmlab"
        subprocess.run(["bash", str(lab / "start-cluster.sh")], check=True, capture_output=True)
        cases["slurm -j 2x1 (stock)"] = ddp("slurm", "partition=debug", "2x1")
        cases["monarch_slurm -j 2x1 (warm)"] = ddp("monarch_slurm", f"pool={pool}-s,nodes=2,partition=debug", "2x1")
    try:
        print("warming the pools ...", file=sys.stderr)
        for name, args in cases.items():
            if "warm" in name:
                timed_run(args, work, envs.get(name, env))  # creates the pool and warms it; not timed
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in cases}
        for i in range(a.n):
            for name, args in cases.items():
                times[name].append(timed_run(args, work, envs.get(name, env), watch=watch.get(name)))
            print(
                f"round {i + 1}/{a.n}: "
                + ", ".join(f"{k.split()[0]} {v[-1][0]:.2f}/{v[-1][1]:.2f}" for k, v in times.items()),
                file=sys.stderr,
            )
    finally:
        for p in (pool, f"{pool}-s"):
            subprocess.run([str(BIN / "torchx"), "pool", "stop", p], env=env, capture_output=True)
        if a.baseline:
            subprocess.run([str(BIN / "torchx"), "pool", "stop", f"{pool}-b"], env=base_env, capture_output=True)
    med = {k: (statistics.median(t for t, _ in v), statistics.median(d for _, d in v)) for k, v in times.items()}
    rows = [f"| {k} | {f:.3f} | {d:.3f} |" for k, (f, d) in med.items()]
    stock = med["local_cwd -j 1x2 (stock)"]
    ratios = []
    for k in ("monarch_local -j 2x1 (warm)", "monarch_local -j 1x2 (warm)"):
        ratios.append(
            f"- {k}: **{stock[0] / med[k][0]:.1f}x** faster to the first step, "
            f"**{stock[1] / med[k][1]:.1f}x** to completion than local_cwd -j 1x2"
        )
    if a.baseline:
        for j in ("2x1", "1x2"):
            t, b = med[f"monarch_local -j {j} (warm)"], med[f"monarch_local -j {j} (warm, baseline)"]
            ratios.append(
                f"- monarch_local -j {j}, this / baseline: {t[0] / b[0]:.2f}x first step, {t[1] / b[1]:.2f}x completion"
            )
    if a.slurm:
        s, w = med["slurm -j 2x1 (stock)"], med["monarch_slurm -j 2x1 (warm)"]
        ratios.append(
            f"- monarch_slurm -j 2x1: **{s[0] / w[0]:.1f}x** faster to the first step, "
            f"**{s[1] / w[1]:.1f}x** to completion than stock slurm -j 2x1"
        )
    body = (
        f"Median of {a.n} runs per case, all cases interleaved in one run; `torchx run --wait --log "
        f"... dist.ddp --script S` where S does init_process_group (gloo), one all_reduce, prints "
        f"`first-step`, 3 more all_reduces and a barrier.\n\n"
        "| case | first step (s) | completion (s) |\n|---|---:|---:|\n"
        + "\n".join(rows)
        + "\n\nRatios (same run):\n"
        + "\n".join(ratios)
        + "\n\nTargets: >= 5x to the first step, >= 3x to completion, on both engines."
        "\n\nFirst step: when the line reached `torchx run --log`'s output"
        + (
            ", except stock slurm: when it appeared in its `slurm-*.out` file (its CLI tails only "
            "stderr). The lab's 2 nodes are network namespaces of this one 2-core VM."
            if a.slurm
            else "."
        )
        + " Completion: when `torchx run --wait` returned (stock local_cwd and slurm poll status each second;"
        " our schedulers' wait returns when the agents report the end)."
    )
    print(body)
    make = "make bench-ddp-slurm" if a.slurm else "make bench-ddp"
    command = f"{make}  # .venv/bin/python benchmarks/warm_ddp.py" + (" --slurm" if a.slurm else "") + f" --n {a.n}"
    if a.baseline:
        command = f".venv/bin/python benchmarks/warm_ddp.py --baseline <worktree of the baseline commit> --n {a.n}"
    record("warm_ddp" + (" --slurm" if a.slurm else "") + (" --baseline" if a.baseline else ""), command, body)


if __name__ == "__main__":
    main()
