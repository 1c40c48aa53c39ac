"""Client side of telemetry: one SQL question over every host of a pool, answered in place.

DataFusion plans the query here against empty tables of the documented schemas. An aggregate
that decomposes (``partial.py``) is answered per subtree: every host computes partial
aggregates of its rows, the pool's relay tree merges them on the way up (``Pool.ask``), and the
client finishes. Any other query: each table scan, with the filters and limit DataFusion put
right above it, is turned back into SQL and sent to every host, where DataFusion runs it over
that host's tables; the hosts' Arrow results are registered here under the same table names and
the original query (joins, aggregates, order) finishes at the client. A host that does not
answer within the timeout is left out and named in the result, never waited for forever.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

from .. import wire
from ..errors import MonarchError
from .arrow_ipc import from_ipc
from .partial import PartialAggregate, merge, plan_partial
from .schema import TABLES, arrow_schema

DEFAULT_TIMEOUT_S = 30.0


@dataclass
class QueryResult:
    table: Any  # pyarrow.Table
    hosts: List[int]
    missing: Dict[int, str] = field(default_factory=dict)  # host -> why it is not in the result
    bytes_moved: int = 0
    pushed: Dict[str, str] = field(default_factory=dict)  # table -> the SQL each host ran
    answers: int = 0  # Arrow answers the client read: one per host and table, or one per subtree merged by relays

    @property
    def partial(self) -> bool:
        return bool(self.missing)


def read_only_options() -> Any:
    """Our tables, SELECT only: no DDL, DML, COPY or statements, at the client and on every host."""
    from datafusion import SQLOptions

    return SQLOptions().with_allow_ddl(False).with_allow_dml(False).with_allow_statements(False)


def _one_line(e: Exception) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text.removeprefix("Error during planning: ")


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


def plan_pushdown(sql: str, plan: Any = None) -> Dict[str, str]:
    """table -> the SQL every host runs for it. Raises MonarchError for bad or non-read-only SQL."""
    from datafusion.unparser import Dialect, Unparser

    plan = plan if plan is not None else _plan(sql)
    scans: List[Tuple[str, Any]] = []

    def walk(node: Any) -> None:
        kind = type(node.to_variant()).__name__
        if kind in ("Filter", "TableScan"):
            sub = node
            while type(sub.to_variant()).__name__ == "Filter":
                sub = sub.inputs()[0]
            if type(sub.to_variant()).__name__ == "TableScan":  # (a HAVING filter is above an aggregate)
                scans.append((sub.to_variant().table_name(), node))
                return
        for child in node.inputs():
            walk(child)

    walk(plan)
    unparser = Unparser(Dialect.default())
    counts: Dict[str, int] = {}
    for name, _ in scans:
        counts[name] = counts.get(name, 0) + 1
    pushed = {}
    for name, node in scans:
        # a table read twice (a self-join) with different filters: fetch it whole, once
        pushed[name] = str(unparser.plan_to_sql(node)) if counts[name] == 1 else f'SELECT * FROM "{name}"'
    return pushed


def _missing_why(err: Exception) -> str:
    if isinstance(err, wire.RemoteError) and err.kind == "UnknownOperation":
        return "the telemetry module is not loaded on this host (see its agent log)"
    return str(err)


def run(pool: Any, sql: str, timeout: float = DEFAULT_TIMEOUT_S, per_subtree: bool = True) -> QueryResult:
    """Runs ``sql`` over the pool's hosts; returns the answer and which hosts are missing from it.
    ``per_subtree=False`` answers an aggregate from the hosts' rows, as any other query."""
    plan = _plan(sql)
    partial = plan_partial(plan) if per_subtree else None
    if partial is not None:
        return _run_partial(pool, sql, partial, timeout)
    return _run_rows(pool, sql, plan_pushdown(sql, plan), timeout)


def _run_partial(pool: Any, sql: str, partial: PartialAggregate, timeout: float) -> QueryResult:
    """Partial aggregates from every host, merged per subtree by the relays and here."""
    n = pool.record.num_hosts
    answers = pool.ask("telemetry.partial", range(n), timeout=timeout, sql=partial.host_sql, table=partial.table,
                       merge=partial.merge_sql)
    missing = {i: _missing_why(err) for i, _, err in answers if err is not None}
    ok = [i for i, _, err in answers if err is None]
    if not ok:
        raise MonarchError("no host answered: " + "; ".join(f"host {i}: {why}" for i, why in missing.items()))
    values = [v for _, v, err in answers if err is None and v is not None]  # None: merged into another's
    try:
        answer = partial.finish(merge([from_ipc([v]) for v in values], partial.merge_sql))
    except Exception as e:  # DataFusion's own message, one line
        raise MonarchError(f"bad query: {_one_line(e)}") from None
    return QueryResult(answer, ok, missing, sum(len(v) for v in values), {partial.table: partial.host_sql},
                       len(values))


def _run_rows(pool: Any, sql: str, pushed: Dict[str, str], timeout: float) -> QueryResult:
    """Every host's filtered rows, streamed here; the query finishes at the client."""
    import pyarrow as pa

    n = pool.record.num_hosts
    per_host: Dict[int, Dict[str, Any]] = {i: {} for i in range(n)}
    missing: Dict[int, str] = {}
    moved = 0
    def fetch(i: int, q: str, t: str) -> Tuple[Any, int]:
        """One host's answer, streamed back as Arrow IPC chunks."""
        with pool.connect(i) as client:
            client.settimeout(timeout)
            chunks = list(client.stream("telemetry.query", sql=q, tables=[t]))
        return from_ipc(chunks), sum(len(c) for c in chunks)

    for name, host_sql in pushed.items():
        results = pool.fan_out(lambda i, q=host_sql, t=name: fetch(i, q, t), range(n))
        for i, got, err in results:
            if err is not None:
                missing.setdefault(i, _missing_why(err))
                continue
            per_host[i][name], size = got
            moved += size
    ok = [i for i in range(n) if i not in missing]
    if not ok:
        raise MonarchError("no host answered: " + "; ".join(f"host {i}: {why}" for i, why in missing.items()))
    from datafusion import SessionContext

    ctx = SessionContext()
    for name in pushed:
        parts = [per_host[i][name] for i in ok]
        table = pa.concat_tables(parts) if parts else pa.table({})
        ctx.register_record_batches(name, [table.to_batches() or [pa.record_batch(
            [pa.array([], f.type) for f in table.schema], schema=table.schema)]])
    try:
        answer = ctx.sql_with_options(sql, read_only_options()).to_arrow_table()
    except Exception as e:
        raise MonarchError(f"bad query: {_one_line(e)}") from None
    return QueryResult(answer, ok, missing, moved, pushed, len(ok) * len(pushed))
