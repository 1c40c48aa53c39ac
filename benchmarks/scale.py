"""What grows with the size of a pool: each client operation at N hosts, for several N.

    .venv/bin/python benchmarks/scale.py [--sizes 8,16,32,64,128] [--skip sync,actors,sql] [--no-record]

One ``monarch_local`` pool of N agents (``preload=none``) per size, all on this machine. Each
operation is run the way a user runs it (the real ``torchx`` and ``monarch-torchx`` CLIs, and a
controller script for the actor mesh) and measured for:

- wall time;
- the client's own CPU time (user + system of the CLI process, from ``getrusage(CHILDREN)``);
- the agents' CPU time, summed over every process of every agent's session (their fork servers
  and replicas included);
- bytes moved over loopback (``/sys/class/net/lo`` tx), all traffic of the operation.

Each size also reports the memory an idle host costs once the pool is up: the proportional set
size (PSS: shared pages split among their users) of its agent and fork server, and the machine's
MemAvailable drop per host. ``--skip sync,actors,sql`` leaves those steps out, for sizes where
every host's FUSE server, actor procs or DataFusion would not fit in this machine's memory.

Here every agent shares the same 2 cores, so wall time at large N is mostly the agents' summed
CPU. On a real cluster each host has its own cores: what grows there is the client's own CPU and
the depth of the relay tree. From the runs, each operation's client CPU and agents' CPU per host
are fitted as a + b*N, and the model for a real cluster (written to RESULTS.md) is::

    wall(N) ~ client_cpu(N) + depth(N) * hop + agent_cpu_per_host(N)

with depth(N) = ceil(log_8 N) levels of the relay tree from 32 hosts on (1 below), and ``hop`` a
round trip between nodes plus a handshake (1 ms, from the network and TLS cost measured in
RESULTS.md's actors-tls and k8s_pools sections). The model is an estimate; the measured numbers
are the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from _results import record  # noqa: E402

BIN = Path(sys.executable).parent
HOP_S = 0.001
ACTORS_IDLE_S = 10
TREE_FANOUT, TREE_MIN = 8, 32
OPS = [
    "create",
    "run",
    "status",
    "log",
    "pool status",
    "sql count",
    "sql again",
    "sync 200 files",
    "no-op resync",
    "spawn 1 actor/host",
    "respawn",
    "call all",
    "broadcast",
    "pool stop",
]

SKIPPABLE = ("sync", "actors", "sql")  # step groups --skip can leave out

ACTORS = textwrap.dedent("""
    import json, resource, sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[3])
    from scale import _agent_sessions, _lo_bytes, _session_cpu
    from monarch_torchx import Actor, endpoint, attach

    class Echo(Actor):
        @endpoint
        def ping(self, x):
            return x

    def cpu():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    hosts = attach(sys.argv[1])
    sessions = _agent_sessions(Path(sys.argv[2]))
    out = {}
    c0, t0, a0, b0 = cpu(), time.monotonic(), _session_cpu(sessions), _lo_bytes()
    procs = hosts.spawn_procs(per_host={"procs": 1})
    actors = procs.spawn("echo", Echo)
    actors.ping.call(0).get(timeout=300)
    out["spawn 1 actor/host"] = (time.monotonic() - t0, cpu() - c0, _session_cpu(sessions) - a0, _lo_bytes() - b0)
    walls, cpus = [], []
    for _ in range(5):
        c0, t0 = cpu(), time.monotonic()
        actors.ping.call(1).get(timeout=120)
        walls.append(time.monotonic() - t0)
        cpus.append(cpu() - c0)
    out["call all"] = (sorted(walls)[2], sorted(cpus)[2], float("nan"), float("nan"))
    c0, t0 = cpu(), time.monotonic()
    for _ in range(5):
        actors.ping.broadcast(2)
    actors.ping.call(3).get(timeout=120)  # in order after the broadcasts: all were delivered
    out["broadcast"] = ((time.monotonic() - t0) / 6, (cpu() - c0) / 6, float("nan"), float("nan"))
    procs.stop().get(timeout=120)
    # the warm iteration: the same pool spawns again (its hosts keep the actor runtime imported)
    c0, t0, a0, b0 = cpu(), time.monotonic(), _session_cpu(sessions), _lo_bytes()
    procs = hosts.spawn_procs(per_host={"procs": 1})
    procs.spawn("echo", Echo).ping.call(0).get(timeout=300)
    out["respawn"] = (time.monotonic() - t0, cpu() - c0, _session_cpu(sessions) - a0, _lo_bytes() - b0)
    procs.stop().get(timeout=120)
    print(json.dumps(out))
