"""Telemetry aggregates answered per subtree (monarch_torchx/telemetry/partial.py) on a real pool of agents.

10 local agents with the relay tree forced on and a fan-out of 2, so partial aggregates are
merged at several levels of relays before the client finishes the query. Each answer is checked
against the same query answered the old way (every host's filtered rows, finished at the client).
"""

from __future__ import annotations

import os
import signal
import uuid

import pytest
from torchx.runner import get_runner
from torchx.specs import AppDef, Role

import monarch_torchx.net.fanout as relay
from monarch_torchx.errors import MonarchError
from monarch_torchx.pool import attach
from monarch_torchx.telemetry.query import run

from .conftest import module_pool, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("test_sql_tree")]  # (its module-wide pool: one worker)

HOSTS = 10
CHATTY = (
    "import os, sys\n"
    "h = int(os.environ['MONARCH_TORCHX_HOST_INDEX'])\n"
    "for i in range(20 + 7 * h): print(f'step {i} loss {\"NaN\" if i % 5 == 0 else i}')\n"
    "print('oops', file=sys.stderr)\n"
)

QUERIES = [
    "SELECT count(*) AS n FROM logs",
    "SELECT host, count(*) AS n FROM logs GROUP BY host ORDER BY n DESC, host LIMIT 4",
    "SELECT stream, avg(length(line)) AS a, max(ts) AS last, min(line) AS first, sum(replica) AS r "
    "FROM logs WHERE line LIKE '%NaN%' OR stream = 'stderr' GROUP BY stream HAVING count(*) > 3 ORDER BY stream",
    "SELECT count(DISTINCT host) AS hosts FROM logs",
    "SELECT count(DISTINCT line) AS n FROM logs",
    "SELECT host % 3 AS k, count(*) AS n, avg(pid) AS p FROM logs GROUP BY host % 3 ORDER BY k",
    "SELECT state, count(*) AS n FROM procs GROUP BY state",
    "SELECT max(ts) AS t FROM events WHERE kind = 'nothing like this'",
    "SELECT host, count(*) AS n FROM logs GROUP BY host ORDER BY host LIMIT 3 OFFSET 2",
]


@pytest.fixture(scope="module")
def tree_pool(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MONARCH_TORCHX_TREE_MIN_HOSTS", "2")
        mp.setattr(relay, "FANOUT", 2)
        with module_pool(tmp_path_factory, f"sqltree{uuid.uuid4().hex[:6]}", HOSTS, preload="none") as (name, _):
            with get_runner() as runner:
                app = AppDef(
                    "chatty",
                    roles=[Role(name="c", image=".", entrypoint="python", args=["-c", CHATTY], num_replicas=HOSTS)],
                )
                h = runner.run(app, "monarch_local", {"pool": name})
                wait_for(lambda: runner.status(h).is_terminal(), what="chatty app")
            yield attach(name)


@pytest.mark.parametrize("sql", QUERIES)
def test_an_aggregate_merged_by_relays_equals_the_one_finished_from_every_row(tree_pool, sql):
    merged = run(tree_pool, sql)
    rows = run(tree_pool, sql, per_subtree=False)
    assert merged.table.schema.names == rows.table.schema.names
    assert merged.table.to_pylist() == rows.table.to_pylist()
    assert merged.hosts == rows.hosts == list(range(HOSTS)) and not merged.partial
    # the client read one answer per group of its tree (2), not one per host (10)
    assert merged.answers <= 2 < rows.answers


BOUNDED = [  # (query, whether its LIMIT goes to the hosts)
    ("SELECT host, line FROM logs WHERE line LIKE '%NaN%' ORDER BY ts DESC, host, line LIMIT 7", True),
    ("SELECT line, host FROM logs WHERE stream = 'stderr' ORDER BY host LIMIT 3 OFFSET 2", True),
    ("SELECT line, host FROM logs ORDER BY length(line) DESC, host, line LIMIT 4", True),
    # a sort key that is an alias, here one that hides a column of the same name: not pushed
    ("SELECT length(line) AS ts, line, host FROM logs ORDER BY ts DESC, line, host LIMIT 3", False),
    ("SELECT upper(line) AS line, host FROM logs ORDER BY line, host LIMIT 3", False),
]


@pytest.mark.parametrize("sql,pushed", BOUNDED)
def test_a_limit_cuts_each_subtree_and_answers_as_every_row_would(tree_pool, sql, pushed):
    cut = run(tree_pool, sql)
    rows = run(tree_pool, sql, per_subtree=False)
    assert ("LIMIT" in next(iter(cut.pushed.values()))) == pushed
    assert "LIMIT" not in next(iter(rows.pushed.values()))
    assert cut.table.to_pylist() == rows.table.to_pylist() and cut.hosts == rows.hosts == list(range(HOSTS))
    if pushed:
        assert cut.answers <= 2 < rows.answers and cut.bytes_moved < rows.bytes_moved


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT count(*) AS n FROM logs WHERE pid > (SELECT avg(pid) FROM logs) - 1000000 AND length(line) > "
        "(SELECT avg(length(line)) FROM logs)",
        "SELECT host, line FROM logs WHERE length(line) > (SELECT avg(length(line)) FROM logs) "
        "ORDER BY length(line) DESC, host, line LIMIT 3",
    ],
)
def test_a_subquery_in_a_filter_is_answered_over_every_host_s_rows(tree_pool, sql):
    """Each host alone would compare its lines with its own average: the tables come whole."""
    from monarch_torchx.telemetry.query import _empty_ctx, read_only_options

    got = run(tree_pool, sql)
    assert all(q.startswith("SELECT * FROM") for q in got.pushed.values())
    every = run(tree_pool, "SELECT * FROM logs", timeout=30).table
    ctx = _empty_ctx()
    ctx.deregister_table("logs")
    ctx.register_record_batches("logs", [every.to_batches()])
    assert got.table.to_pylist() == ctx.sql_with_options(sql, read_only_options()).to_arrow_table().to_pylist()


