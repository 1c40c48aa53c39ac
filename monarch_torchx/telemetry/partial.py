"""Aggregates answered per subtree: an unfiltered ``GROUP BY`` over 1,000 hosts moves groups, not rows.

For a query whose lowest aggregate reads one table through filters and projections only, and
whose aggregate functions decompose (count, sum, min, max, avg), every host computes *partial*
aggregates of its own rows (``host_sql``), each relay of the pool's tree merges its subtree's
partials with the same associative ``merge_sql`` (counts and sums add, min of mins, max of maxes;
an average travels as a sum and a count), and the client finishes: the partials become the
aggregate's output columns, and whatever the query does above the aggregate (``HAVING``, the
projection, ``ORDER BY``, ``LIMIT``, an outer aggregate such as ``count(DISTINCT ...)``) runs on
those rows, rebuilt from the query's own plan with DataFusion's DataFrame API. Anything else
(joins, windows, ``DISTINCT``/``FILTER``/``ORDER BY`` inside an aggregate) is answered the way
it always was: the filtered rows come to the client (``query.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

PARTIALS = "partial"  # the table name merge_sql reads
MERGE_OF = {"count": "sum", "sum": "sum", "min": "min", "max": "max"}  # avg: a sum and a count
_PUSHABLE_BELOW = frozenset({"Projection", "Filter", "TableScan"})
_REBUILT_ABOVE = frozenset({"Projection", "Filter", "Sort", "Limit", "Aggregate"})


@dataclass(frozen=True)
class Output:
    """One output column of the pushed aggregate, and the partial columns it is finished from."""

    name: str  # the aggregate's output field name, as the plan above it refers to it
    parts: tuple[str, ...]  # one partial column, or (sum, count) for an average
    average: bool = False


@dataclass(frozen=True)
class PartialAggregate:
    """How one query is answered per subtree: what hosts run, how partials merge, how the client finishes."""

    table: str  # the one table the aggregate reads
    host_sql: str  # every host: partial aggregates over its own rows (columns k0.. and p0..)
    merge_sql: str  # any set of partials -> one, over table PARTIALS (associative)
    outputs: tuple[Output, ...]  # the group keys first, then the aggregates
    above: tuple[Any, ...]  # the plan's nodes above the aggregate, root first (client side only)

    def finish(self, merged: Any) -> Any:
        """The query's answer (a pyarrow.Table) from the merged partials of every host."""
        import pyarrow as pa
        from datafusion import SessionContext, col

        ctx = SessionContext()
        ctx.register_record_batches(PARTIALS, [record_batches(merged)])
        columns = []
        for out in self.outputs:
            if out.average:
                total, count = (col(f'"{p}"') for p in out.parts)
                columns.append((total.cast(pa.float64()) / count.cast(pa.float64())).alias(out.name))
            else:
                columns.append(col(f'"{out.parts[0]}"').alias(out.name))
        rows = ctx.table(PARTIALS).select(*columns).to_arrow_table()
        # under the scanned table's name, so the plan above refers to these columns as it did
        ctx.register_record_batches(self.table, [record_batches(rows)])
        df = ctx.table(self.table)
        for node in reversed(self.above):
            df = _apply(df, node)
        return df.to_arrow_table()


def merge(tables: Sequence[Any], merge_sql: str, ctx: Any = None) -> Any:
    """Partials of several hosts or subtrees -> one (a pyarrow.Table with the same columns), in
    DataFusion context ``ctx`` (a fresh one by default; a relay's is memory-bounded)."""
    import pyarrow as pa
    from datafusion import SessionContext

    from .sandbox import read_only_options

    tables = [t for t in tables if t is not None]
    if len(tables) == 1:
        return tables[0]
    ctx = ctx if ctx is not None else SessionContext()
    ctx.register_record_batches(PARTIALS, [record_batches(pa.concat_tables(tables, promote_options="permissive"))])
    return ctx.sql_with_options(merge_sql, read_only_options()).to_arrow_table()


def plan_partial(plan: Any) -> PartialAggregate | None:
    """The per-subtree form of an optimized logical plan, or None where it has none."""
    above: list[Any] = []
    node = plan
    while True:
        kind = _kind(node)
        if kind == "Aggregate" and _scanned_table(node.inputs()[0]) is not None:
            break
        if kind not in _REBUILT_ABOVE or len(node.inputs()) != 1 or not _rebuildable(node):
            return None
        above.append(node)
        node = node.inputs()[0]
    return _partial_of(node, _scanned_table(node.inputs()[0]) or "", tuple(above))


