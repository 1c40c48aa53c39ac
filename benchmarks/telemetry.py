"""Telemetry: SQL over 10M log rows on 4 agents, pushed down vs gathered; ingestion overhead.

    .venv/bin/python benchmarks/telemetry.py [--rows-per-host 2500000] [--n 5]

One run, side by side:
  - a filtered count and a filtered GROUP BY (the README's example), and an unfiltered GROUP BY:
    time and bytes moved with pushdown (filters/projection run on each host) vs the naive way
    (every row gathered to the client, then the same query there);
  - ingestion: lines/s of a process printing as fast as it can, on a pool with the telemetry
    module vs one without it (and, for reference, with its output sent to /dev/null).
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

sys.path.insert(0, str(Path(__file__).parent))
from _results import record  # noqa: E402

BIN = Path(sys.executable).parent
# every row written is kept: the default log limit (64 MiB per replica) would drop most of 2.5M lines
LOGS = "log_max_mb=4096,log_pool_max_mb=16384"
PRINTER = """
import sys, time
n = int(sys.argv[1]); out = sys.argv[2] if len(sys.argv) > 2 else None
w = sys.stdout.write
t0 = time.perf_counter()
for i in range(n):
    w(f"step {i} loss {'NaN' if i % 1000 == 7 else i % 97} lr 0.001\\n")
sys.stdout.flush()
if out:
    open(out, "w").write(str(n / (time.perf_counter() - t0)))
