"""Telemetry SQL over a real pool: DataFusion on every agent and at the client."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess

import pytest
from torchx.runner import get_runner
from torchx.specs import AppDef, Role

from monarch_torchx.errors import MonarchError
from monarch_torchx.pool import attach
from monarch_torchx.telemetry import sql
from monarch_torchx.telemetry.query import plan_pushdown, run

from .conftest import BIN, cli_env, torchx, wait_for

pytestmark = pytest.mark.integration

CHATTY = (
    "import sys\n"
    "for i in range(200): print(f'step {i} loss {\"NaN\" if i % 50 == 7 else i}')\n"
    "print('oops', file=sys.stderr)\n"
)


@pytest.fixture
def busy_pool(home, pool_name):
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=2,preload=none")
    with get_runner() as runner:
        app = AppDef(
            "chatty", roles=[Role(name="c", image=".", entrypoint="python", args=["-c", CHATTY], num_replicas=2)]
        )
        h = runner.run(app, "monarch_local", {"pool": pool_name})
        wait_for(lambda: runner.status(h).is_terminal(), what="chatty app")
    return pool_name


def _sql(home, pool, *args):
    return subprocess.run(
        [str(BIN / "monarch-torchx"), "sql", "--pool", pool, *args],
        env=cli_env(home),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_filtered_aggregate_over_every_host_with_pushdown(busy_pool):
    pool = attach(busy_pool)
    res = run(pool, "SELECT host, count(*) AS n FROM logs WHERE line LIKE '%NaN%' GROUP BY host ORDER BY host")
    assert res.table.to_pylist() == [{"host": 0, "n": 4}, {"host": 1, "n": 4}] and not res.partial
    assert "WHERE" in res.pushed["logs"] and "LIKE '%NaN%'" in res.pushed["logs"]
    everything = run(pool, "SELECT * FROM logs")
    assert everything.table.num_rows == 2 * 201
    assert res.bytes_moved < everything.bytes_moved / 10  # the filter ran on the hosts
    assert sql(pool, "SELECT count(*) AS n FROM logs WHERE stream = 'stderr'").to_pylist() == [{"n": 2}]
    procs = sql(pool, "SELECT host, state, exit_code, role FROM procs WHERE app_id LIKE 'chatty%' ORDER BY host")
    assert procs.to_pylist() == [
        {"host": 0, "state": "SUCCEEDED", "exit_code": 0, "role": "c"},
        {"host": 1, "state": "SUCCEEDED", "exit_code": 0, "role": "c"},
    ]
    ev = sql(pool, "SELECT name, count(*) AS n FROM events WHERE kind = 'replica' GROUP BY name ORDER BY name")
    assert ev.to_pylist() == [{"name": "exit", "n": 2}, {"name": "start", "n": 2}]
    spans = sql(
        pool,
        "SELECT host, name, duration_s FROM events WHERE kind = 'app' AND app_id LIKE 'chatty%' ORDER BY host, name",
    ).to_pylist()
    assert [(s["host"], s["name"]) for s in spans] == [(0, "end"), (0, "launch"), (1, "end"), (1, "launch")]
    assert all(s["duration_s"] > 0 for s in spans if s["name"] == "end")
    assert sql(pool, "SELECT count(*) AS n FROM events WHERE kind = 'pool'").to_pylist() == [{"n": 2}]
    joined = sql(
        pool,
        "SELECT p.state, count(*) AS n FROM logs l JOIN procs p ON l.app_id = p.app_id AND "
        "l.host = p.host AND l.replica = p.replica GROUP BY p.state",
    )
    assert joined.to_pylist() == [{"state": "SUCCEEDED", "n": 402}]


def test_cli_formats_and_default_row_limit(home, busy_pool):
    out = _sql(home, busy_pool, "SELECT host, line FROM logs WHERE line LIKE 'step 1%'")
    assert out.returncode == 0 and "rows, first 100 shown" in out.stderr and len(out.stdout.splitlines()) == 101
    js = _sql(home, busy_pool, "--json", "SELECT host, line FROM logs WHERE line = 'oops'")
    assert sorted(r["host"] for r in json.loads(js.stdout)) == [0, 1]
    csv_out = _sql(home, busy_pool, "--csv", "SELECT count(*) AS n FROM logs")
    assert csv_out.stdout.splitlines() == ["n", "402"]
    arrow_path = home / "out.arrow"
    assert _sql(home, busy_pool, "--arrow", str(arrow_path), "SELECT host, line FROM logs").returncode == 0
    import pyarrow as pa

    assert pa.ipc.open_file(str(arrow_path)).read_all().num_rows == 402
    tables = subprocess.run([str(BIN / "monarch-torchx"), "tables"], capture_output=True, text=True).stdout
    assert "logs" in tables and "procs" in tables and "events" in tables


@pytest.mark.parametrize(
    "query,want",
    [
        ("SELEC 1", "ParserError"),
        ("SELECT nope FROM logs", "No field named nope"),
        ("SELECT * FROM passwd", "table 'datafusion.public.passwd' not found"),
        ("CREATE EXTERNAL TABLE x STORED AS CSV LOCATION '/etc/passwd'", "DDL not supported"),
        ("COPY (SELECT 1) TO '/tmp/x.csv'", "DML not supported"),
        ("SELECT * FROM read_csv('/etc/passwd')", "read_csv"),
    ],
)
def test_bad_or_unsafe_sql_is_one_line_and_touches_nothing(home, busy_pool, query, want):
    with pytest.raises(MonarchError, match="bad query"):
        plan_pushdown(query)
    out = _sql(home, busy_pool, query)
    assert out.returncode == 1 and want in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_a_host_down_gives_a_partial_result_that_says_so(home, busy_pool):
    pool = attach(busy_pool)
    os.kill(pool.hosts[1].pid, signal.SIGKILL)
    res = run(pool, "SELECT host, count(*) AS n FROM logs GROUP BY host", timeout=5)
    assert res.partial and list(res.missing) == [1] and res.table.to_pylist() == [{"host": 0, "n": 201}]
    out = _sql(home, busy_pool, "SELECT count(*) AS n FROM logs")
    assert out.returncode == 0 and "partial result: host 1 is missing" in out.stderr


SPIN = "import time\ndef inner():\n    while True:\n        time.sleep(0.05)\ndef outer():\n    inner()\nouter()\n"


def test_stacks_of_running_replicas_become_rows(home, pool_name, tmp_path):
    (tmp_path / "spin.py").write_text(SPIN)
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=1,preload=none")
    h = (
        torchx(
            home,
            "run",
            "-s",
            "monarch_local",
            "-cfg",
            f"pool={pool_name}",
            "utils.python",
            "--script",
            str(tmp_path / "spin.py"),
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    torchx(home, "run", "-s", "monarch_local", "-cfg", f"pool={pool_name}", "utils.sh", "sleep", "60")
    pool = attach(pool_name)
    wait_for(
        lambda: sql(pool, "SELECT count(*) AS n FROM procs WHERE state = 'RUNNING'").to_pylist()[0]["n"] == 2,
        what="both running",
    )
    out = subprocess.run(
        [str(BIN / "monarch-torchx"), "stacks", "--pool", pool_name],
        env=cli_env(home),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "inner (" in out.stdout and "outer (" in out.stdout and "forkserver" not in out.stdout
    assert "Failed to find python version" in out.stderr  # the shell replica: said, not fatal
    rows = sql(pool, "SELECT depth, function FROM stacks ORDER BY depth").to_pylist()
    assert [r["function"] for r in rows][:3] == ["inner", "outer", "<module>"]
    only = subprocess.run(
        [str(BIN / "monarch-torchx"), "stacks", "--pool", pool_name, "--app", h],
        env=cli_env(home),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "inner (" in only.stdout and "Failed to find" not in only.stderr


def _print_lines(home, pool_name, n):
    with get_runner() as runner:
        app = AppDef(
            "lines",
            roles=[
                Role(name="l", image=".", entrypoint="python", args=["-c", f"for i in range({n}): print('line', i)"])
            ],
        )
        h = runner.run(app, "monarch_local", {"pool": pool_name})
        wait_for(lambda: runner.status(h).is_terminal(), what="printer")


def test_retention_spills_to_parquet_stays_queryable_and_is_bounded(home, pool_name, monkeypatch, tmp_path):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("MONARCH_TORCHX_TELEMETRY_MAX_ROWS", "1000")
    monkeypatch.setenv("MONARCH_TORCHX_TELEMETRY_INDEX_S", "0.2")
    monkeypatch.setenv("MONARCH_TORCHX_TELEMETRY_LAZY_BYTES", "0")  # index before any query
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=1,preload=none")
    for _ in range(3):
        _print_lines(home, pool_name, 2000)
    pool = attach(pool_name)
    spills = f"monarch_torchx-{os.getuid()}/telemetry/*/logs-*.parquet"
    wait_for(lambda: list(tmp_path.glob(spills)), what="a spill to parquet")
    root = tmp_path / f"monarch_torchx-{os.getuid()}"
    assert all(os.stat(d).st_mode & 0o077 == 0 for d in (root, root / "telemetry", *root.glob("telemetry/*")))
    assert sql(pool, "SELECT count(*) AS n FROM logs").to_pylist() == [{"n": 6000}]  # memory + parquet
    assert sql(pool, "SELECT count(*) AS n FROM logs WHERE line = 'line 5'").to_pylist() == [{"n": 3}]
    torchx(home, "pool", "stop", pool_name)
    wait_for(lambda: not root.exists(), what="spill removed with the pool")

    # a spill budget of one byte: what spills is dropped, memory keeps the newest rows
    other = pool_name + "b"
    monkeypatch.setenv("MONARCH_TORCHX_TELEMETRY_MAX_SPILL_BYTES", "1")
    torchx(home, "pool", "create", other, "-cfg", "hosts=1,preload=none")
    _print_lines(home, other, 5000)
    pool = attach(other)
    wait_for(lambda: sql(pool, "SELECT count(*) AS n FROM logs").to_pylist()[0]["n"] <= 1000, what="bounded rows")
    newest = sql(pool, "SELECT max(line) AS l FROM logs WHERE line = 'line 4999'").to_pylist()
    assert newest == [{"l": "line 4999"}]


def test_background_indexing_keeps_every_attempt_of_a_retried_replica_and_every_ended_app(
    home, pool_name, monkeypatch, tmp_path
):
    """An ended replica's log files are not stat'ed again (their final sizes are remembered); a
    replica that fails and is retried writes to the same files again, and both attempts' lines,
    and those of apps that ended before, are indexed in the background."""
    monkeypatch.setenv("MONARCH_TORCHX_TELEMETRY_INDEX_S", "0.2")
    monkeypatch.setenv("MONARCH_TORCHX_TELEMETRY_LAZY_BYTES", "0")  # index in the background, before any query
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=1,preload=none")
    for _ in range(3):
        _print_lines(home, pool_name, 10)
    flag = tmp_path / "second-attempt"
    retried = (
        f"import pathlib, sys\nf = pathlib.Path({str(flag)!r})\n"
        "if f.exists():\n    print('attempt two')\nelse:\n    f.touch(); print('attempt one'); sys.exit(3)\n"
    )
    with get_runner() as runner:
        app = AppDef(
            "retried", roles=[Role(name="r", image=".", entrypoint="python", args=["-c", retried], max_retries=1)]
        )
        h = runner.run(app, "monarch_local", {"pool": pool_name})
        wait_for(lambda: runner.status(h).is_terminal(), what="the retried app")
        assert runner.status(h).state.name == "SUCCEEDED"
    pool = attach(pool_name)
    indexed = (
        "SELECT line, count(*) AS n FROM logs WHERE line IN ('line 9', 'attempt one', 'attempt two') GROUP BY line"
    )
    wait_for(
        lambda: (
            sorted(map(tuple, (r.values() for r in sql(pool, indexed).to_pylist())))
            == [("attempt one", 1), ("attempt two", 1), ("line 9", 3)]
        ),
        what="every attempt's lines indexed",
    )
    _print_lines(home, pool_name, 10)  # an app after those: its lines come in too
    wait_for(
        lambda: sql(pool, "SELECT count(*) AS n FROM logs WHERE line = 'line 9'").to_pylist() == [{"n": 4}],
        what="a later app's lines indexed",
    )


def test_metrics_are_sampled_for_hosts_and_running_replicas(home, pool_name, monkeypatch):
    monkeypatch.setenv("MONARCH_TORCHX_METRICS_S", "0.2")
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=2,preload=none")
    torchx(home, "run", "-s", "monarch_local", "-cfg", f"pool={pool_name}", "utils.sh", "sleep", "30")
    pool = attach(pool_name)

    def names():
        return {r["name"] for r in sql(pool, "SELECT DISTINCT name FROM metrics").to_pylist()}

    wait_for(lambda: {"host.load1", "host.mem_used_bytes", "proc.cpu_s", "proc.rss_bytes"} <= names(), what="metrics")
    rss = sql(pool, "SELECT host, value, labels FROM metrics WHERE name = 'proc.rss_bytes' LIMIT 1").to_pylist()[0]
    assert rss["host"] == 0 and rss["value"] > 0 and json.loads(rss["labels"])["role"] == "sh"
    hosts = sql(pool, "SELECT DISTINCT host FROM metrics WHERE name = 'host.load1' ORDER BY host").to_pylist()
    assert hosts == [{"host": 0}, {"host": 1}]


def test_stacks_of_a_process_that_exits_meanwhile_is_named_not_fatal(home, pool_name):
    """Its fork server is paused so the exit is not reported yet: py-spy meets a dead process."""
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=1,preload=none")
    torchx(
        home,
        "run",
        "-s",
        "monarch_local",
        "-cfg",
        f"pool={pool_name}",
        "utils.python",
        "-c",
        "import time; time.sleep(600)",
    )
    pool = attach(pool_name)
    pid = wait_for(
        lambda: next(
            iter(r["pid"] for r in sql(pool, "SELECT pid FROM procs WHERE state = 'RUNNING'").to_pylist()), None
        ),
        what="running replica",
    )
    with open(f"/proc/{pid}/stat") as f:
        server = int(f.read().rsplit(")", 1)[1].split()[1])
    os.kill(server, signal.SIGSTOP)
    try:
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z", what="zombie")
        out = subprocess.run(
            [str(BIN / "monarch-torchx"), "stacks", "--pool", pool_name],
            env=cli_env(home),
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        os.kill(server, signal.SIGCONT)
    assert out.returncode == 0 and "Traceback" not in out.stderr
    assert f"pid {pid}:" in out.stderr and "no Python stacks" in out.stderr


def _running_below(pid: int) -> list:
    """Processes (not zombies) descended from ``pid``: a query server's queries and their supervisors."""
    children: dict = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if state != "Z":
            children.setdefault(int(ppid), []).append(int(p))
    found, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


