"""Client side of telemetry: one SQL question over every host of a pool, answered in place.

DataFusion plans the query here against empty tables of the documented schemas. An aggregate
that decomposes (``partial.py``) is answered per subtree: every host computes partial
aggregates of its rows, the pool's relay tree merges them on the way up (``Pool.ask``), and the
client finishes. Any other query: each table scan, with the filters and limit DataFusion put
right above it, is turned back into SQL and sent to every host, where DataFusion runs it over
that host's tables; the hosts' Arrow results are registered here under the same table names and
the original query (joins, aggregates, order) finishes at the client. A host that does not
answer within the timeout is left out and named in the result, never waited for forever.

Every host runs its part in a query process of its own, under that host's memory and time
limits, and what the client finishes (joins, sorts, windows over the hosts' rows) runs in one too,
under the caller's ``timeout`` (which it is stopped at, not only waited for) and a row limit
(``sandbox.py``). A query over a limit fails alone, in one line.

A ``LIMIT`` (or an ``ORDER BY ... LIMIT``) right above a table's filters bounds what any host
has to send: each host returns at most that many rows (its own top ones), and the relay tree
cuts every subtree's rows to as many on the way up, so "the last 20 errors of 1,024 hosts"
moves about 20 rows per connection. An unbounded scan streams from each host to the client.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .. import net
from ..errors import MonarchError
from .arrow_ipc import from_ipc
from .partial import PartialAggregate, merge, plan_partial
from .sandbox import (
    STOPPED,
    Inputs,
    Limits,
    QueryFailed,
    QueryOutOfMemory,
    QueryServer,
    QueryStopped,
    QueryTimedOut,
    QueryTooManyRows,
    client_limits,
    collect_query,
    read_only_options,  # noqa: F401 (where callers have found it)
)
from .sandbox import one_line as _one_line
from .schema import TABLES, arrow_schema

DEFAULT_TIMEOUT_S = 30.0
# a LIMIT above this is not cut by relays: each would hold its subtree's rows in memory at once,
# where the hosts' rows stream to the client
MAX_CUT_ROWS = 100_000
# functions that answer differently each time: a relay running the hosts' query again would
# filter a second time
VOLATILE = ("random(", "uuid(")
# a host's error that is the query's own (its memory, DataFusion's refusal): every host would meet
# it, so the query fails; a host that did not answer in time is named missing instead
QUERYS_OWN = (QueryOutOfMemory, QueryFailed, QueryTooManyRows)


@dataclass
class QueryResult:
    table: Any  # pyarrow.Table
    hosts: list[int]
    missing: dict[int, str] = field(default_factory=dict)  # host -> why it is not in the result
    bytes_moved: int = 0
    pushed: dict[str, str] = field(default_factory=dict)  # table -> the SQL each host ran
    answers: int = 0  # Arrow answers the client read: one per host and table, or one per subtree merged by relays

    @property
    def partial(self) -> bool:
        return bool(self.missing)


def _empty_ctx() -> Any:
    import pyarrow as pa
    from datafusion import SessionContext

    ctx = SessionContext()
    for name in TABLES:
        schema = arrow_schema(name)
        ctx.register_record_batches(name, [[pa.record_batch([pa.array([], f.type) for f in schema], schema=schema)]])
    return ctx


def _plan(sql: str) -> Any:
    """The optimized logical plan of ``sql``; MonarchError for bad or non-read-only SQL."""
    try:
        return _empty_ctx().sql_with_options(sql, read_only_options()).optimized_logical_plan()
    except Exception as e:  # DataFusion's own message, one line
        raise MonarchError(f"bad query: {_one_line(e)}") from None


@dataclass(frozen=True)
class Pushdown:
    """What every host runs for one table, and whether a LIMIT bounds its rows (then relays may
    run it again over their subtree's rows: its filters hold already, and its limit cuts them)."""

    sql: str
    bounded: bool = False


def plan_pushdown(sql: str, plan: Any = None) -> dict[str, str]:
    """table -> the SQL every host runs for it. Raises MonarchError for bad or non-read-only SQL."""
    return {name: p.sql for name, p in pushdowns(sql, plan).items()}


def _kind(node: Any) -> str:
    return type(node.to_variant()).__name__


def _int(expr: Any) -> Any:
    """A LIMIT's skip or fetch as an int (None where it is absent or not a plain literal)."""
    try:
        return None if expr is None else int(expr.to_variant().value_i64())
    except Exception:  # noqa: BLE001 (another DataFusion version's expression: no bound, not an error)
        return None


def _scan_below(node: Any) -> Any:
    """The Filter (or TableScan) under ``node``'s row-wise projections, if that is all there is."""
    while _kind(node) == "Projection":
        node = node.inputs()[0]
    sub = node
    while _kind(sub) == "Filter":
        sub = sub.inputs()[0]
    return node if _kind(sub) == "TableScan" and _kind(node) in ("Filter", "TableScan") else None


def _cuttable(text: str, rows: int) -> bool:
    """Whether relays may run a host query bounded to ``rows`` again over their subtree's rows."""
    return rows <= MAX_CUT_ROWS and not any(f in text.lower() for f in VOLATILE)


def _bounded(node: Any, unparser: Any) -> Any:
    """(table, host SQL) for a LIMIT or a top-k sort right above a table's filters: each host
    returns the rows it could contribute (its first, or its top, skip + fetch), with every column
    the query above reads. None when the plan has any other shape."""
    kind = _kind(node)
    if kind == "Limit":
        v = node.to_variant()
        fetch, skip = _int(v.fetch()), _int(v.skip()) or 0
        child = node.inputs()[0]
        while _kind(child) == "Projection":
            child = child.inputs()[0]
        if _kind(child) == "Sort":
            return _bounded(child, unparser)
        base = _scan_below(child)
        if fetch is None or base is None:
            return None
        rows = skip + fetch
        text = f"{unparser.plan_to_sql(base)} LIMIT {rows}"
    elif kind == "Sort":
        base = _scan_below(node.inputs()[0])
        rows = node.to_variant().get_fetch_val()
        if rows is None or base is None:
            return None
        between = node.inputs()[0]
        while _kind(between) == "Projection":  # a sort key must name the table's own column, not an alias
            if any(_kind(e) != "Column" for e in between.to_variant().projections()):
                return None
            between = between.inputs()[0]
        # the sort's own SQL is its input's, then ORDER BY ... LIMIT: that tail, over the filters'
        # rows with all their columns (a projection between may have dropped a filter's column)
        whole, head = str(unparser.plan_to_sql(node)), str(unparser.plan_to_sql(node.inputs()[0]))
        if not whole.startswith(head) or not whole[len(head) :].lstrip().upper().startswith("ORDER BY"):
            return None
        text = f"{unparser.plan_to_sql(base)}{whole[len(head) :]}"
    else:
        return None
    if not _cuttable(text, rows):
        return None
    sub = base
    while _kind(sub) == "Filter":
        sub = sub.inputs()[0]
    try:
        _plan(text)  # what a host will run, planned here first: any doubt, and the scan is not bounded
    except MonarchError:
        return None
    return sub.to_variant().table_name(), text


def pushdowns(sql: str, plan: Any = None, bound: bool = True) -> dict[str, Pushdown]:
    """table -> what every host runs for it (``bound=False``: filters only, never a LIMIT above
    them). Raises MonarchError for bad or non-read-only SQL."""
    from datafusion.unparser import Dialect, Unparser

    plan = plan if plan is not None else _plan(sql)
    shown = plan.display_indent()
    if "<subquery>" in shown:
        # a subquery inside an expression would run on each host over that host's rows alone:
        # every table the query reads comes whole, and the query runs here
        return {name: Pushdown(f'SELECT * FROM "{name}"') for name in re.findall(r"TableScan: (\w+)", shown)}
    unparser = Unparser(Dialect.default())
    scans: list[tuple[str, str, bool]] = []

    def walk(node: Any) -> None:
        kind = _kind(node)
        if bound and kind in ("Limit", "Sort"):
            bounded = _bounded(node, unparser)
            if bounded is not None:
                scans.append((bounded[0], bounded[1], True))
                return
        if kind in ("Filter", "TableScan"):
            sub = node
            while _kind(sub) == "Filter":
                sub = sub.inputs()[0]
            if _kind(sub) == "TableScan":  # (a HAVING filter is above an aggregate)
                text = str(unparser.plan_to_sql(node))
                fetch = sub.to_variant().fetch()
                scans.append(
                    (sub.to_variant().table_name(), text, bound and fetch is not None and _cuttable(text, fetch))
                )
                return
        for child in node.inputs():
            walk(child)

    walk(plan)
    counts: dict[str, int] = {}
    for name, _, _ in scans:
        counts[name] = counts.get(name, 0) + 1
    pushed = {}
    for name, text, bounded in scans:
        # a table read twice (a self-join) with different filters: fetch it whole, once
        pushed[name] = Pushdown(text, bounded) if counts[name] == 1 else Pushdown(f'SELECT * FROM "{name}"')
    return pushed


def _missing_why(err: Exception) -> str:
    if isinstance(err, net.UnknownOperation):
        return (
            "the telemetry module is not loaded on this host, or its agent predates this query's "
            "operation (see its agent log; `torchx pool stop` and a new pool bring every host up to date)"
        )
    if isinstance(err, net.RemoteError) and err.raised(TypeError):
        return f"its agent predates this client ({err}; `torchx pool stop` and a new pool bring every host up to date)"
    return str(err)


def _missing(answers: list[tuple[int, Any, Exception | None]]) -> dict[int, str]:
    """Hosts that gave no answer, and why. A host's error that is the query's own (``QUERYS_OWN``)
    is raised as the query's, naming the host."""
    missing: dict[int, str] = {}
    for i, _, err in answers:
        if err is None:
            continue
        kind = STOPPED.get(err.kind) if isinstance(err, net.RemoteError) else None  # (its type, off the wire)
        if kind is not None and issubclass(kind, QUERYS_OWN):
            raise kind(f"query stopped on host {i}: {err}") from None
        missing[i] = _missing_why(err)
    return missing


def _host_time(deadline: float) -> float:
    """The time limit a host gets for its part: a little less than what is left, so that its own
    "stopped after N s" arrives before the client stops waiting."""
    left = deadline - time.monotonic()
    return max(0.0, left - min(1.0, 0.1 * left))


def run(
    pool: Any, sql: str, timeout: float = DEFAULT_TIMEOUT_S, per_subtree: bool = True, max_rows: int | None = None
) -> QueryResult:
    """Runs ``sql`` over the pool's hosts; returns the answer and which hosts are missing from it.
    ``per_subtree=False`` leaves the relays out: every host's filtered rows come to the client
    (no partial aggregates, no LIMIT cut per subtree), the reference the other ways are checked
    against. ``timeout`` bounds the whole query: hosts that have not answered by then are named
    missing, and work left at the client is stopped (``QueryTimedOut``). An answer of more than
    ``max_rows`` rows (``MONARCH_TORCHX_SQL_MAX_ROWS``, 10,000,000) is refused (``QueryTooManyRows``)."""
    deadline = time.monotonic() + timeout
    limits = client_limits(timeout, max_rows)
    plan = _plan(sql)
    # a subquery inside an expression (``WHERE pid > (SELECT avg(pid) ...)``) is over every host's
    # rows: never decomposed per host (``pushdowns`` then brings the tables it reads whole)
    partial = plan_partial(plan) if per_subtree and "<subquery>" not in plan.display_indent() else None
    if partial is not None:
        return _run_partial(pool, sql, partial, timeout, deadline, limits)
    return _run_rows(pool, sql, pushdowns(sql, plan, bound=per_subtree), timeout, deadline, limits)


def _run_partial(
    pool: Any, sql: str, partial: PartialAggregate, timeout: float, deadline: float, limits: Limits
) -> QueryResult:
    """Partial aggregates from every host, merged per subtree by the relays and here (their rows
    are groups: what the client does with them costs what they do)."""
    n = pool.record.num_hosts
    answers = pool.ask(
        "telemetry.partial",
        range(n),
        timeout=timeout,
        sql=partial.host_sql,
        table=partial.table,
        merge=partial.merge_sql,
        timeout_s=_host_time(deadline),
    )
    missing = _missing(answers)
    ok = [i for i, _, err in answers if err is None]
    if not ok:
        raise MonarchError("no host answered: " + "; ".join(f"host {i}: {why}" for i, why in missing.items()))
    values = [v for _, v, err in answers if err is None and v is not None]  # None: merged into another's
    try:
        answer = partial.finish(merge([from_ipc([v]) for v in values], partial.merge_sql))
    except Exception as e:  # DataFusion's own message, one line
        raise MonarchError(f"bad query: {_one_line(e)}") from None
    if limits.max_rows and answer.num_rows > limits.max_rows:
        raise QueryTooManyRows(
            f"query stopped: its answer has {answer.num_rows:,} rows, more than "
            f"{limits.max_rows:,} (MONARCH_TORCHX_SQL_MAX_ROWS); add a LIMIT or filters"
        )
    return QueryResult(answer, ok, missing, sum(len(v) for v in values), {partial.table: partial.host_sql}, len(values))


def _run_rows(
    pool: Any, sql: str, pushed: dict[str, Pushdown], timeout: float, deadline: float, limits: Limits
) -> QueryResult:
    """Every host's filtered rows, here; the query finishes at the client. One table bounded by a
    LIMIT is asked through the relay tree, each subtree's rows cut to the limit on the way; any
    other scan is streamed from each host."""
    import pyarrow as pa

    n = pool.record.num_hosts
    per_host: dict[int, dict[str, Any]] = {i: {} for i in range(n)}
    parts: dict[str, list[Any]] = {}
    missing: dict[int, str] = {}
    moved = answers = 0

    def fetch(i: int, q: str, t: str) -> tuple[Any, int]:
        """One host's answer, streamed back as Arrow IPC chunks."""
        with pool.connect(i) as client:
            client.settimeout(timeout)
            chunks = list(client.stream("telemetry.query", sql=q, tables=[t], timeout_s=_host_time(deadline)))
        return from_ipc(chunks), sum(len(c) for c in chunks)

    if len(pushed) == 1 and next(iter(pushed.values())).bounded:
        # (one table only: a host missing from one table of several must be missing from all)
        name, p = next(iter(pushed.items()))
        parts[name] = []
        answered = pool.ask(
            "telemetry.rows", range(n), timeout=timeout, sql=p.sql, table=name, timeout_s=_host_time(deadline)
        )
        missing = _missing(answered)
        for i, value, err in answered:  # noqa: B007
            if err is None and value is not None:  # None: this host's rows are in another's, cut with its subtree's
                parts[name].append(from_ipc([value]))
                moved += len(value)
                answers += 1
    else:
        for name, p in pushed.items():
            fetched = pool.fan_out(lambda i, q=p.sql, t=name: fetch(i, q, t), range(n))
            for i, why in _missing(fetched).items():
                missing.setdefault(i, why)
            for i, got, err in fetched:
                if err is None:
                    per_host[i][name], size = got
                    moved += size
        ok_hosts = [i for i in range(n) if i not in missing]
        parts = {name: [per_host[i][name] for i in ok_hosts] for name in pushed}
        answers = len(ok_hosts) * len(pushed)
    ok = [i for i in range(n) if i not in missing]
    if not ok:
        raise MonarchError("no host answered: " + "; ".join(f"host {i}: {why}" for i, why in missing.items()))
    tables = {name: pa.concat_tables(parts[name]) if parts[name] else pa.table({}) for name in pushed}
    del parts, per_host  # the query process maps its own copy
    answer = _finish_at_client(sql, tables, timeout, deadline, limits)
    return QueryResult(answer, ok, missing, moved, {name: p.sql for name, p in pushed.items()}, answers)


def _finish_at_client(sql: str, tables: dict[str, Any], timeout: float, deadline: float, limits: Limits) -> Any:
    """``sql`` over the hosts' rows (``tables``; any other table empty), finished in a query
    process of the client's (``sandbox.py``): a join, sort or window over them is work that can
    outgrow any budget, and it is stopped at the deadline, not only waited for."""
    from ..private import PrivatePathError, node_temp_root

    try:
        server = _client_server()
    except PrivatePathError as e:
        raise MonarchError(f"cannot finish the query here: {e}") from None
    inputs = Inputs()
    try:
        for name in TABLES:  # a table the plan never reads (LIMIT 0 reads none) is there, empty
            inputs.add_table(name, tables[name] if name in tables else _empty_table(name))
    except BaseException:
        inputs.close()
        raise
    tables.clear()
    try:
        frames = collect_query(
            server,
            sql,
            inputs,
            limits.within(max(0.0, deadline - time.monotonic())),
            node_temp_root() / "sql",
            "stream",
        )
    except QueryTimedOut:
        raise QueryTimedOut(
            f"query stopped at the client: finishing it (joins, sorts, windows over the hosts' rows) "
            f"ran past --timeout ({timeout:g} s); narrow it with filters or a LIMIT, or give it "
            "more time"
        ) from None
    except QueryFailed as e:  # DataFusion's own message, one line
        raise QueryFailed(f"bad query: {e}") from None
    except QueryStopped as e:
        raise type(e)(f"query stopped at the client: {e}") from None
    except PrivatePathError as e:
        raise MonarchError(f"cannot finish the query here: {e}") from None
    return from_ipc(frames)


_SERVER: QueryServer | None = None
_SERVER_LOCK = threading.Lock()


def _client_server() -> QueryServer:
    """This process's query server (``sandbox.QueryServer``), started at its first query that
    finishes here and ended with the process (it ends when its socket closes)."""
    global _SERVER
    from ..private import node_temp_root, private_dir

    with _SERVER_LOCK:
        if _SERVER is None:
            _SERVER = QueryServer(private_dir(node_temp_root() / "sql", from_=node_temp_root()), quiet=True)
        return _SERVER


def _empty_table(name: str) -> Any:
    import pyarrow as pa

    schema = arrow_schema(name)
    return pa.Table.from_batches([pa.record_batch([pa.array([], f.type) for f in schema], schema=schema)])
