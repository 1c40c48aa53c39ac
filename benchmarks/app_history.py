"""Issue 38's measured paths, side by side in one run:

    .venv/bin/python benchmarks/app_history.py [--n 5] [--no-record]

- ``torchx run --wait utils.sh sleep 0.5``: on a warm ``monarch_local`` pool (the wait returns
  when the agents report the end) against TorchX's own ``local_cwd`` (polls once a second);
- ``torchx status`` of a finished app, three ways: its pool's agents up (its recorded end is read,
  the agents are not asked), its pool idled out (the same files: before, this asked dead agents
  and said FAILED), and its pool stopped (before: "no app").

Cases are interleaved; medians of ``--n`` runs. The CLI's own start (imports) is in every number.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _results import record  # noqa: E402

BIN = Path(sys.executable).parent


def timed(argv: list[str], env: dict[str, str], cwd: str) -> float:
    t0 = time.monotonic()
    res = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])}... failed ({res.returncode}):\n{res.stderr[-2000:]}")
    return wall


def state_of(handle: str, env: dict[str, str], cwd: str) -> str:
    out = subprocess.run(
        [str(BIN / "torchx"), "status", handle], env=env, cwd=cwd, capture_output=True, text=True
    ).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.strip().startswith("State:")), "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="bench-history-")
    env = {
        **os.environ,
        "MONARCH_TORCHX_HOME": str(Path(work) / "home"),
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    tx = str(BIN / "torchx")
    times: dict[str, list[float]] = {
        k: [] for k in ("wait_local_cwd", "wait_monarch", "status_up", "status_idle", "status_stopped")
    }
    subprocess.run(
        [tx, "pool", "create", "bw", "-s", "monarch_local", "-cfg", "hosts=1,preload=none"],
        env=env,
        cwd=work,
        check=True,
        capture_output=True,
    )
    try:
        for _ in range(args.n):
            times["wait_local_cwd"].append(
                timed([tx, "run", "--wait", "-s", "local_cwd", "utils.sh", "sleep", "0.5"], env, work)
            )
            times["wait_monarch"].append(
                timed(
                    [tx, "run", "--wait", "-s", "monarch_local", "-cfg", "pool=bw", "utils.sh", "sleep", "0.5"],
                    env,
                    work,
                )
            )
        # finished apps: one per pool, on a pool that stays up, one that idles out, one that is stopped
        handles = {}
        for pool, idle in (("up", "30m"), ("idle", "2s"), ("stopped", "30m")):
            res = subprocess.run(
                [
                    tx,
                    "run",
                    "--wait",
                    "-s",
                    "monarch_local",
                    "-cfg",
                    f"pool={pool},hosts=1,preload=none,idle_timeout={idle}",
                    "utils.sh",
                    "true",
                ],
                env=env,
                cwd=work,
                check=True,
                capture_output=True,
                text=True,
            )
            handles[pool] = res.stdout.strip().splitlines()[-1]
        subprocess.run([BIN / "monarch-torchx", "pool", "stop", "stopped"], env=env, check=True, capture_output=True)
        deadline = time.time() + 60
        while (
            time.time() < deadline
            and "stopped"
            not in subprocess.run(
                [BIN / "monarch-torchx", "pool", "status", "idle"], env=env, capture_output=True, text=True
            ).stdout
        ):
            time.sleep(0.5)
        for pool in ("up", "idle", "stopped"):
            assert state_of(handles[pool], env, work) == "SUCCEEDED", pool
        for _ in range(args.n):
            for pool in ("up", "idle", "stopped"):
                times[f"status_{pool}"].append(timed([tx, "status", handles[pool]], env, work))
    finally:
        for pool in ("bw", "up", "idle"):
            subprocess.run([BIN / "monarch-torchx", "pool", "stop", pool], env=env, capture_output=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    body = (
        f"Median of {args.n} runs per case, interleaved, on this machine; every number includes the CLI's "
        "own start.\n\n"
        "| case | wall (s) |\n|---|---:|\n"
        f"| `torchx run --wait utils.sh sleep 0.5` on local_cwd (TorchX polls every 1 s) | "
        f"{med['wait_local_cwd']:.3f} |\n"
        f"| the same on a warm monarch_local pool (the agents report the end) | {med['wait_monarch']:.3f} |\n"
        f"| `torchx status` of a finished app, its pool up (recorded end, agents not asked) | "
        f"{med['status_up']:.3f} |\n"
        f"| the same, its pool idled out (was: FAILED, host lost) | {med['status_idle']:.3f} |\n"
        f"| the same, its pool stopped (was: no app) | {med['status_stopped']:.3f} |\n\n"
        f"Ratio (same run): `--wait` on monarch_local returns **{med['wait_local_cwd'] / med['wait_monarch']:.2f}x** "
        "sooner than on local_cwd for the same 0.5 s app.\n"
    )
    print(body)
    if not args.no_record:
        record("app-history", "make bench-history  # .venv/bin/python benchmarks/app_history.py --n 5", body)


if __name__ == "__main__":
    main()