WIDE = "for i in range(4000): print(f'line {i:05d} ' + 'x' * 20)\n"  # 4,000 lines of 31 characters


def _pool_that_printed(home, pool_name: str, code: str) -> None:
    """A 1-host pool whose one app ran ``python -c code`` to its end (its output is in ``logs``)."""
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=1,preload=none")
    with get_runner() as runner:
        app = AppDef("printer", roles=[Role(name="p", image=".", entrypoint="python", args=["-c", code])])
        h = runner.run(app, "monarch_local", {"pool": pool_name})
        wait_for(lambda: runner.status(h).is_terminal(), what="printer")


def _query_processes(agent: int) -> list:
    """The agent's query server and the query processes under it."""
    out = []
    for p in _running_below(agent):
        with contextlib.suppress(OSError), open(f"/proc/{p}/cmdline", "rb") as f:
            if b"monarch_torchx.telemetry.sandbox" in f.read():
                out.append(p)
    return out


def test_a_query_over_the_memory_limit_fails_alone_and_the_agent_and_its_jobs_live_on(home, pool_name, monkeypatch):
    """``repeat(line, 20000)`` asks for ~1.2 GB per batch of 2,048 rows; the hosts' query budget
    is 256 MiB. The query fails in one line; the agent, its replica and its tables are still there."""
    from monarch_torchx.telemetry.sandbox import QueryOutOfMemory

    monkeypatch.setenv("MONARCH_TORCHX_SQL_MEMORY_MB", "256")
    _pool_that_printed(home, pool_name, WIDE)
    torchx(home, "run", "-s", "monarch_local", "-cfg", f"pool={pool_name}", "utils.sh", "sleep", "120")
    pool = attach(pool_name)
    agent = pool.hosts[0].pid
    running = "SELECT role, state FROM procs WHERE state = 'RUNNING'"
    wait_for(lambda: sql(pool, running).to_pylist() == [{"role": "sh", "state": "RUNNING"}], what="a running replica")

    blow = "SELECT sum(length(repeat(line, 20000))) AS n FROM logs"
    with pytest.raises(QueryOutOfMemory, match="256 MiB"):  # partial aggregates: one answer per host
        run(pool, blow)
    with pytest.raises(QueryOutOfMemory, match="query stopped on host 0"):  # a filter of rows streamed from the host
        run(pool, "SELECT line FROM logs WHERE length(repeat(line, 20000)) > 1", per_subtree=False)
    out = _sql(home, pool_name, blow)
    assert out.returncode == 1 and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert "MONARCH_TORCHX_SQL_MEMORY_MB" in out.stderr

    os.kill(agent, 0)  # the same agent, alive and answering; its replica runs on
    assert attach(pool_name).hosts[0].pid == agent
    assert sql(pool, running).to_pylist() == [{"role": "sh", "state": "RUNNING"}]
    assert sql(pool, "SELECT count(*) AS n, max(length(line)) AS w FROM logs WHERE line LIKE 'line %'").to_pylist() == [
        {"n": 4000, "w": 31}
    ]
    assert sql(pool, "SELECT sum(length(repeat(line, 10))) AS n FROM logs WHERE line LIKE 'line %'").to_pylist() == [
        {"n": 4000 * 310}
    ]


