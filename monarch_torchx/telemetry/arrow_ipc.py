"""Arrow tables as bytes on our wire: one IPC stream per frame, lz4-compressed.

Telemetry columns repeat (host, app_id, role, ...), so lz4 shrinks them to almost nothing; the
same encoding carries a host's streamed rows and a subtree's merged partial aggregates.
"""

from __future__ import annotations

from typing import Any


def to_ipc(table: Any, max_rows: int = 0) -> list[bytes]:
    """``table`` as IPC streams of at most ``max_rows`` rows each (all in one when 0); at least one."""
    import pyarrow as pa

    batches = table.to_batches(max_chunksize=max_rows or None) or [
        pa.record_batch([pa.array([], f.type) for f in table.schema], schema=table.schema)
    ]
    if not max_rows:
        return [_stream(table.schema, batches)]
    return [_stream(table.schema, [b]) for b in batches]


def from_ipc(chunks: list[bytes]) -> Any:
    """The table that ``to_ipc`` encoded (its chunks in order)."""
    import pyarrow as pa

    return pa.concat_tables([pa.ipc.open_stream(c).read_all() for c in chunks])


def _stream(schema: Any, batches: list[Any]) -> bytes:
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema, options=pa.ipc.IpcWriteOptions(compression="lz4")) as writer:
        for b in batches:
            writer.write_batch(b)
    return sink.getvalue().to_pybytes()
