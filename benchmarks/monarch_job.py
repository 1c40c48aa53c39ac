"""Real Monarch's ping-pong on a warm pool: the first run of the program, and the runs after it.

    .venv/bin/python benchmarks/monarch_job.py [--n 3]           # monarch_local, 2 hosts
    .venv/bin/python benchmarks/monarch_job.py --slurm [--n 3]   # also 2 SLURM lab nodes (root)

Each case runs examples/monarch_pingpong.py (Monarch's ping-pong; only its job object is ours)
as a new process, as a user does, and times the whole process (Python and Monarch's import
included) and the program's own time from making the job to the last answer:
  cold   no pool: the job creates it (agents, or an sbatch allocation), starts Monarch's workers,
         attaches, spawns the actors and plays
  fresh  the pool is warm but the program's job cache is gone: new workers on the warm pool
  warm   the next run: Monarch's cache says the job can run, so it only attaches
Cases are interleaved; medians of N. Needs torchmonarch (pip install -e '.[monarch]').
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _results import record  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PINGPONG = ROOT / "examples" / "monarch_pingpong.py"


def run_once(cwd: Path, env: dict[str, str], *args: str) -> tuple[float, float]:
    """(the process's wall time, the program's "ready and answered" time), in seconds."""
    t0 = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-u", str(PINGPONG), "--trust-local-users", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"monarch_pingpong failed:\n{res.stdout}\n{res.stderr[-3000:]}")
    m = re.search(r"ready and answered in ([\d.]+) s", res.stdout)
    return wall, float(m.group(1)) if m else float("nan")


def bench(scheduler: str, cfg: str, n: int, env: dict[str, str], work: Path) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {"cold": [], "fresh": [], "warm": []}
    for i in range(n):  # noqa: B007
        pool = f"bm{uuid.uuid4().hex[:6]}"
        cwd = work / pool
        cwd.mkdir()
        args = ["--scheduler", scheduler, "--pool", pool, "--cfg", cfg]
        out["cold"].append(run_once(cwd, env, *args))
        out["warm"].append(run_once(cwd, env, *args))
        shutil.rmtree(cwd / ".monarch")  # the cache is gone: the next job starts new workers on the warm pool
        out["fresh"].append(run_once(cwd, env, *args))
        out["warm"].append(run_once(cwd, env, *args))
        subprocess.run(
            [str(Path(sys.executable).with_name("monarch-torchx")), "pool", "stop", pool],
            env=env,
            capture_output=True,
            timeout=120,
        )
    return out


def table(name: str, results: dict[str, list[tuple[float, float]]]) -> list[str]:
    med = {k: (statistics.median(w for w, _ in v), statistics.median(p for _, p in v)) for k, v in results.items()}
    lines = [
        f"**{name}** (medians; cold and fresh of N, warm of 2N)",
        "",
        "| run | process wall | program (job to last answer) | vs warm (program) |",
        "|---|---:|---:|---:|",
    ]
    for k in ("cold", "fresh", "warm"):
        wall, prog = med[k]
        lines.append(f"| {k} | {wall:.2f} s | {prog:.2f} s | {prog / med['warm'][1]:.1f}x |")
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=3)
    ap.add_argument("--slurm", action="store_true", help="also on 2 SLURM lab nodes (starts the lab if needed)")
    ap.add_argument("--no-record", action="store_true", help="do not write benchmarks/RESULTS.md")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-monarch-") as tmp:
        home = Path(tmp) / "home"
        env = dict(os.environ, MONARCH_TORCHX_HOME=str(home))
        lines = []
        lines += table("monarch_local, 2 hosts", bench("monarch_local", "preload=none", a.n, env, Path(tmp)))
        if a.slurm:
            subprocess.run(
                ["bash", str(ROOT / "scripts" / "slurmlab" / "start-cluster.sh")],
                check=True,
                capture_output=True,
                timeout=600,
            )
            lines += table(
                "monarch_slurm, 2 lab nodes",
                bench("monarch_slurm", "partition=debug,time=00:20:00,preload=none", a.n, env, Path(tmp)),
            )
    body = "\n".join(lines)
    print(body)
    if not a.no_record:
        cmd = "python benchmarks/monarch_job.py" + (" --slurm" if a.slurm else "") + f" --n {a.n}"
        record("monarch-job", cmd, body)


if __name__ == "__main__":
    main()
