"""What a relay hop's connection costs: a fresh dial (handshake) against a kept one (ping).

    .venv/bin/python benchmarks/relay_dial.py [--hosts 32] [--dials 500] [--requests 20] [--no-record]

A relay that passes a request on either dials the group's first member (a TCP connection and
the pool's handshake) or reuses a connection it kept, which it pings first. This measures both
from this process against one agent of a ``monarch_local`` pool (wall, this process's CPU and
the agent's CPU per connection), then counts how many connections the pool's agents accept for
one relayed request through the tree of ``--hosts`` hosts (``reserve_port``, an operation that
may not run twice, as a launch may not) and what the agents spend on it. Since 2026-12-03 every
relayed operation uses kept connections, not only those that may run twice.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _results import record  # noqa: E402
from scale import _agent_sessions, _session_cpu  # noqa: E402


def _own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _pid_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def per_connection(pool, n: int) -> dict[str, dict[str, float]]:
    """ms per connection: a fresh dial with one ping, against one ping on a kept connection."""
    from monarch_torchx import net

    host = pool.hosts[1]
    creds, ident = pool.record.credentials, host.identity(pool.name)
    out = {}

    def timed(label: str, fn) -> None:
        a0, c0, t0 = _pid_cpu(host.pid), _own_cpu(), time.monotonic()
        for _ in range(n):
            fn()
        out[label] = {
            "wall": (time.monotonic() - t0) / n * 1e3,
            "caller": (_own_cpu() - c0) / n * 1e3,
            "agent": (_pid_cpu(host.pid) - a0) / n * 1e3,
        }

    def fresh() -> None:
        c = net.Client(host.host, host.port, creds, timeout=10, identity=ident)
        c.call("ping")
        c.close()

    kept = net.Client(host.host, host.port, creds, timeout=10, identity=ident)
    timed("fresh dial + ping", fresh)
    timed("ping on a kept connection", lambda: kept.call("ping"))
    kept.close()
    return out


def per_request(pool, home: Path, requests: int) -> dict[str, float]:
    """Connections the agents accept, and the agents' CPU, per relayed request (median)."""
    hosts = list(range(pool.record.num_hosts))
    calls = {i: [{}] for i in hosts}
    sessions = _agent_sessions(home)

    def accepted() -> int:
        return sum(v["accepted"] for _, v, _ in pool.ask("info", hosts, timeout=30.0))

    pool.ask("reserve_port", hosts, calls=calls, timeout=30.0)  # the relays' connections, once
    dials: list[int] = []
    cpu: list[float] = []
    for _ in range(requests):
        before = accepted()  # (counts this info's own dials by the client)
        c0 = _session_cpu(sessions)
        res = pool.ask("reserve_port", hosts, calls=calls, timeout=30.0)
        cpu.append(_session_cpu(sessions) - c0)
        if any(e for _, _, e in res):
            raise SystemExit(f"reserve_port failed: {[str(e) for _, _, e in res if e][:3]}")
        dials.append(accepted() - before)  # this request's dials and the next info's client dials
    return {"accepted": statistics.median(dials), "agents_cpu_ms": statistics.median(cpu) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, default=32, help="pool size (the tree starts at 32 hosts)")
    ap.add_argument("--dials", type=int, default=500, help="connections timed each way")
    ap.add_argument("--requests", type=int, default=20, help="relayed requests counted")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    from monarch_torchx.pool import tree_min_hosts

    if args.hosts < tree_min_hosts():  # below it the client asks every host itself: no relay hops to count
        ap.error(f"--hosts must be at least {tree_min_hosts()} (MONARCH_TORCHX_TREE_MIN_HOSTS), where the tree starts")
    home = Path(tempfile.mkdtemp(prefix="relay-dial-"))
    os.environ["MONARCH_TORCHX_HOME"] = str(home)
    from monarch_torchx.pool import PoolRequest, attach, ensure_pool, stop_pool

    name = f"dial{os.getpid()}"
    try:
        ensure_pool(PoolRequest("monarch_local", name, {"hosts": args.hosts, "preload": "none"}))
        pool = attach(name)
        conn = per_connection(pool, args.dials)
        req = per_request(pool, home, args.requests)
    finally:
        try:
            stop_pool(name)
        finally:
            shutil.rmtree(home, ignore_errors=True)
    from monarch_torchx.net.fanout import FANOUT

    client_dials = 2 * min(FANOUT, args.hosts)  # the request's and the info's after it, at the tree's first level
    lines = [
        "Per connection, from this process to one agent (ms):",
        "",
        "| | wall | caller's CPU | agent's CPU |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {k} | {v['wall']:.2f} | {v['caller']:.2f} | {v['agent']:.2f} |" for k, v in conn.items()]
    saved = sum(conn["fresh dial + ping"][k] - conn["ping on a kept connection"][k] for k in ("caller", "agent"))
    lines += [
        "",
        f"One `reserve_port` through the tree of {args.hosts} hosts (median of {args.requests}): the agents "
        f"accepted {req['accepted'] - client_dials:.0f} connection(s) from relays (and {client_dials} from the "
        f"client, for it and the `info` that counts them), and spent {req['agents_cpu_ms']:.0f} ms of CPU in all.",
        f"A relay hop that reuses a kept connection saves about {saved:.2f} ms of CPU (both ends), so "
        f"{args.hosts - min(FANOUT, args.hosts)} relayed hops save about "
        f"{saved * (args.hosts - min(FANOUT, args.hosts)):.0f} ms per request at {args.hosts} hosts.",
    ]
    body = "\n".join(lines)
    print(body)
    if not args.no_record:
        record("relay-dial", ".venv/bin/python benchmarks/relay_dial.py " + " ".join(sys.argv[1:]), body)


if __name__ == "__main__":
    main()
