"""What a user's iterations cost a warm pool: a run, and the agents' CPU while nothing runs.

    .venv/bin/python benchmarks/warm_iterations.py --baseline CHECKOUT [--hosts 32] [--apps 60]
        [--idle-s 20] [--no-record]

A warm pool lives through many runs: the point of keeping it. For each version (an earlier
commit's checkout with its own ``.venv``, then this checkout), one ``monarch_local`` pool of
``--hosts`` agents (``preload=none``) is created with that version's CLI (so its agents are that
version's code), and ``--apps`` times ``torchx run utils.echo --num_replicas HOSTS`` runs on it,
the way a user iterates. Reported per version:

- a run's wall time, the client's own CPU, and the agents' CPU per host (medians of the last
  ten runs, when the pool holds ``--apps`` ended apps), from ``scale.Meter``;
- the agents' CPU per host per second while the pool is idle with that history, over
  ``--idle-s`` seconds (heartbeats and background work; what a pool of N hosts burns between
  iterations).

The versions run one after the other on this machine; the ratio row is this / baseline.
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
from scale import BIN, Meter, _agent_sessions, _session_cpu  # noqa: E402
from scale_versions import git_line  # noqa: E402


def measure(bin_dir: Path, hosts: int, apps: int, idle_s: float) -> dict[str, float]:
    home = Path(tempfile.mkdtemp(prefix="warm-iter-"))
    env = dict(os.environ, MONARCH_TORCHX_HOME=str(home), PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    tx = [str(bin_dir / "torchx")]
    m = Meter(home)
    runs: list[dict[str, float]] = []
    try:
        m.run(tx + ["pool", "create", "warmiter", "-s", "monarch_local", "-cfg", f"hosts={hosts},preload=none"], env)
        for k in range(apps):
            runs.append(
                m.run(
                    tx
                    + [
                        "run",
                        "-s",
                        "monarch_local",
                        "-cfg",
                        "pool=warmiter",
                        "utils.echo",
                        "--num_replicas",
                        str(hosts),
                        "--msg",
                        f"iteration {k}",
                    ],
                    env,
                )[0]
            )
            print(f"{bin_dir.parent.parent.name}: run {k + 1}/{apps}", file=sys.stderr, end="\r")
        print(file=sys.stderr)
        time.sleep(2)  # the last app's replicas have ended and been reaped
        sessions = _agent_sessions(home)
        c0 = _session_cpu(sessions)
        time.sleep(idle_s)
        idle = (_session_cpu(sessions) - c0) / idle_s / hosts
        m.run(tx + ["pool", "stop", "warmiter"], env)
    finally:
        subprocess.run(tx + ["pool", "stop", "--force", "warmiter"], env=env, capture_output=True)
    last = runs[-10:]
    return {
        "wall": statistics.median(r["wall"] for r in last),
        "client_cpu": statistics.median(r["client_cpu"] for r in last),
        "agents_cpu": statistics.median(r["agents_cpu"] for r in last) / hosts,
        "idle": idle,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, required=True, help="an earlier commit's checkout, with its .venv")
    ap.add_argument("--hosts", type=int, default=32)
    ap.add_argument("--apps", type=int, default=60, help="runs before the measured state (the pool's history)")
    ap.add_argument("--idle-s", type=float, default=20.0)
    ap.add_argument("--section", default="warm-iterations")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    base_bin = args.baseline.resolve() / ".venv" / "bin"
    if not (base_bin / "torchx").exists():
        raise SystemExit(f"{base_bin / 'torchx'} not found: run `make setup` in {args.baseline} first")
    res = {
        "baseline": measure(base_bin, args.hosts, args.apps, args.idle_s),
        "this": measure(BIN, args.hosts, args.apps, args.idle_s),
    }
    b, t = res["baseline"], res["this"]
    lines = [
        f"One `monarch_local` pool of {args.hosts} hosts (`preload=none`) per version, {args.apps} runs of "
        f"`torchx run utils.echo --num_replicas {args.hosts}` on it; a run: medians of the last 10.",
        "",
        "| | run: wall | run: client CPU | run: agents' CPU per host | idle: agents' CPU per host per second |",
        "|---|---:|---:|---:|---:|",
        f"| baseline (`{git_line(args.baseline)}`) | {b['wall']:.2f} s | {b['client_cpu']:.2f} s | "
        f"{b['agents_cpu'] * 1e3:.1f} ms | {b['idle'] * 1e3:.2f} ms |",
        f"| this (`{git_line(HERE.parent)}`) | {t['wall']:.2f} s | {t['client_cpu']:.2f} s | "
        f"{t['agents_cpu'] * 1e3:.1f} ms | {t['idle'] * 1e3:.2f} ms |",
        f"| this / baseline | {t['wall'] / b['wall']:.2f}x | {t['client_cpu'] / b['client_cpu']:.2f}x | "
        f"{t['agents_cpu'] / b['agents_cpu']:.2f}x | {t['idle'] / b['idle']:.2f}x |",
    ]
    body = "\n".join(lines)
    print(body)
    if not args.no_record:
        record(args.section, ".venv/bin/python benchmarks/warm_iterations.py " + " ".join(sys.argv[1:]), body)


if __name__ == "__main__":
    main()