LONG = "for i in range(2000): print(f'{i:05d} ' + ''.join(chr(97 + (i * j) % 26) for j in range(3000)))\n"


def test_a_host_s_query_past_its_time_limit_is_stopped_there(home, pool_name, monkeypatch):
    """``levenshtein`` of 3,000-character lines costs ~10 ms a row on one thread: 2,000 rows are
    far past the hosts' 2 s limit. The host is named with why, its query process is gone (its work
    stopped, not only the waiting for it), and it answers the next query."""
    monkeypatch.setenv("MONARCH_TORCHX_SQL_TIMEOUT_S", "2")
    monkeypatch.setenv("MONARCH_TORCHX_SQL_THREADS", "1")
    _pool_that_printed(home, pool_name, LONG)
    pool = attach(pool_name)
    agent = pool.hosts[0].pid
    assert sql(pool, "SELECT count(*) AS n FROM logs WHERE length(line) > 3000").to_pylist() == [{"n": 2000}]
    with pytest.raises(MonarchError, match="host 0: it ran past its time limit of 2 s and was stopped"):
        run(pool, "SELECT count(*) AS n FROM logs WHERE levenshtein(line, reverse(line)) > 1")

    wait_for(lambda: len(_query_processes(agent)) == 1, what="only the query server left: the query process killed")
    assert sql(pool, "SELECT count(*) AS n FROM logs WHERE length(line) > 3000").to_pylist() == [{"n": 2000}]