def test_a_limit_of_nothing_answers_nothing(tree_pool):
    assert run(tree_pool, "SELECT * FROM logs LIMIT 0").table.num_rows == 0


def test_a_limit_without_an_order_gives_that_many_matching_rows(tree_pool):
    got = run(tree_pool, "SELECT host, line FROM logs WHERE line LIKE 'step%' LIMIT 5")
    assert got.table.num_rows == 5 and all(r["line"].startswith("step") for r in got.table.to_pylist())
    assert got.answers <= 2


def test_a_group_by_over_every_row_moves_groups_not_rows(tree_pool):
    sql = "SELECT line, count(*) AS n FROM logs GROUP BY line ORDER BY n DESC, line LIMIT 5"
    merged, rows = run(tree_pool, sql), run(tree_pool, sql, per_subtree=False)
    assert merged.table.to_pylist() == rows.table.to_pylist()
    assert merged.table.to_pylist()[0] == {"line": "oops", "n": HOSTS}
    assert merged.bytes_moved < rows.bytes_moved / 2


def test_queries_that_do_not_decompose_are_answered_from_rows(tree_pool):
    for sql in (
        "SELECT count(*) FILTER (WHERE stream = 'stderr') AS n FROM logs",
        "SELECT median(length(line)) AS n FROM logs",
        "SELECT l.host, count(*) AS n FROM logs l JOIN procs p ON l.host = p.host GROUP BY l.host",
    ):
        res = run(tree_pool, sql)
        assert res.answers == HOSTS * len(res.pushed), sql  # per host: the rows path
    assert run(tree_pool, "SELECT count(*) FILTER (WHERE stream = 'stderr') AS n FROM logs").table.to_pylist() == [
        {"n": HOSTS}
    ]


def test_bad_sql_is_one_line_and_a_hung_host_is_named_missing(tree_pool):
    with pytest.raises(MonarchError, match="bad query"):
        run(tree_pool, "SELECT count(*) FROM nowhere")
    victim = 1  # a relay: host 0 leads the first group, 1 leads the rest of it
    pid = tree_pool.hosts[victim].pid
    os.kill(pid, signal.SIGSTOP)
    bounded = "SELECT host, line FROM logs WHERE stream = 'stderr' ORDER BY host LIMIT 20"
    try:
        res = run(tree_pool, "SELECT count(*) AS n FROM logs", timeout=6.0)
        cut = run(tree_pool, bounded, timeout=6.0)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert list(res.missing) == [victim] and res.hosts == [i for i in range(HOSTS) if i != victim]
    assert list(cut.missing) == [victim] and [r["host"] for r in cut.table.to_pylist()] == res.hosts
    per_host = {
        r["host"]: r["n"]
        for r in run(tree_pool, "SELECT host, count(*) AS n FROM logs GROUP BY host").table.to_pylist()
    }
    assert res.table.to_pylist() == [{"n": sum(n for h, n in per_host.items() if h != victim)}]
