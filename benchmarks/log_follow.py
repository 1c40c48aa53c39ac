"""``torchx log --tail`` of N replicas: through the relay tree against TorchX's own follow, side by side.

    .venv/bin/python benchmarks/log_follow.py [--sizes 32,128] [--rounds 3] [--lines 20] [--no-record]

One ``monarch_local`` pool of N agents (``preload=none``) per size runs one ``utils.python``
replica per host that prints ``--lines`` lines, and, once it has ended, its logs are followed
(``--tail``: a follow of ended replicas prints everything and returns) two ways, alternating:

- **tree**: our ``torchx log --tail`` (one ``app_logs_follow`` stream per group of the tree);
- **per replica**: TorchX's own follow, ``torchx.cli.cmd_log.get_logs(..., should_tail=True)``
  on the same scheduler, which opens one thread and one ``log_iter`` stream per replica (what
  ``torchx log --tail`` did before).

Each is measured for wall time, the time until its first line was printed, and the client's own
CPU (``getrusage(CHILDREN)``); every run must print every line. Here all agents share this
machine's 2 cores, so the wall time at large N is mostly the agents' work; the client's CPU is
what grows on a real cluster.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
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
PER_REPLICA = (
    "import sys\nfrom torchx.cli.cmd_log import get_logs\nfrom torchx.runner import get_runner\n"
    "with get_runner() as r:\n    get_logs(sys.stdout, sys.argv[1], None, True, runner=r)\n"
)


def timed(argv: list[str], env: dict[str, str]) -> dict[str, float]:
    """Wall time, time to the first line on stdout, client CPU and the lines printed."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    first = p.stdout.readline()
    t_first = time.monotonic() - t0
    rest = p.stdout.read()
    err = p.stderr.read() if p.stderr else ""
    code = p.wait()
    wall = time.monotonic() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0:
        raise SystemExit(f"{' '.join(argv[:3])}... failed ({code}):\n{err[-2000:]}")
    return {
        "wall": wall,
        "first": t_first,
        "cpu": (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime),
        "lines": float(len((first + rest).splitlines())),
    }


def measure(n: int, rounds: int, lines: int) -> dict[str, dict[str, float]]:
    home = Path(tempfile.mkdtemp(prefix=f"logfollow{n}-"))
    env = dict(os.environ, MONARCH_TORCHX_HOME=str(home), PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    tx = [str(BIN / "torchx")]
    pool = f"follow{n}"
    try:
        subprocess.run(
            tx + ["pool", "create", pool, "-cfg", f"hosts={n},preload=none"], env=env, check=True, capture_output=True
        )
        run = subprocess.run(
            tx
            + [
                "run",
                "-s",
                "monarch_local",
                "-cfg",
                f"pool={pool}",
                "utils.python",
                "--num_replicas",
                str(n),
                "-c",
                f"for i in range({lines}): print('line', i)",
            ],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
        handle = run.stdout.strip().splitlines()[-1]
        deadline = time.time() + 600
        while (
            "SUCCEEDED" not in subprocess.run(tx + ["status", handle], env=env, capture_output=True, text=True).stdout
        ):
            if time.time() > deadline:
                raise SystemExit(f"the app on {n} hosts did not finish")
            time.sleep(0.5)
        ways = {"tree": tx + ["log", "--tail", handle], "per replica": [sys.executable, "-c", PER_REPLICA, handle]}
        runs: dict[str, list[dict[str, float]]] = {w: [] for w in ways}
        for _ in range(rounds):
            for way, argv in ways.items():
                m = timed(argv, env)
                if m["lines"] != n * lines:
                    raise SystemExit(f"{way} printed {m['lines']:.0f} of {n * lines} lines")
                runs[way].append(m)
        return {w: {k: statistics.median(r[k] for r in rs) for k in ("wall", "first", "cpu")} for w, rs in runs.items()}
    finally:
        subprocess.run(tx + ["pool", "stop", "--force", pool], env=env, capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


def _ms(v: float) -> str:
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="32,128", help="pool sizes, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lines", type=int, default=20, help="lines each replica prints")
    ap.add_argument("--no-record", action="store_true", help="do not write benchmarks/RESULTS.md")
    args = ap.parse_args()
    rows = []
    for n in (int(s) for s in args.sizes.split(",") if s):
        print(f"{n} hosts ...", file=sys.stderr, flush=True)
        r = measure(n, args.rounds, args.lines)
        t, p = r["tree"], r["per replica"]
        rows.append(
            f"| {n} | {_ms(t['wall'])} | {_ms(p['wall'])} | {t['wall'] / p['wall']:.2f}x | {_ms(t['first'])} | "
            f"{_ms(p['first'])} | {_ms(t['cpu'])} | {_ms(p['cpu'])} | {t['cpu'] / p['cpu']:.2f}x |"
        )
    text = "\n".join(
        [
            f"`torchx log --tail` of one ended replica per host, {args.lines} lines each; median of {args.rounds} "
            "alternating rounds. tree: ours, one stream per group of the relay tree; per replica: TorchX's own "
            "follow (`get_logs`, a thread and a stream per replica) on the same scheduler.",
            "",
            "| hosts | wall, tree | wall, per replica | tree / per replica | first line, tree | first line, "
            "per replica "
            "| client CPU, tree | client CPU, per replica | tree / per replica |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
        ]
    )
    print(text)
    if not args.no_record:
        record("log-follow", ".venv/bin/python benchmarks/log_follow.py " + " ".join(sys.argv[1:]), text)


if __name__ == "__main__":
    main()
