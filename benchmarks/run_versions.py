"""`torchx run` on one warm pool: this checkout's client against an earlier commit's, alternating.

    git worktree add /tmp/mtx-base <commit> && make -C /tmp/mtx-base setup
    .venv/bin/python benchmarks/run_versions.py --baseline /tmp/mtx-base [--hosts 256] [--runs 10]

For a change on the client's side only (how a run reuses its pool, what the CLI computes): both
clients drive the same pool, whose agents are this checkout's, so the hosts' side is identical
and the pair differs only in the client. (A change to the agents needs ``scale_versions.py``,
which gives each version its own pool.) Each pair runs ``torchx run utils.echo`` with one
replica per host, then ``torchx status`` of it, with each client in turn; the table is the median
wall time, the client's CPU and the agents' CPU of each, and the ratio this / baseline.
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
from scale import BIN, MemoryGuard, Meter  # noqa: E402
from scale_versions import git_line  # noqa: E402

OPS = ("run", "status")
KEYS = (("wall", "wall"), ("client_cpu", "client CPU"), ("agents_cpu", "agents' CPU"))


def one_pair(m: Meter, torchx: Path, pool: str, n: int, env: dict[str, str]) -> dict[str, dict[str, float]]:
    run, stdout = m.run(
        [
            str(torchx),
            "run",
            "-s",
            "monarch_local",
            "-cfg",
            f"pool={pool}",
            "utils.echo",
            "--msg",
            "hi",
            "--num_replicas",
            str(n),
        ],
        env,
    )
    handle = stdout.strip().splitlines()[-1]
    deadline = time.monotonic() + 120
    while (
        "SUCCEEDED"
        not in subprocess.run([str(torchx), "status", handle], env=env, capture_output=True, text=True).stdout
    ):
        if time.monotonic() > deadline:
            raise SystemExit(f"{handle} did not succeed in 120 s")
        time.sleep(0.5)
    status, _ = m.run([str(torchx), "status", handle], env)
    time.sleep(1.0)  # the replicas' exits and log indexing settle before the next client runs
    return {"run": run, "status": status}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, required=True, help="a checkout of the earlier commit, with its .venv")
    ap.add_argument("--hosts", type=int, default=256)
    ap.add_argument("--runs", type=int, default=10, help="runs of each client, alternating")
    ap.add_argument("--section", default="run-versions")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    clients = {"baseline": args.baseline / ".venv" / "bin" / "torchx", "this": BIN / "torchx"}
    for who, path in clients.items():
        if not path.exists():
            raise SystemExit(f"no {who} client at {path}: run `make setup` there first")
    home = Path(tempfile.mkdtemp(prefix="runversions-"))
    env = dict(os.environ, MONARCH_TORCHX_HOME=str(home), PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    pool, m = "runs", Meter(home)
    got: dict[str, list[dict[str, dict[str, float]]]] = {"baseline": [], "this": []}
    with MemoryGuard(home):
        try:
            print(f"creating a pool of {args.hosts} hosts", file=sys.stderr, flush=True)
            m.run([str(clients["this"]), "pool", "create", pool, "-cfg", f"hosts={args.hosts},preload=none"], env)
            one_pair(m, clients["this"], pool, args.hosts, env)  # warms both the agents and the file cache
            for k in range(args.runs):
                for who in ("baseline", "this") if k % 2 == 0 else ("this", "baseline"):
                    got[who].append(one_pair(m, clients[who], pool, args.hosts, env))
                print(
                    f"pair {k + 1}/{args.runs}: run {got['baseline'][-1]['run']['wall']:.2f} s (baseline) "
                    f"{got['this'][-1]['run']['wall']:.2f} s (this)",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            subprocess.run([str(clients["this"]), "pool", "stop", "--force", pool], env=env, capture_output=True)
    lines = [
        f"{args.hosts} hosts, {args.runs} runs of each client, alternating, on one pool (its agents: this "
        f"checkout's); medians.",
        "",
        f"- baseline: `{git_line(args.baseline)}`",
        f"- this: `{git_line(HERE.parent)}`",
        "",
        "| operation | measure | baseline | this | this / baseline |",
        "|---|---|---:|---:|---:|",
    ]
    for op in OPS:
        for key, title in KEYS:
            b = statistics.median(r[op][key] for r in got["baseline"])
            t = statistics.median(r[op][key] for r in got["this"])
            lines.append(
                f"| {op} | {title} | {b:.3f} s | {t:.3f} s | {t / b:.2f}x |"
                if b
                else f"| {op} | {title} | {b:.3f} s | {t:.3f} s | |"
            )
    body = "\n".join(lines)
    print(body)
    if not args.no_record:
        record(
            args.section,
            f"python benchmarks/run_versions.py --baseline {args.baseline} --hosts {args.hosts} --runs {args.runs}",
            body,
        )


if __name__ == "__main__":
    main()