"""


def sh(*args: str, env=None) -> str:
    return subprocess.run(list(args), check=True, capture_output=True, text=True, env=env).stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows-per-host", type=int, default=2_500_000)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--n", type=int, default=5, help="runs per query (median)")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--ingestion-only", action="store_true", help="skip the 10M-row queries")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="bench-tel-"))
    work = Path(tempfile.mkdtemp(prefix="bench-tel-work-"))
    (work / "printer.py").write_text(PRINTER)
    os.environ["MONARCH_TORCHX_HOME"] = str(home)
    os.environ["PATH"] = f"{BIN}{os.pathsep}{os.environ['PATH']}"
    torchx = str(BIN / "torchx")
    from monarch_torchx.pool import attach
    from monarch_torchx.telemetry.query import run

    py = sys.executable
    try:
        rows = []
        if args.ingestion_only:
            args.hosts = 0
        sh(torchx, "pool", "create", "tel", "-cfg", f"hosts={max(1, args.hosts)},preload=none,{LOGS}")
        pool = attach("tel")
        from monarch_torchx import apps
        from monarch_torchx.specs import LaunchSpec

        print(f"writing {args.hosts} x {args.rows_per_host} log lines", file=sys.stderr)
        apps.launch(
            pool,
            "fill",
            "fill",
            [],
            [
                (
                    i,
                    LaunchSpec(
                        app_id="fill",
                        role="p",
                        replica_id=i,
                        argv=[py, str(work / "printer.py"), str(args.rows_per_host)],
                    ),
                )
                for i in range(args.hosts)
            ],
        )
        total = args.hosts * args.rows_per_host
        deadline = time.time() + 900
        while time.time() < deadline:
            if run(pool, "SELECT count(*) AS n FROM logs").table.to_pylist()[0]["n"] >= total:
                break
            time.sleep(1)
        queries = {
            "filtered count": "SELECT count(*) AS n FROM logs WHERE line LIKE '%NaN%'",
            "filtered GROUP BY": "SELECT host, count(*) AS n FROM logs WHERE line LIKE '%NaN%' GROUP BY host",
            "GROUP BY, no filter": "SELECT host, count(*) AS n FROM logs GROUP BY host",
        }
        rows = [
            "| query | pushdown (s) | bytes moved | naive: gather all, query at client (s) | bytes moved | "
            "bytes ratio |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        naive_bytes = None
        naive_time = None
        for name, q in queries.items() if args.hosts else []:
            times, res = [], None
            for _ in range(args.n):
                t0 = time.perf_counter()
                res = run(pool, q)
                times.append(time.perf_counter() - t0)
            if naive_time is None:  # gathering everything costs the same whatever the query: measure once
                from datafusion import SessionContext

                nt = []
                for _ in range(max(1, args.n // 2)):
                    t0 = time.perf_counter()
                    everything = run(pool, "SELECT * FROM logs")
                    ctx = SessionContext()
                    ctx.register_record_batches("logs", [everything.table.to_batches()])
                    ctx.sql(q).to_arrow_table()
                    nt.append(time.perf_counter() - t0)
                naive_time, naive_bytes = statistics.median(nt), everything.bytes_moved
                del everything, ctx
            rows.append(
                f"| {name} | {statistics.median(times):.3f} | {res.bytes_moved:,} | {naive_time:.3f} | "
                f"{naive_bytes:,} | {100 * res.bytes_moved / naive_bytes:.3f}% |"
            )
        sh(torchx, "pool", "stop", "tel")

        # ingestion overhead: the same printer, interleaved on a pool with telemetry and one without
        n_lines = 2_000_000
        sh(torchx, "pool", "create", "ing-on", "-cfg", f"hosts=1,preload=none,{LOGS}")
        sh(
            torchx,
            "pool",
            "create",
            "ing-off",
            "-cfg",
            f"hosts=1,preload=none,{LOGS}",
            env={**os.environ, "MONARCH_TORCHX_DISABLE_MODULES": "telemetry"},
        )
        on, off = attach("ing-on"), attach("ing-off")
        got: dict = {"telemetry on": [], "telemetry off": [], "stdout to /dev/null (no capture)": []}

        slugs = {"telemetry on": "on", "telemetry off": "off", "stdout to /dev/null (no capture)": "devnull"}

        def printed(p, label, k, argv):
            app = f"ing-{slugs[label]}-{k}"
            out = work / f"{app}.rate"
            argv = [a.replace("OUT", str(out)) for a in argv]
            apps.launch(p, app, "ing", [], [(0, LaunchSpec(app_id=app, role="p", replica_id=0, argv=argv))])
            deadline = time.time() + 300
            while not out.exists() or not out.read_text():
                if time.time() > deadline:
                    raise SystemExit(f"{app}: no rate written within 300 s")
                time.sleep(0.05)
            got[label].append(float(out.read_text()))

        plain = [py, str(work / "printer.py"), str(n_lines), "OUT"]

        def with_telemetry(k: int) -> None:
            printed(on, "telemetry on", k, plain)
            want = (k + 1) * n_lines  # let this run's deferred indexing finish before anything else runs
            while (
                run(on, "SELECT count(*) AS n FROM logs WHERE app_id LIKE 'ing-on-%'").table.to_pylist()[0]["n"] < want
            ):
                time.sleep(0.2)
            time.sleep(1.0)

        def without(k: int) -> None:
            printed(off, "telemetry off", k, plain)
            time.sleep(1.0)

        for k in range(args.n):  # alternate which goes first, so drift does not favour either
            for step in (with_telemetry, without) if k % 2 == 0 else (without, with_telemetry):
                step(k)
            printed(
                off,
                "stdout to /dev/null (no capture)",
                k,
                ["sh", "-c", f"{py} {work / 'printer.py'} {n_lines} OUT > /dev/null"],
            )
            time.sleep(1.0)
        rates = {k: statistics.median(v) for k, v in got.items()}
        sh(torchx, "pool", "stop", "ing-on")
        sh(torchx, "pool", "stop", "ing-off")
    finally:
        for name in ("tel", "ing-on", "ing-off"):
            subprocess.run([str(BIN / "monarch-torchx"), "pool", "stop", name], capture_output=True)
    overhead = 100 * (1 - rates["telemetry on"] / rates["telemetry off"])
    body = "\n".join(
        [
            f"{args.hosts} agents x {args.rows_per_host:,} log rows = {args.hosts * args.rows_per_host:,} rows, one "
            f"monarch_local pool on this machine; median of {args.n} runs.",
            "",
            *rows,
            "",
            "Ingestion, lines/s of a process printing 2M short lines as fast as it can (its own measure):",
            "",
            "| setup | lines/s |",
            "|---|---:|",
            *[f"| {k} | {v:,.0f} |" for k, v in rates.items()],
            "",
            f"Telemetry overhead on a chatty process: {overhead:.1f}% (target < 5%). Indexing waits while a "
            "process's output is flowing (up to 256 MiB of backlog) and catches up when it pauses or at the "
            "next query; "
            "runs are interleaved (on/off alternating which goes first, then /dev/null) and separated so each starts "
            "with nothing left to index; the spread between runs on this VM is about +-20%. On this 2-core "
            "machine the printer and "
            "the agent's pipe reader already use both cores, so any concurrent work shows up here.",
            "Targets: 10M-row filtered aggregate < 1 s; pushdown moves < 1% of the naive bytes (the filtered queries). "
            "An unfiltered GROUP BY still moves the grouping column of every row: aggregates are not yet split into "
            "partial (per host) and final (client) steps.",
        ]
    )
    print(body)
    if not args.no_record:
        record(
            "telemetry",
            f".venv/bin/python benchmarks/telemetry.py --rows-per-host {args.rows_per_host} --n {args.n}",
            body,
        )


if __name__ == "__main__":
    main()