def test_a_join_at_the_client_is_stopped_at_its_timeout_and_has_a_row_limit(home, pool_name):
    """A self-join of the hosts' rows is finished at the client: ``--timeout`` stops its work (the
    query process is gone when the error is raised), and an answer past the row limit is refused."""
    from monarch_torchx.telemetry.sandbox import QueryTimedOut, QueryTooManyRows

    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=1,preload=none")
    _print_lines(home, pool_name, 3000)
    pool = attach(pool_name)
    wait_for(lambda: sql(pool, "SELECT count(*) AS n FROM logs").to_pylist() == [{"n": 3000}], what="lines indexed")
    cube = "SELECT count(*) AS n FROM logs a JOIN logs b ON a.host = b.host JOIN logs c ON b.host = c.host"  # 2.7e10
    with pytest.raises(QueryTimedOut, match="--timeout"):
        run(pool, cube, timeout=3)
    from monarch_torchx.telemetry import query

    wait_for(lambda: _running_below(query._SERVER.proc.pid) == [], what="its work stopped, not only the waiting")
    out = _sql(home, pool_name, "--timeout", "3", cube)
    assert out.returncode == 1 and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert "--timeout" in out.stderr

    pairs = "SELECT a.line AS x, b.line AS y FROM logs a JOIN logs b ON a.host = b.host"  # 9,000,000 rows
    with pytest.raises(QueryTooManyRows, match="1,000 rows"):
        run(pool, pairs, max_rows=1000)
    env = {**cli_env(home), "MONARCH_TORCHX_SQL_MAX_ROWS": "1000"}
    out = subprocess.run(
        [str(BIN / "monarch-torchx"), "sql", "--pool", pool_name, pairs],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        out.returncode == 1
        and len(out.stderr.strip().splitlines()) == 1
        and "MONARCH_TORCHX_SQL_MAX_ROWS" in out.stderr
    )
    assert run(pool, "SELECT count(*) AS n FROM logs l JOIN procs p ON l.app_id = p.app_id").table.to_pylist() == [
        {"n": 3000}
    ]