def _partial_of(agg_node: Any, table: str, above: tuple[Any, ...]) -> PartialAggregate | None:
    from datafusion import SessionContext
    from datafusion import functions as F
    from datafusion.expr import Expr
    from datafusion.unparser import Dialect, Unparser

    agg = agg_node.to_variant()
    keys = [Expr(g) for g in agg.group_by_exprs()]
    outputs: list[Output] = []
    host_cols: list[Any] = []
    merge_cols: list[str] = []
    for j, key in enumerate(keys):
        outputs.append(Output(_output_name(key), (f"k{j}",)))
        host_cols.append(key.alias(f"k{j}"))
    aggregates = []
    for i, raw in enumerate(agg.aggregate_exprs()):
        e = Expr(raw)
        if e.variant_name() != "AggregateFunction":
            return None
        fn_v = e.to_variant()
        fn, args = fn_v.aggregate_type(), [Expr(a) for a in fn_v.args()]
        name = e.schema_name()
        if fn_v.is_distinct() or len(args) != 1 or " FILTER (" in name or " ORDER BY [" in name:
            return None
        if fn == "avg":
            aggregates += [F.sum(args[0]).alias(f"p{i}s"), F.count(args[0]).alias(f"p{i}c")]
            merge_cols += [f'sum("p{i}s") AS "p{i}s"', f'sum("p{i}c") AS "p{i}c"']
            outputs.append(Output(name, (f"p{i}s", f"p{i}c"), average=True))
        elif fn in MERGE_OF:
            aggregates.append(getattr(F, fn)(args[0]).alias(f"p{i}"))
            merge_cols.append(f'{MERGE_OF[fn]}("p{i}") AS "p{i}"')
            outputs.append(Output(name, (f"p{i}",)))
        else:
            return None
    ctx = SessionContext()
    try:
        partial = ctx.create_dataframe_from_logical_plan(agg_node.inputs()[0]).aggregate(host_cols, aggregates)
        host_sql = str(Unparser(Dialect.default()).plan_to_sql(partial.logical_plan()))
    except Exception:  # DataFusion cannot express this one as SQL: the rows path answers it
        return None
    group = ", ".join(f'"k{j}"' for j in range(len(keys)))
    merge_sql = (
        f"SELECT {', '.join([f'{chr(34)}k{j}{chr(34)}' for j in range(len(keys))] + merge_cols)} "
        f"FROM {PARTIALS}" + (f" GROUP BY {group}" if keys else "")
    )
    return PartialAggregate(table, host_sql, merge_sql, tuple(outputs), above)


def _kind(node: Any) -> str:
    return type(node.to_variant()).__name__


def _scanned_table(node: Any) -> str | None:
    """The table under a chain of projections and filters, or None if it is anything else."""
    while _kind(node) in _PUSHABLE_BELOW:
        if _kind(node) == "TableScan":
            return str(node.to_variant().table_name())
        if len(node.inputs()) != 1:
            return None
        node = node.inputs()[0]
    return None


def _rebuildable(node: Any) -> bool:
    if _kind(node) == "Limit":
        try:
            _limit(node.to_variant())
        except (TypeError, ValueError):  # not literal integers
            return False
    return True


def _limit(v: Any) -> tuple[int, int]:
    """A Limit node's (fetch, skip) as integers; ValueError without a fetch."""
    from datafusion.expr import Expr

    fetch, skip = v.fetch(), v.skip()
    if fetch is None:
        raise ValueError("OFFSET without LIMIT")
    value = lambda raw: raw if isinstance(raw, int) else int(Expr(raw).python_value())  # noqa: E731
    return value(fetch), value(skip) if skip is not None else 0


def _output_name(key: Any) -> str:
    """A group key's name in the aggregate's output: a column's own name, else the expression's."""
    if key.variant_name() == "Column":
        return str(key.to_variant().name())
    return key.schema_name()


def _apply(df: Any, node: Any) -> Any:
    """One plan node above the pushed aggregate, applied to ``df`` (the DataFrame of its input)."""
    from datafusion.expr import Expr

    v = node.to_variant()
    kind = _kind(node)
    if kind == "Projection":
        return df.select(*_named([Expr(e) for e in v.projections()], v.schema().field_names()))
    if kind == "Filter":
        return df.filter(Expr(v.predicate()))
    if kind == "Sort":
        df = df.sort(
            *[Expr(s.expr()).sort(ascending=s.ascending(), nulls_first=s.nulls_first()) for s in v.sort_exprs()]
        )
        fetch = v.get_fetch_val()
        return df.limit(fetch) if fetch is not None else df
    if kind == "Limit":
        fetch, skip = _limit(v)
        return df.limit(fetch, skip)
    if kind == "Aggregate":
        keys = [Expr(g) for g in v.group_by_exprs()]
        named = _named(keys + [Expr(a) for a in v.aggregate_exprs()], v.schema().field_names())
        return df.aggregate(named[: len(keys)], named[len(keys) :])
    raise ValueError(f"cannot finish a {kind} node at the client")


def _named(exprs: list[Any], names: Sequence[str]) -> list[Any]:
    """``exprs`` with the output names the original plan gave them. A column keeps its own (and
    its qualifier, which the nodes above may use); anything computed is named as it was, since
    over the rebuilt input its default name would spell its columns qualified."""
    return [e if e.variant_name() == "Column" else e.alias(n) for e, n in zip(exprs, names)]


def record_batches(table: Any) -> list[Any]:
    """``table``'s batches to register in a DataFusion context: one empty batch when it has none
    (a table registered with no batch has no schema)."""
    import pyarrow as pa

    return table.to_batches() or [pa.record_batch([pa.array([], f.type) for f in table.schema], schema=table.schema)]
