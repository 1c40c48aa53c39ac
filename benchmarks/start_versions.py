"""What one process start costs a host: an earlier commit's agents against this checkout's.

    git worktree add /tmp/mtx-base <commit> && make -C /tmp/mtx-base setup
    .venv/bin/python benchmarks/start_versions.py --baseline /tmp/mtx-base [--starts 100] [--rounds 3]

Each version gets a one-host ``monarch_local`` pool (``preload=none``) created by its own CLI, so
its agent and fork servers run its own code. A driver of the same version then starts
``--starts`` replicas one after the other and waits for each to end (the agent's ``wait``):

- ``exec``: ``echo hello``, a program that is not the agent's interpreter;
- ``python``: ``python -c pass`` with the agent's interpreter, which the fork server runs in a
  fork of itself.

Measured per start: wall time from the launch request to the agent's answer that it ended, and
the host's CPU: the agent's session (agent, fork servers, and the children they reaped), from
/proc. The versions alternate, ``--rounds`` times, so this machine's noise hits both; the table
gives the medians of the rounds. On a cluster every host pays this for every replica it starts,
and here, where all agents share 2 cores, a run on N hosts pays N of them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _results import record  # noqa: E402
from scale_versions import git_line  # noqa: E402

MODES = ("exec", "python")

DRIVER = textwrap.dedent('''
    import json, os, sys, time, uuid
    from monarch_torchx import apps
    from monarch_torchx.pool import attach
    from monarch_torchx.specs import LaunchSpec

    name, mode, starts = sys.argv[1], sys.argv[2], int(sys.argv[3])
    pool = attach(name)
    agent = pool.hosts[0].pid
    tick = os.sysconf("SC_CLK_TCK")

    def host_cpu():
        """CPU seconds of the agent's session: its processes and the children they reaped."""
        total = 0.0
        for p in os.listdir("/proc"):
            if not p.isdigit():
                continue
            try:
                fields = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[3]) == agent:
                total += sum(int(x) for x in fields[11:15]) / tick
        return total

    argv = ["echo", "hello"] if mode == "exec" else [sys.executable, "-c", "pass"]

    def start():
        aid = "s" + uuid.uuid4().hex[:10]
        spec = LaunchSpec(app_id=aid, role="r", replica_id=0, argv=argv, cwd="/tmp")
        apps.launch(pool, aid, "start", [{"name": "r", "num_replicas": 1}], [(0, spec)])
        done = pool.call(0, "wait", app_id=aid, within=60)
        assert done and done[0]["state"] == "SUCCEEDED", done

    start()  # the fork servers' first start is not measured
    c0, t0 = host_cpu(), time.monotonic()
    for _ in range(starts):
        start()
    print(json.dumps({"wall": (time.monotonic() - t0) / starts, "cpu": (host_cpu() - c0) / starts}))
''')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, required=True, help="a checkout of the earlier commit, with its .venv")
    ap.add_argument("--starts", type=int, default=100, help="starts per round, per mode")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    home, script, versions = driver_run("startv-", DRIVER, args.baseline)
    runs: dict[str, dict[str, list[dict]]] = {v: {m: [] for m in MODES} for v in versions}
    try:
        for v, root in versions.items():
            _cli(root, home, "pool", "create", f"startv-{v}", "-cfg", "hosts=1,preload=none")
        for r in range(args.rounds):
            for mode in MODES:
                for v, root in versions.items():
                    python = root / ".venv" / "bin" / "python"
                    res = subprocess.run(
                        [str(python), str(script), f"startv-{v}", mode, str(args.starts)],
                        env=_env(root, home),
                        cwd=root,
                        capture_output=True,
                        text=True,
                        timeout=900,
                    )
                    if res.returncode != 0:
                        raise SystemExit(f"{v} driver failed ({res.returncode}):\n{res.stderr[-3000:]}")
                    runs[v][mode].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    finally:
        for v, root in versions.items():
            _cli(root, home, "pool", "stop", "--force", f"startv-{v}", check=False)
        shutil.rmtree(home, ignore_errors=True)

    def med(v: str, mode: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[v][mode])

    rows = []
    for mode in MODES:
        for key, label in (("wall", "wall"), ("cpu", "host CPU")):
            b, t = med("baseline", mode, key), med("this", mode, key)
            rows.append(f"| {mode} | {label} | {b * 1000:.2f} ms | {t * 1000:.2f} ms | {t / b:.2f}x |")
    text = "\n".join(
        [
            f"One start on a one-host pool, launch to the agent's answer that it ended; median of {args.rounds} "
            f"alternating rounds of {args.starts} starts per version and mode. Baseline `{git_line(args.baseline)}`, "
            f"this `{git_line(HERE.parent)}`. exec: `echo hello`; python: `python -c pass` forked from the "
            "fork server.",
            "",
            "| start | per start | baseline | this | this / baseline |",
            "|---|---|---:|---:|---:|",
            *rows,
        ]
    )
    print(text)
    if not args.no_record:
        record("start-versions", ".venv/bin/python benchmarks/start_versions.py " + " ".join(sys.argv[1:]), text)


def driver_run(prefix: str, driver: str, baseline: Path) -> tuple[Path, Path, dict[str, Path]]:
    """A fresh home (the pools' registry) with the driver script in it, and each version's checkout."""
    home = Path(tempfile.mkdtemp(prefix=prefix))
    script = home / "driver.py"
    script.write_text(driver)
    return home, script, {"baseline": baseline.resolve(), "this": HERE.parent}


def _env(root: Path, home: Path) -> dict[str, str]:
    return dict(
        os.environ,
        MONARCH_TORCHX_HOME=str(home),
        PATH=f"{root / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
    )


def _cli(root: Path, home: Path, *argv: str, check: bool = True) -> None:
    res = subprocess.run(
        [str(root / ".venv" / "bin" / "torchx"), *argv],
        env=_env(root, home),
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if check and res.returncode != 0:
        raise SystemExit(f"torchx {' '.join(argv)} ({root}): {res.stderr.strip()[-2000:]}")


if __name__ == "__main__":
    main()
