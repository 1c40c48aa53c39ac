"""Telemetry: every host's logs, replica states and lifecycle events, queried in place with SQL.

    monarch-torchx sql --pool dev "SELECT host, count(*) FROM logs WHERE line LIKE '%NaN%' GROUP BY host"
    monarch-torchx tables

Tables and columns: ``schema.TABLES`` (and `monarch-torchx tables`). Agents build their tables
from what they already keep (timestamped log files, the replica table); a query's projection,
filters and limit run on every host, the rest at the client (``query.py``).
"""
