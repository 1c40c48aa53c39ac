"""Telemetry queries per subtree vs from every host's rows, side by side on one pool.

    .venv/bin/python benchmarks/sql_tree.py [--hosts 64] [--lines 20000] [--rounds 3] [--no-record]

One ``monarch_local`` pool of N agents (``preload=none``), each host's replica printing ``--lines``
log lines with 500 distinct texts (the same 500 on every host). Each query runs both ways through
``telemetry.query.run`` in this process, alternating, ``--rounds`` times (medians):

- **per subtree**: hosts compute partial aggregates, relays of the tree merge them; or, for an
  ``ORDER BY ... LIMIT`` over a table's rows, each host sends its top rows and relays cut their
  subtree's to the limit (from 32 hosts on; below, the client asks each host and finishes);
- **rows**: each host sends the filtered, projected rows the query needs; the client aggregates.

Reported per query: wall time, the client's CPU time (this process), the bytes of Arrow answers
the client read and how many answers. The agents share this machine's cores with the client, so
the wall ratio understates what a cluster (each host its own cores) would see; bytes and answers
are what the network and the client carry there. Also reported: an agent's memory (RSS, and PSS,
which counts shared library pages once per sharer) after its first query.
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
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from _results import record  # noqa: E402
from scale import _agent_sessions  # noqa: E402

QUERIES = {
    "count(*)": "SELECT count(*) FROM logs",
    "GROUP BY line (500 groups)": "SELECT line, count(*) AS n FROM logs GROUP BY line ORDER BY n DESC, line LIMIT 10",
    "GROUP BY host, avg": "SELECT host, count(*) AS n, avg(length(line)) AS a FROM logs GROUP BY host ORDER BY host",
    "filtered GROUP BY": (
        "SELECT line, count(*) AS n FROM logs WHERE line LIKE '%7%' GROUP BY line ORDER BY n DESC, line LIMIT 5"
    ),
    "latest 20 matching lines": (
        "SELECT host, line FROM logs WHERE line LIKE '%77%' ORDER BY ts DESC, host, line LIMIT 20"
    ),
    "top 10 by length": "SELECT line, host FROM logs ORDER BY length(line) DESC, host, line LIMIT 10",
}


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _memory(pid: int) -> dict[str, float]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("Rss", "Pss", "Pss_Anon"):
                out[k] = int(v.split()[0]) / 1024
    except OSError:
        pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=64)
    ap.add_argument("--lines", type=int, default=20000, help="log lines per host")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-record", action="store_true", help="do not write benchmarks/RESULTS.md")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="sqltree-"))
    os.environ["MONARCH_TORCHX_HOME"] = str(home)
    from torchx.runner import get_runner
    from torchx.specs import AppDef, Role

    from monarch_torchx.pool import PoolRequest, attach, ensure_pool, stop_pool
    from monarch_torchx.telemetry.query import run

    name = f"sqltree{os.getpid()}"
    try:
        print(f"creating {args.hosts} hosts ...", file=sys.stderr, flush=True)
        ensure_pool(PoolRequest("monarch_local", name, {"hosts": args.hosts, "preload": "none"}))
        pool = attach(name)
        code = (
            f"import sys\nw = sys.stdout.write\n"
            f"for i in range({args.lines}): w(f'step {{i % 500}} of the run, value {{(i % 500) * 7}}\\n')\n"
        )
        with get_runner() as runner:
            app = AppDef(
                "chatty",
                roles=[Role(name="c", image=".", entrypoint="python", args=["-c", code], num_replicas=args.hosts)],
            )
            h = runner.run(app, "monarch_local", {"pool": name})
            while not runner.status(h).is_terminal():
                time.sleep(0.5)
        run(pool, "SELECT count(*) FROM logs")  # every agent imports DataFusion and indexes its logs once
        pids = [p for p in _agent_sessions(home)]
        mem = [_memory(p) for p in pids]
        rows: list[str] = []
        for label, sql in QUERIES.items():
            got: dict[bool, list[tuple]] = {True: [], False: []}
            for _ in range(args.rounds):
                for per_subtree in (True, False):
                    c0, t0 = _cpu(), time.monotonic()
                    res = run(pool, sql, per_subtree=per_subtree)
                    got[per_subtree].append(
                        (time.monotonic() - t0, _cpu() - c0, res.bytes_moved, res.answers, res.table.to_pylist())
                    )
            tree, flat = got[True], got[False]
            assert tree[-1][4] == flat[-1][4], (label, tree[-1][4], flat[-1][4])  # the same answer both ways
            med = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
            rows.append(
                f"| {label} | {med(tree, 0):.3f} s | {med(flat, 0):.3f} s | {med(flat, 0) / med(tree, 0):.1f}x | "
                f"{med(tree, 1):.3f} s | {med(flat, 1):.3f} s | {tree[-1][2]:,} | {flat[-1][2]:,} | "
                f"{tree[-1][3]} | {flat[-1][3]} |"
            )
            print(rows[-1], file=sys.stderr, flush=True)
        agent_mem = [m for m in mem if m]
        text = "\n".join(
            [
                f"One monarch_local pool of {args.hosts} agents, {args.lines:,} log lines per host "
                f"({args.hosts * args.lines:,} rows); median of {args.rounds} alternating rounds; the same "
                "answer both ways.",
                "",
                "| query | wall, per subtree | wall, rows | ratio | client CPU, per subtree | client CPU, rows | "
                "bytes to the client, per subtree | bytes, rows | answers read, per subtree | answers, rows |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
                *rows,
                "",
                f"An agent after its first query (median of {len(agent_mem)}): RSS "
                f"{statistics.median(m.get('Rss', 0) for m in agent_mem):.0f} MiB, PSS "
                f"{statistics.median(m.get('Pss', 0) for m in agent_mem):.0f} MiB, of it anonymous "
                f"{statistics.median(m.get('Pss_Anon', 0) for m in agent_mem):.0f} MiB."
                if agent_mem
                else "",
            ]
        )
        print(text)
        if not args.no_record:
            record("sql-tree", ".venv/bin/python benchmarks/sql_tree.py " + " ".join(sys.argv[1:]), text)
    finally:
        try:
            stop_pool(name)
        except Exception:  # noqa: BLE001 (best effort: the force stop below ends what is left)
            subprocess.run(
                [str(Path(sys.executable).parent / "torchx"), "pool", "stop", "--force", name],
                capture_output=True,
                env=dict(os.environ),
            )
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
