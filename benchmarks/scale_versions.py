"""``benchmarks/scale.py`` at one pool size, an earlier commit against this checkout, side by side.

    git worktree add /tmp/mtx-base <commit> && make -C /tmp/mtx-base setup
    .venv/bin/python benchmarks/scale_versions.py --baseline /tmp/mtx-base [--hosts 128] [--rounds 1]

Each round runs this checkout's ``scale.py`` once with the baseline's interpreter (its venv: its
CLIs, agents, fork servers and procs are the baseline's code) and once with this checkout's,
alternating, so the machine's noise hits both. The table is the median wall time and client CPU
of each operation, and the ratio this / baseline. Written because this machine's speed moves from
day to day: a table from another day is no baseline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _results import record  # noqa: E402
from scale import OPS, _fmt  # noqa: E402


def run_once(python: Path, root: Path, hosts: int, skip: str = "") -> dict[str, dict[str, float]]:
    """``cwd=root``: the run's own files are the checkout's. (Agents start in their pool's state
    dir, never importing from the cwd, so each version's actor procs run the code of its own
    ``python``.)"""
    res = subprocess.run(
        [
            str(python),
            str(HERE / "scale.py"),
            "--sizes",
            str(hosts),
            "--no-record",
            *(["--skip", skip] if skip else []),
        ],
        capture_output=True,
        text=True,
        timeout=3000,
        cwd=root,
    )
    for line in reversed(res.stderr.splitlines()):
        if line.startswith("{"):
            return json.loads(line.replace("NaN", "null"))[str(hosts)]
    raise SystemExit(f"{python}: scale.py failed ({res.returncode}):\n{res.stderr[-3000:]}")


def git_line(root: Path) -> str:
    return subprocess.run(
        ["git", "-C", str(root), "log", "-1", "--format=%h %s"], capture_output=True, text=True
    ).stdout.strip()[:60]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, required=True, help="a checkout of the earlier commit, with its .venv")
    ap.add_argument("--hosts", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--skip", default="", help="passed to scale.py: steps to leave out (sync,actors,sql)")
    ap.add_argument("--section", default="scale-versions")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    base_py = args.baseline / ".venv" / "bin" / "python"
    runs: dict[str, list[dict[str, dict[str, float]]]] = {"baseline": [], "this": []}
    for _ in range(args.rounds):
        runs["baseline"].append(run_once(base_py, args.baseline, args.hosts, args.skip))
        runs["this"].append(run_once(Path(sys.executable), HERE.parent, args.hosts, args.skip))

    def med(which: str, op: str, key: str) -> float:
        vals = [r[op][key] for r in runs[which] if op in r and r[op][key] is not None]
        return statistics.median(vals) if vals else float("nan")

    lines = [
        f"One monarch_local pool of {args.hosts} agents (preload=none), median of {args.rounds} alternating "
        f"round(s); baseline `{git_line(args.baseline)}`, this `{git_line(HERE.parent)}`.",
        "",
        "| operation | wall, baseline | wall, this | this / baseline | client CPU, baseline | client CPU, this | "
        "agents' CPU, baseline | agents' CPU, this |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for op in [op for op in OPS if any(op in r for r in runs["this"])]:  # the steps that ran
        wb, wt = med("baseline", op, "wall"), med("this", op, "wall")
        ratio = f"{wt / wb:.2f}x" if wb == wb and wt == wt and wb > 0 else "-"
        lines.append(
            f"| {op} | {_fmt(wb, 's')} | {_fmt(wt, 's')} | {ratio} | "
            f"{_fmt(med('baseline', op, 'client_cpu'), 's')} | {_fmt(med('this', op, 'client_cpu'), 's')} | "
            f"{_fmt(med('baseline', op, 'agents_cpu'), 's')} | {_fmt(med('this', op, 'agents_cpu'), 's')} |"
        )
    text = "\n".join(lines)
    print(text)
    if not args.no_record:
        record(args.section, ".venv/bin/python benchmarks/scale_versions.py " + " ".join(sys.argv[1:]), text)


if __name__ == "__main__":
    main()
