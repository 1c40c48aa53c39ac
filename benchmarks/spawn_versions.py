"""The controller's cost of ``spawn_procs`` on N hosts: an earlier commit against this checkout.

    git worktree add /tmp/mtx-base <commit> && make -C /tmp/mtx-base setup
    .venv/bin/python benchmarks/spawn_versions.py --baseline /tmp/mtx-base [--hosts 64] [--rounds 5]

One warm ``monarch_local`` pool of N agents (``preload=none``, this checkout's agents). A
controller of each version in turn (the baseline's interpreter and code, then this one's,
alternating, so the machine's noise hits both) spawns one proc per host, one actor on each,
calls every actor once and stops the procs, ``--rounds`` times; the first spawn of the run warms
the hosts' actors fork servers and is left out. Reported: the median wall time and controller
CPU (user + system of the controller process) of a spawn, and the controller's open sockets to
the procs while they run. Only the controller's side differs between the two runs.
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

BIN = Path(sys.executable).parent

CONTROLLER = textwrap.dedent("""
    import json, os, resource, sys, time
    from pathlib import Path
    from monarch_torchx import Actor, attach, endpoint

    class Echo(Actor):
        @endpoint
        def ping(self, x):
            return x

    def cpu():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    def sockets():
        n = 0
        for fd in Path("/proc/self/fd").iterdir():
            try:
                n += os.readlink(fd).startswith("socket:")
            except OSError:
                pass
        return n

    hosts = attach(sys.argv[1])
    out = []
    base = sockets()
    for _ in range(int(sys.argv[2])):
        c0, t0 = cpu(), time.monotonic()
        procs = hosts.spawn_procs(per_host={"procs": 1})
        procs.spawn("echo", Echo).ping.call(1).get(timeout=300)
        out.append({"wall": time.monotonic() - t0, "cpu": cpu() - c0, "sockets": sockets() - base})
        procs.stop().get(timeout=120)
    print(json.dumps(out))
""")


def run_controller(python: Path, root: Path, pool: str, rounds: int, env: dict[str, str], script: Path) -> list[dict]:
    """``cwd=root``: the controller imports that checkout's code (its venv's editable install)."""
    res = subprocess.run(
        [str(python), str(script), pool, str(rounds)], env=env, cwd=root, capture_output=True, text=True, timeout=1800
    )
    if res.returncode != 0:
        raise SystemExit(f"{python}: controller failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, required=True, help="a checkout of the earlier commit, with its .venv")
    ap.add_argument("--hosts", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5, help="spawns per controller run")
    ap.add_argument("--runs", type=int, default=2, help="alternating controller runs per version")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="spawnv-"))
    env = dict(os.environ, MONARCH_TORCHX_HOME=str(home), PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    script = home / "controller.py"
    script.write_text(CONTROLLER)
    pool = "spawnv"
    versions = {
        "baseline": (args.baseline / ".venv" / "bin" / "python", args.baseline),
        "this": (Path(sys.executable), HERE.parent),
    }
    spawns: dict[str, list[dict]] = {v: [] for v in versions}
    try:
        subprocess.run(
            [str(BIN / "torchx"), "pool", "create", pool, "-cfg", f"hosts={args.hosts},preload=none"],
            env=env,
            check=True,
            capture_output=True,
        )
        run_controller(Path(sys.executable), HERE.parent, pool, 1, env, script)  # warms the actors fork servers
        for _ in range(args.runs):
            for v, (python, root) in versions.items():
                spawns[v] += run_controller(python, root, pool, args.rounds, env, script)
    finally:
        subprocess.run([str(BIN / "torchx"), "pool", "stop", "--force", pool], env=env, capture_output=True)
        shutil.rmtree(home, ignore_errors=True)

    def med(v: str, k: str) -> float:
        return statistics.median(s[k] for s in spawns[v])

    def ms(x: float) -> str:
        return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"

    rows = [
        f"| {k} | {f(med('baseline', key))} | {f(med('this', key))} | {med('this', key) / med('baseline', key):.2f}x |"
        for k, key, f in (
            ("wall", "wall", ms),
            ("controller CPU", "cpu", ms),
            ("controller sockets while the procs run", "sockets", lambda x: f"{x:.0f}"),
        )
    ]
    text = "\n".join(
        [
            f"`spawn_procs` of 1 proc on each of {args.hosts} hosts, one actor each, one call to each (warm "
            "actors fork "
            f"servers); median of {len(spawns['this'])} spawns per version in {args.runs} alternating controller runs. "
            f"Baseline `{git_line(args.baseline)}`, this `{git_line(HERE.parent)}`.",
            "",
            "| per spawn | baseline | this | this / baseline |",
            "|---|---:|---:|---:|",
            *rows,
        ]
    )
    print(text)
    if not args.no_record:
        record("spawn-versions", ".venv/bin/python benchmarks/spawn_versions.py " + " ".join(sys.argv[1:]), text)


if __name__ == "__main__":
    main()
