"""An actor mesh of many procs: an earlier commit's against this checkout's, side by side.

    git worktree add /tmp/mtx-base <commit> && make -C /tmp/mtx-base setup
    .venv/bin/python benchmarks/mesh_versions.py --baseline /tmp/mtx-base [--hosts 8] [--procs 32] [--rounds 3]

Each version gets a ``monarch_local`` pool of ``--hosts`` hosts (``preload=none``) created by its
own CLI, so its agents, fork servers and procs run its own code, and a controller of the same
version. A round, per version: ``spawn_procs`` of ``--procs`` procs per host on the warm pool,
``spawn`` of one actor per proc (a sync endpoint, as most actors have), the first ``call`` of all
of them (which also opens the multicast tree's connections), then ``call`` of all (median of 10)
and ``broadcast`` (20 back to back, then one ``call`` that comes after them all; the call's
median taken off), and the procs' CPU per operation per proc, from /proc. The versions
alternate, so this machine's noise hits both; the table gives the medians of the rounds.

Here every proc shares the same 2 cores, so what a proc spends on one message is most of a
multicast's time; on a cluster it is spread over the hosts' cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _results import record  # noqa: E402
from scale_versions import git_line  # noqa: E402
from start_versions import _cli, _env, driver_run  # noqa: E402

DRIVER = textwrap.dedent('''
    import json, os, statistics, sys, time
    from monarch_torchx import Actor, endpoint, attach
    from monarch_torchx.pool import attach as attach_pool

    class Echo(Actor):
        @endpoint
        def ping(self, x):
            return x

    name, per = sys.argv[1], int(sys.argv[2])
    agents = {h.pid for h in attach_pool(name).hosts}
    tick = os.sysconf("SC_CLK_TCK")

    def stat(p):
        return open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()

    def comm(p):
        try:
            return open(f"/proc/{p}/comm").read().strip()
        except OSError:
            return ""

    def proc_pids():
        """This pool's actor procs: children of its agents' fork servers (an agent's children,
        and an actors server forked from one of those, named fs-...)."""
        parents = {}
        for p in os.listdir("/proc"):
            if p.isdigit():
                try:
                    parents[int(p)] = int(stat(p)[1])
                except (OSError, IndexError):
                    pass
        servers = {p for p, pp in parents.items() if pp in agents}
        servers |= {p for p, pp in parents.items() if pp in servers and comm(p).startswith("fs-")}
        return [p for p, pp in parents.items() if pp in servers and p not in servers]

    def procs_cpu():
        total = 0.0
        for p in proc_pids():
            try:
                f = stat(p)
                total += (int(f[11]) + int(f[12])) / tick
            except (OSError, IndexError):
                pass
        return total

    def kib(path, field):
        for line in open(path):
            if line.startswith(field + ":"):
                return int(line.split()[1])
        return 0

    hosts = attach(name)
    out = {}
    t0 = time.monotonic()
    procs = hosts.spawn_procs(per_host={"procs": per})
    out["spawn_procs"] = time.monotonic() - t0
    t1 = time.monotonic()
    actors = procs.spawn("echo", Echo)
    out["spawn actors"] = time.monotonic() - t1
    t2 = time.monotonic()
    actors.ping.call(0).get(timeout=300)
    out["first call"] = time.monotonic() - t2
    out["spawn to first answer"] = time.monotonic() - t0
    n = per * len(agents)
    c0, walls = procs_cpu(), []
    for _ in range(10):
        t = time.monotonic()
        actors.ping.call(1).get(timeout=120)
        walls.append(time.monotonic() - t)
    out["call all"] = statistics.median(walls)
    out["call: procs' CPU per proc"] = (procs_cpu() - c0) / 10 / n
    c0, t = procs_cpu(), time.monotonic()
    for _ in range(20):
        actors.ping.broadcast(2)
    actors.ping.call(3).get(timeout=120)
    out["broadcast"] = (time.monotonic() - t - out["call all"]) / 20
    out["broadcast: procs' CPU per proc"] = (procs_cpu() - c0 - out["call: procs' CPU per proc"] * n) / 20 / n
    out["controller RSS"] = kib("/proc/self/status", "VmRSS") * 1024
    pss = [kib(f"/proc/{p}/smaps_rollup", "Pss") for p in proc_pids()]
    out["proc PSS, mean"] = sum(pss) / max(1, len(pss)) * 1024
    procs.stop().get(timeout=120)
    print(json.dumps(out))
''')

ROWS = [
    "spawn_procs",
    "spawn actors",
    "first call",
    "spawn to first answer",
    "call all",
    "broadcast",
    "call: procs' CPU per proc",
    "broadcast: procs' CPU per proc",
    "controller RSS",
    "proc PSS, mean",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, required=True, help="a checkout of the earlier commit, with its .venv")
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--procs", type=int, default=32, help="procs per host")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    home, script, versions = driver_run("meshv-", DRIVER, args.baseline)
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in versions}
    try:
        for v, root in versions.items():
            _cli(root, home, "pool", "create", f"meshv-{v}", "-cfg", f"hosts={args.hosts},preload=none")
        for r in range(args.rounds + 1):  # round 0 starts each host's actor fork server: not counted
            for v, root in versions.items():
                python = root / ".venv" / "bin" / "python"
                res = subprocess.run(
                    [str(python), str(script), f"meshv-{v}", str(args.procs)],
                    env=_env(root, home),
                    cwd=root,
                    capture_output=True,
                    text=True,
                    timeout=900,
                )
                if res.returncode != 0:
                    raise SystemExit(f"{v} driver failed ({res.returncode}):\n{res.stderr[-3000:]}")
                if r:
                    runs[v].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(f"round {r} of {args.rounds} done", file=sys.stderr, flush=True)
    finally:
        for v, root in versions.items():
            _cli(root, home, "pool", "stop", "--force", f"meshv-{v}", check=False)
        shutil.rmtree(home, ignore_errors=True)

    def med(v: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[v])

    def fmt(key: str, x: float) -> str:
        if "RSS" in key or "PSS" in key:
            return f"{x / (1 << 20):.1f} MiB"
        if "CPU" in key:
            return f"{x * 1e6:.0f} us"
        return f"{x:.2f} s" if x >= 1 else f"{x * 1000:.1f} ms"

    rows = [
        f"| {k} | {fmt(k, med('baseline', k))} | {fmt(k, med('this', k))} | "
        f"{med('this', k) / med('baseline', k):.2f}x |"
        for k in ROWS
    ]
    n = args.hosts * args.procs
    text = "\n".join(
        [
            f"{n} procs ({args.procs} per host on a {args.hosts}-host `monarch_local` pool), one actor each with a "
            f"sync endpoint; median of {args.rounds} alternating rounds per version. Baseline "
            f"`{git_line(args.baseline)}`, this `{git_line(HERE.parent)}`.",
            "",
            "| | baseline | this | this / baseline |",
            "|---|---:|---:|---:|",
            *rows,
        ]
    )
    print(text)
    if not args.no_record:
        record("mesh-versions", ".venv/bin/python benchmarks/mesh_versions.py " + " ".join(sys.argv[1:]), text)


if __name__ == "__main__":
    main()