""")


def _lo_bytes() -> int:
    try:
        return int(Path("/sys/class/net/lo/statistics/tx_bytes").read_text())
    except OSError:
        return 0


def _agent_sessions(home: Path) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"monarch_torchx.agent" in cmd and any(str(home).encode() in a for a in cmd):
            out.append(int(p.name))
    return out


def _session_cpu(sessions: list[int]) -> float:
    """CPU seconds of every live process in those sessions, with the children they reaped."""
    wanted, total = set(sessions), 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) in wanted:  # session id
            total += sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
    return total


def _pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def host_memory(home: Path, n: int, available_before: float) -> dict[str, float]:
    """MiB per host of an idle pool: its agents' and fork servers' PSS, and MemAvailable's drop."""
    sessions, pss = set(_agent_sessions(home)), 0
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            sid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[3])
        except (OSError, IndexError, ValueError):
            continue
        if sid in sessions:
            pss += _pss_kib(int(p.name))
    return {"pss_mib": pss / 1024 / n, "available_drop_mib": (available_before - _available_mib()) / n}


class Meter:
    """Wall, client CPU, agents' CPU and loopback bytes of one operation."""

    def __init__(self, home: Path):
        self.home = home

    def run(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: Path | None = None,
        parse: Callable[[str], Any] | None = None,
    ) -> tuple[dict[str, float], str]:
        sessions = _agent_sessions(self.home)
        a0, b0 = _session_cpu(sessions), _lo_bytes()
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.monotonic()
        res = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=1800)
        wall = time.monotonic() - t0
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        if res.returncode != 0:
            raise SystemExit(
                f"{' '.join(argv[:4])}... failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
            )
        sessions = sorted(set(sessions) | set(_agent_sessions(self.home)))
        a1 = _session_cpu(sessions)
        return {
            "wall": wall,
            "client_cpu": (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime),
            "agents_cpu": max(0.0, a1 - a0),
            "bytes": _lo_bytes() - b0,
        }, res.stdout


MIN_AVAILABLE_MIB = 1536  # below this, the run is ended before the kernel's OOM killer picks a victim


def _available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("inf")


class MemoryGuard:
    """Ends every agent of the run (SIGKILL by session) when the machine runs out of memory, so
    the OOM killer does not pick another victim (it once took the SLURM lab's database). The
    lowest MemAvailable seen is reported with the results."""

    def __init__(self, home: Path):
        import threading

        self.home, self.tripped, self.lowest = home, False, float("inf")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> MemoryGuard:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        import signal

        while not self._stop.wait(0.25):
            avail = _available_mib()
            self.lowest = min(self.lowest, avail)
            if avail < MIN_AVAILABLE_MIB and not self.tripped:
                self.tripped = True
                print(f"memory: {avail:.0f} MiB available; ending the pool's agents", file=sys.stderr, flush=True)
                for sid in _agent_sessions(self.home):
                    try:
                        os.killpg(os.getpgid(sid), signal.SIGKILL)
                    except OSError:
                        pass


def measure(n: int, skip: frozenset = frozenset()) -> dict[str, dict[str, float]]:
    home = Path(tempfile.mkdtemp(prefix=f"scale{n}-"))
    out: dict[str, dict[str, float]] = {}
    with MemoryGuard(home) as guard:
        try:
            _measure(n, home, out, skip)
        except (SystemExit, subprocess.SubprocessError, ValueError, KeyError) as e:
            if not guard.tripped:
                raise
            print(f"{n} hosts: ended for memory after {', '.join(out) or 'nothing'} ({str(e)[:200]})", file=sys.stderr)
    print(f"{n} hosts: lowest MemAvailable {guard.lowest:.0f} MiB", file=sys.stderr, flush=True)
    return out


