"""Our actor mesh against an earlier commit of itself, side by side in one run.

    git worktree add /tmp/mtx-base <commit>
    .venv/bin/python benchmarks/actors_versions.py --baseline /tmp/mtx-base [--calls 2000] [--rounds 2]

Each round runs ``benchmarks/actors.py``'s measurements (``run_ours``: rtt, call to 8 procs, 64 MiB
tensor, spawn of 8 torch procs, on a fresh warm 1-host pool) once with the baseline's code and
once with this checkout's, alternating (and which goes first, round by round), so machine noise
hits both; the table is the median of the rounds and the ratio this / baseline. Written to answer
"did a change cost speed?" (first: sync endpoints moved off the proc's event loop onto each
actor's thread, as Monarch runs them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _results import record  # noqa: E402

METRICS = [
    ("rtt_ms", "rtt (ms)", 3),
    ("rtt_async_ms", "rtt, async endpoint (ms)", 3),
    ("call8_ms", "call 8 procs (ms)", 3),
    ("tensor_gbps", "64 MiB tensor (GB/s)", 2),
    ("spawn8_s", "spawn 8 torch procs (s)", 2),
]


def run_once(code_root: Path, calls: int) -> dict[str, float]:
    """One measurement with the code under ``code_root`` (its agents and procs import it too),
    measured by this checkout's ``actors.py`` (so both sides are measured alike)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(code_root), str(HERE)]))
    prog = (
        f"import sys, json; sys.path[:0] = [{str(code_root)!r}, {str(HERE)!r}]; "
        f"import actors; print(json.dumps(actors.run_ours({calls})))"
    )
    res = subprocess.run(
        [sys.executable, "-c", prog], capture_output=True, text=True, timeout=900, env=env, cwd=code_root
    )
    try:
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise SystemExit(f"the run with {code_root} failed:\n{res.stderr[-3000:]}")  # noqa: B904


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, required=True, help="a checkout (git worktree) of the earlier commit")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-record", action="store_true", help="do not write benchmarks/RESULTS.md")
    ap.add_argument(
        "--section", default="actors-versions", help="the RESULTS.md section to write (one per baseline kept)"
    )
    args = ap.parse_args()
    if not (args.baseline / "benchmarks" / "actors.py").exists():
        raise SystemExit(f"error: {args.baseline} is not a checkout of this project (no benchmarks/actors.py)")
    this = HERE.parent
    runs: dict[str, list[dict[str, float]]] = {"baseline": [], "this": []}
    for i in range(args.rounds):
        order = (("baseline", args.baseline), ("this", this))
        for name, root in order if i % 2 == 0 else order[::-1]:  # who goes first alternates, too
            print(f"round {i + 1}/{args.rounds}: {name} ...", file=sys.stderr, flush=True)
            runs[name].append(run_once(root, args.calls))

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    base_rev = subprocess.run(
        ["git", "-C", str(args.baseline), "log", "--oneline", "-1"], capture_output=True, text=True
    ).stdout.strip()[:60]
    this_rev = subprocess.run(
        ["git", "-C", str(this), "log", "--oneline", "-1"], capture_output=True, text=True
    ).stdout.strip()[:60]
    rows = ["| | " + " | ".join(label for _, label, _ in METRICS) + " |", "|---" * (len(METRICS) + 1) + "|"]
    for name, rev in (("baseline", base_rev), ("this", this_rev)):
        rows.append(f"| {name} (`{rev}`) | " + " | ".join(f"{med(name, k):.{d}f}" for k, _, d in METRICS) + " |")
    rows.append(
        "| this / baseline | " + " | ".join(f"{med('this', k) / med('baseline', k):.2f}x" for k, _, _ in METRICS) + " |"
    )
    body = "\n".join(rows) + f"\n\nMedian of {args.rounds} alternating rounds, {args.calls} calls each for rtt."
    print(body)
    if not args.no_record:
        section = "" if args.section == "actors-versions" else f" --section {args.section}"
        record(
            args.section,
            f".venv/bin/python benchmarks/actors_versions.py --baseline <worktree of "
            f"{base_rev.split()[0]}> --calls {args.calls} --rounds {args.rounds}{section}",
            body,
        )


if __name__ == "__main__":
    main()
