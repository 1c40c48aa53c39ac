"""Telemetry: every host's logs, replica states and lifecycle events, queried in place with SQL.

    monarch-torchx sql --pool dev "SELECT host, count(*) FROM logs WHERE line LIKE '%NaN%' GROUP BY host"
    monarch-torchx tables

Tables and columns: ``schema.TABLES`` (and `monarch-torchx tables`). Agents build their tables
from what they already keep (timestamped log files, the replica table); a query's projection,
filters and limit run on every host, the rest at the client (``query.py``).
"""

from typing import Any


def sql(pool: Any, query: str, timeout: float = 30.0) -> Any:
    """One SQL question over every host's telemetry tables of ``pool`` (a ``pool.Pool``) -> a
    ``pyarrow.Table``. Hosts that do not answer are left out; ``query.run`` says which."""
    from .query import run

    return run(pool, query, timeout=timeout).table