def _measure(n: int, home: Path, out: dict[str, dict[str, float]], skip: frozenset) -> None:
    # the hosts' actors fork servers end 10 s after their last proc (default 300 s): at 256 hosts here
    # their memory and every agent's DataFusion (the sql step, after the actors) do not both fit
    env = dict(
        os.environ,
        MONARCH_TORCHX_HOME=str(home),
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        MONARCH_TORCHX_ACTORS_IDLE_S=str(ACTORS_IDLE_S),
    )
    m = Meter(home)
    pool = f"scale{n}"
    tx, mtx = [str(BIN / "torchx")], [str(BIN / "monarch-torchx")]
    try:
        available = _available_mib()
        out["create"], _ = m.run(tx + ["pool", "create", pool, "-cfg", f"hosts={n},preload=none"], env)
        time.sleep(2)  # the agents' first heartbeat and imports are done
        out["memory per host"] = host_memory(home, n, available)
        out["run"], stdout = m.run(
            tx
            + [
                "run",
                "-s",
                "monarch_local",
                "-cfg",
                f"pool={pool}",
                "utils.echo",
                "--msg",
                "hello",
                "--num_replicas",
                str(n),
            ],
            env,
        )
        handle = stdout.strip().splitlines()[-1]
        deadline = time.time() + 600
        while (
            "SUCCEEDED" not in subprocess.run(tx + ["status", handle], env=env, capture_output=True, text=True).stdout
        ):
            if time.time() > deadline:
                raise SystemExit(f"echo on {n} hosts did not finish")
            time.sleep(0.5)
        out["status"], _ = m.run(tx + ["status", handle], env)
        out["log"], logs = m.run(tx + ["log", handle], env)
        if logs.count("hello") != n:
            raise SystemExit(f"torchx log printed {logs.count('hello')} of {n} replicas' lines")
        out["pool status"], _ = m.run(tx + ["pool", "status", pool], env)
        if "sync" not in skip:  # (every host then runs a FUSE server too)
            src = home / "src"
            for i in range(200):
                d = src / f"d{i % 10}"
                d.mkdir(parents=True, exist_ok=True)
                (d / f"f{i}.py").write_text(f"x = {i}\n" * 20)
            out["sync 200 files"], _ = m.run(mtx + ["sync", "--pool", pool, "--to", "code", str(src)], env)
            out["no-op resync"], _ = m.run(mtx + ["sync", "--pool", pool, "--to", "code", str(src)], env)
        if "actors" not in skip:
            _measure_actors(m, pool, home, env, out)
        if "sql" not in skip:
            # after the actor procs have ended: every agent imports DataFusion at its first query, and
            # at 256 hosts here both at once do not fit in memory
            # (--timeout: here every agent imports DataFusion at once on 2 cores, 28 s at 256 hosts)
            out["sql count"], _ = m.run(
                mtx + ["sql", "--pool", pool, "--timeout", "300", "select count(*) from logs"], env
            )
            out["sql again"], _ = m.run(mtx + ["sql", "--pool", pool, "select count(*) from logs"], env)  # warm
        out["pool stop"], _ = m.run(tx + ["pool", "stop", pool], env)
    finally:
        subprocess.run(tx + ["pool", "stop", "--force", pool], env=env, capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


def _measure_actors(m: Meter, pool: str, home: Path, env: dict[str, str], out: dict[str, dict[str, float]]) -> None:
    script = home / "actors.py"
    script.write_text(ACTORS)
    _, stdout = m.run(
        [sys.executable, str(script), pool, str(home), str(HERE)], env, cwd=Path.cwd()
    )  # the caller's checkout (see scale_versions.py)
    inner = json.loads(stdout.strip().splitlines()[-1].replace("NaN", "null"))
    for name, (wall, cpu, agents, moved) in inner.items():  # timed inside the controller
        out[name] = {
            "wall": wall,
            "client_cpu": cpu,
            "agents_cpu": float("nan") if agents is None else agents,
            "bytes": float("nan") if moved is None else moved,
        }
    time.sleep(ACTORS_IDLE_S + 3)  # the actors servers have ended


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares a + b*x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return my - b * mx, b


def depth(n: int) -> int:
    return 1 if n < TREE_MIN else math.ceil(math.log(n, TREE_FANOUT))


def _fmt(v: float, unit: str) -> str:
    if v != v:  # nan
        return "-"
    if unit == "B":
        return f"{v / 1e6:.1f} MB" if v >= 1e5 else f"{v / 1e3:.0f} kB"
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


def report(results: dict[int, dict[str, dict[str, float]]]) -> str:
    sizes = sorted(results)
    lines = ["One monarch_local pool of N agents (preload=none) per size, all sharing this machine's cores.", ""]
    for key, title, unit in (
        ("wall", "wall time", "s"),
        ("client_cpu", "client CPU", "s"),
        ("agents_cpu", "agents' CPU, summed", "s"),
        ("bytes", "bytes over loopback", "B"),
    ):
        lines += [f"**{title}**", "", "| hosts | " + " | ".join(OPS) + " |", "|---:|" + "---:|" * len(OPS)]
        for n in sizes:
            lines.append(
                f"| {n} | " + " | ".join(_fmt(results[n].get(op, {}).get(key, float("nan")), unit) for op in OPS) + " |"
            )
        lines.append("")
    mem = [n for n in sizes if "memory per host" in results[n]]
    if mem:
        lines += [
            "**memory per idle host** (its agent and fork server, once the pool is up)",
            "",
            "| hosts | PSS per host | MemAvailable drop per host |",
            "|---:|---:|---:|",
        ]
        lines += [
            f"| {n} | {results[n]['memory per host']['pss_mib']:.1f} MiB | "
            f"{results[n]['memory per host']['available_drop_mib']:.1f} MiB |"
            for n in mem
        ]
        lines.append("")
    lines += [
        "**Model for a real cluster** (each host its own cores): client CPU and agents' CPU per host fitted "
        "as a + b*N over the sizes above; wall ~ client CPU + depth x 1 ms + agent CPU per host "
        f"(depth: ceil(log_{TREE_FANOUT} N) from {TREE_MIN} hosts).",
        "",
        "| operation | client CPU per extra host | at 1,024 hosts | at 4,096 hosts |",
        "|---|---:|---:|---:|",
    ]
    for op in OPS:
        pts = [(n, results[n][op]) for n in sizes if op in results[n]]
        if len(pts) < 2:
            continue
        a, b = fit([n for n, _ in pts], [r["client_cpu"] for _, r in pts])
        per = [(n, r["agents_cpu"] / n) for n, r in pts if r["agents_cpu"] == r["agents_cpu"]]
        ah = fit([n for n, _ in per], [v for _, v in per]) if len(per) >= 2 else (0.0, 0.0)

        def model(n: int) -> float:
            return max(0.0, a + b * n) + depth(n) * HOP_S + max(0.0, ah[0] + ah[1] * n)  # noqa: B023

        lines.append(f"| {op} | {b * 1e3:.2f} ms | {_fmt(model(1024), 's')} | {_fmt(model(4096), 's')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8,16,32,64,128", help="pool sizes, comma-separated")
    ap.add_argument("--skip", default="", help=f"steps to leave out, comma-separated: {', '.join(SKIPPABLE)}")
    ap.add_argument("--no-record", action="store_true", help="do not write benchmarks/RESULTS.md")
    ap.add_argument("--section", default="scale", help="the RESULTS.md section to write (one size alone: its own)")
    ap.add_argument(
        "--note", default="", help="a paragraph written above the tables (what this run leaves out, and why)"
    )
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    skip = frozenset(s for s in args.skip.split(",") if s)
    if skip - set(SKIPPABLE):
        ap.error(f"--skip: unknown step {', '.join(sorted(skip - set(SKIPPABLE)))} (known: {', '.join(SKIPPABLE)})")
    results: dict[int, dict[str, dict[str, float]]] = {}
    for n in sizes:
        print(f"{n} hosts ...", file=sys.stderr, flush=True)
        results[n] = measure(n, skip)
        print(json.dumps({n: results[n]}), file=sys.stderr, flush=True)
    text = report(results)
    if args.note:
        text = f"{args.note}\n\n{text}"
    print(text)
    if not args.no_record:
        argv = sys.argv[1:]
        if "--note" in argv:  # (the note is written above the tables, not repeated in the command)
            i = argv.index("--note")
            argv = argv[:i] + ["--note", "..."] + argv[i + 2 :]
        record(args.section, ".venv/bin/python benchmarks/scale.py " + " ".join(argv), text)


if __name__ == "__main__":
    main()