def test_a_query_process_is_killed_at_its_time_limit(tmp_path):
    """The agent's driver (asyncio): a query past its time limit is killed, and says so."""
    import asyncio

    import pyarrow as pa

    from monarch_torchx.telemetry.sandbox import Inputs, Limits, QueryServer, QueryTimedOut, run_query

    rows = pa.table({"k": pa.array([0] * 3000, pa.int32())})
    inputs = Inputs()
    inputs.add_table("t", rows)
    limits = Limits(memory_bytes=256 << 20, timeout_s=1.0, batch_rows=2048, threads=2)

    server = QueryServer(tmp_path)

    async def answer() -> list:
        return [
            f
            async for f in run_query(
                server,
                "SELECT count(*) FROM t a JOIN t b ON a.k = b.k JOIN t c ON b.k = c.k",
                inputs,
                limits,
                tmp_path / "spill",
            )
        ]

    try:
        with pytest.raises(QueryTimedOut, match="1 s"):
            asyncio.run(answer())
        assert inputs.fds == []
        assert list((tmp_path / "spill").iterdir()) == []  # its private work directory went with it
        wait_for(lambda: _running_below(server.proc.pid) == [], what="the query process gone")
    finally:
        server.close()


def test_an_idle_agent_ends_its_query_server_and_the_next_query_starts_it_again(home, pool_name, monkeypatch):
    """A host of a large pool must not keep a DataFusion process for a query it answered once."""
    # (the time limit counts the query server's start too: 1 s was too short for it on a loaded machine)
    monkeypatch.setenv("MONARCH_TORCHX_SQL_TIMEOUT_S", "5")
    monkeypatch.setenv("MONARCH_TORCHX_SQL_SERVER_IDLE_S", "1")  # (at least the time limit + 5 s: 10 s)
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=1,preload=none")
    pool = attach(pool_name)
    agent = pool.hosts[0].pid

    assert sql(pool, "SELECT count(*) AS n FROM procs").num_rows == 1
    assert _query_processes(agent)  # the server (and maybe the query's process, ending)
    wait_for(lambda: not _query_processes(agent), timeout=30, what="the idle query server to end")
    assert sql(pool, "SELECT count(*) AS n FROM procs").num_rows == 1
