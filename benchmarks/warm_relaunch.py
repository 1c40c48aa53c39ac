"""Warm relaunch: `torchx run` on stock local_cwd vs monarch_local (cold pool, warm pool).

    .venv/bin/python benchmarks/warm_relaunch.py [--n 10]

For each case, side by side in one run, median of N runs:
  first line  time from invoking `torchx run` to the first line of the app's output
  completion  time from invoking `torchx run` to the app's last output line ("done")
  cli         how long `torchx run` held the shell (local_cwd blocks until the app ends)
Workloads: utils.echo, and utils.python running a script that imports torch first.

Line arrival times: for local_cwd, when the line shows up in its stdout log file (polled every
2 ms; its CLI often drops a short app's output); for monarch_local, when it reached the agent
(stored per line in the replica's log file). Both
are wall-clock on this one machine. Also measured: the scheduler's own share of a warm run, i.e.
`Runner.run()` in-process (no CLI import), median of 3N.
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
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).parent))
from _results import record  # noqa: E402

BIN = Path(sys.executable).parent
TORCH_SCRIPT = """\
import torch
print("ready", torch.__version__, flush=True)
torch.ones(1000).sum()
print("done", flush=True)
"""


def _env(home: Path) -> Dict[str, str]:
    return {**os.environ, "MONARCH_TORCHX_HOME": str(home), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}


def workload(kind: str, tag: str) -> List[str]:
    if kind == "echo":
        return ["utils.echo", "--msg", f"done {tag}"]
    return ["utils.python", "--script", "bench_torch.py"]


def run_local_cwd(kind: str, cwd: Path, home: Path, tag: str) -> Tuple[float, float, float]:
    """Watches local_cwd's stdout log file: its CLI often drops the output of short apps."""
    log_dir = Path(tempfile.mkdtemp(prefix="bench-lcwd-"))
    t0 = time.time()
    p = subprocess.Popen([str(BIN / "torchx"), "run", "-s", "local_cwd", "-cfg", f"log_dir={log_dir}",
                          *workload(kind, tag)], cwd=cwd, env=_env(home), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    first = done = None
    while done is None:
        now = time.time() - t0
        for f in log_dir.glob("*/*/*/0/stdout.log"):
            text = f.read_text()
            if text and first is None:
                first = now
            if any(line.startswith("done") for line in text.splitlines()):
                done = now
        if done is None and p.poll() is not None and now > 0 and not list(log_dir.glob("*/*/*/0/stdout.log")):
            raise SystemExit(f"local_cwd {kind}: no output file (exit {p.returncode})")
        if done is None and p.poll() is not None and time.time() - t0 > 60:
            raise SystemExit(f"local_cwd {kind}: no 'done' line")
        time.sleep(0.002)
    p.wait()
    cli = time.time() - t0
    assert first is not None
    return first, done, cli


def _agent_lines(home: Path, handle: str, timeout: float = 120) -> List[Tuple[float, str]]:
    from monarch_torchx.registry import Registry

    pool, app = handle.rsplit("/", 1)[1].split(":", 1)
    rec = Registry(home).get(pool)
    assert rec is not None
    arec = Registry.get_app(rec, app)
    assert arec is not None
    p = arec.placement[0]
    path = rec.path / "logs" / f"host{p.host_index}" / app / p.role / str(p.replica_id) / "stdout.log"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists():
            lines = [(float(ts), text) for ts, _, text in
                     (raw.partition(" ") for raw in path.read_text().splitlines())]
            if any(t.startswith("done") for _, t in lines):
                return lines
        time.sleep(0.005)
    raise SystemExit(f"no 'done' line from {handle} within {timeout:.0f} s")


def run_monarch(kind: str, cwd: Path, home: Path, pool: str, tag: str, create: Optional[str] = None) -> Tuple[float, float, float]:
    cfg = f"pool={pool}" + (f",{create}" if create else "")
    t0 = time.time()
    res = subprocess.run([str(BIN / "torchx"), "run", "-s", "monarch_local", "-cfg", cfg, *workload(kind, tag)],
                         cwd=cwd, env=_env(home), capture_output=True, text=True)
    cli = time.time() - t0
    if res.returncode != 0:
        raise SystemExit(f"monarch_local run failed: {res.stderr.strip()}")
    lines = _agent_lines(home, res.stdout.strip().splitlines()[-1])
    first = lines[0][0] - t0
    done = next(ts for ts, t in lines if t.startswith("done")) - t0
    return first, done, cli


def stop(home: Path, pool: str) -> None:
    subprocess.run([str(BIN / "monarch-torchx"), "pool", "stop", pool], env=_env(home), capture_output=True)


def scheduler_share(home: Path, cwd: Path, pool: str, n: int) -> Tuple[float, float]:
    """In-process Runner.run on a warm pool: dryrun+schedule, no CLI import. Returns (median, p90)."""
    os.environ["MONARCH_TORCHX_HOME"] = str(home)
    os.chdir(cwd)
    from torchx.runner import get_runner
    from torchx.specs import AppDef, Role

    app = AppDef("share", roles=[Role(name="r", image=".", entrypoint="true")])
    times = []
    with get_runner() as runner:
        for _ in range(n):
            t0 = time.perf_counter()
            runner.run(app, "monarch_local", {"pool": pool})
            times.append(time.perf_counter() - t0)
    times.sort()
    return statistics.median(times), times[int(0.9 * (len(times) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=10, help="runs per case (median reported)")
    ap.add_argument("--no-record", action="store_true", help="print only; do not update RESULTS.md")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="bench-home-"))
    cwd = Path(tempfile.mkdtemp(prefix="bench-cwd-"))
    (cwd / "bench_torch.py").write_text(TORCH_SCRIPT)
    results: Dict[Tuple[str, str], List[Tuple[float, float, float]]] = {}
    warm_pool = "bench-warm"
    try:
        # the warm pool: created once, torch preloaded, then reused by every warm run
        run_monarch("echo", cwd, home, warm_pool, "init", create="hosts=1")
        from monarch_torchx.pool import attach

        os.environ["MONARCH_TORCHX_HOME"] = str(home)
        pool = attach(warm_pool)
        deadline = time.time() + 120
        while not pool.call(0, "info")["warm"]["ready"] and time.time() < deadline:
            time.sleep(0.1)
        for i in range(args.n):
            for kind in ("echo", "torch"):
                tag = f"{kind}{i}"
                print(f"run {i + 1}/{args.n} {kind}", file=sys.stderr, flush=True)
                results.setdefault(("local_cwd", kind), []).append(run_local_cwd(kind, cwd, home, tag))
                cold = f"bench-cold-{kind}-{i}"
                results.setdefault(("monarch_local cold", kind), []).append(
                    run_monarch(kind, cwd, home, cold, tag, create="hosts=1"))
                stop(home, cold)
                results.setdefault(("monarch_local warm", kind), []).append(run_monarch(kind, cwd, home, warm_pool, tag))
        share_med, share_p90 = scheduler_share(home, cwd, warm_pool, 3 * args.n)
    finally:
        from monarch_torchx.registry import Registry

        for rec in Registry(home).list():
            stop(home, rec.name)

    med = {k: tuple(statistics.median(x[j] for x in v) for j in range(3)) for k, v in results.items()}
    rows = ["| workload | scheduler | first line (s) | completion (s) | `torchx run` held the shell (s) |",
            "|---|---|---:|---:|---:|"]
    for kind in ("echo", "torch"):
        for sched in ("local_cwd", "monarch_local cold", "monarch_local warm"):
            f, d, c = med[(sched, kind)]
            rows.append(f"| {'utils.echo' if kind == 'echo' else 'utils.python (imports torch)'} | {sched} | {f:.3f} | {d:.3f} | {c:.3f} |")
    ratios = []
    for kind in ("echo", "torch"):
        base, warm = med[("local_cwd", kind)], med[("monarch_local warm", kind)]
        ratios.append(f"- {kind}: warm monarch_local is **{base[0] / warm[0]:.1f}x** faster to the first line and "
                      f"**{base[1] / warm[1]:.1f}x** faster to completion than local_cwd")
    torch_ratio = med[("local_cwd", "torch")][1] / med[("monarch_local warm", "torch")][1]
    body = "\n".join([
        f"Median of {args.n} runs per case, all cases interleaved in one run.", "", *rows, "",
        "Ratios (same run):", *ratios,
        f"- scheduler's own share of a warm run (`Runner.run()` in-process: dryrun + pool check + launch, "
        f"no CLI import): median **{share_med * 1000:.1f} ms**, p90 {share_p90 * 1000:.1f} ms over {3 * args.n} runs",
        "", f"Targets: warm >= 3x local_cwd on the torch script ({'met' if torch_ratio >= 3 else 'NOT met'}: "
            f"{torch_ratio:.1f}x to completion); scheduler share < 100 ms "
            f"({'met' if share_med < 0.1 else 'NOT met'}).",
        "", "First-line times for monarch_local are when the line reached the agent (the stored per-line "
            "timestamp); for local_cwd, when it appeared in its log file (polled every 2 ms). `torchx run` on "
            "monarch_local returns after submitting; local_cwd blocks until the app ends.",
    ])
    print(body)
    if not args.no_record:
        record("warm_relaunch", "make bench  # .venv/bin/python benchmarks/warm_relaunch.py --n "
               f"{args.n}", body)


if __name__ == "__main__":
    main()
