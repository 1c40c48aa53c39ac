"""The telemetry tables: names, columns and meanings (stable: people and AI agents query them).

Kept free of pyarrow at import time so the CLI can list tables cheaply; ``arrow_schema`` builds
the pyarrow schema when a query needs it.
"""

from __future__ import annotations

# table -> [(column, arrow type name, meaning)]
TABLES: dict[str, list[tuple[str, str, str]]] = {
    "logs": [
        ("ts", "timestamp", "when the agent received the line (UTC)"),
        ("host", "int32", "host index in the pool"),
        ("hostname", "string", "the host's name"),
        ("app_id", "string", "the app (TorchX app or submitit-<job id>)"),
        ("role", "string", "role name ('task' for submitit)"),
        ("replica", "int32", "replica id (submitit: global rank)"),
        ("pid", "int64", "pid of the replica's latest attempt"),
        ("stream", "string", "stdout or stderr"),
        ("line", "string", "the line, without its newline"),
    ],
    "procs": [
        ("host", "int32", "host index in the pool"),
        ("hostname", "string", "the host's name"),
        ("pid", "int64", "pid of the latest attempt (null before it started)"),
        ("app_id", "string", "the app"),
        ("role", "string", "role name"),
        ("replica", "int32", "replica id"),
        ("state", "string", "PENDING, RUNNING, SUCCEEDED, FAILED or CANCELLED"),
        ("cpu_s", "float64", "CPU seconds used by the live process (null once it ended)"),
        ("rss_bytes", "int64", "resident memory of the live process (null once it ended)"),
        ("started", "timestamp", "when the replica was launched"),
        ("ended", "timestamp", "when it reached a final state (null while running)"),
        ("exit_code", "int32", "exit code, negative for a signal (null while running)"),
        ("attempts", "int32", "attempts so far (retries and requeues included)"),
        ("msg", "string", "why it failed, was retried or requeued"),
    ],
    "stacks": [
        ("ts", "timestamp", "when the dump was taken (`monarch-torchx stacks`)"),
        ("host", "int32", "host index in the pool"),
        ("app_id", "string", "the app"),
        ("role", "string", "role name"),
        ("replica", "int32", "replica id"),
        ("pid", "int64", "the process (a replica or one of its children, e.g. torchrun workers)"),
        ("thread", "int64", "OS thread id"),
        ("thread_name", "string", "Python thread name, when known"),
        ("depth", "int32", "0 = innermost frame (where the thread is now)"),
        ("function", "string", "function name"),
        ("file", "string", "source file"),
        ("line", "int32", "line number"),
    ],
    "metrics": [
        ("ts", "timestamp", "when it was sampled (every few seconds)"),
        ("host", "int32", "host index in the pool"),
        (
            "name",
            "string",
            "host.load1, host.mem_used_bytes, proc.cpu_s, proc.rss_bytes, gpu.util_pct, gpu.mem_used_bytes",
        ),
        ("value", "float64", "the value"),
        ("labels", "string", "JSON: app_id/role/replica/pid for proc.*, gpu index for gpu.*"),
    ],
    "gpus": [
        ("ts", "timestamp", "when it was sampled (every few seconds while a replica holds a GPU, and at each query)"),
        ("host", "int32", "host index in the pool"),
        ("gpu", "string", "the device's id, as replicas get it in CUDA_VISIBLE_DEVICES"),
        ("uuid", "string", "the device's UUID"),
        ("name", "string", "the device's model"),
        ("util_pct", "float64", "GPU utilization, percent"),
        ("mem_used_mb", "float64", "device memory in use, MiB"),
        ("mem_total_mb", "float64", "device memory, MiB"),
        ("temp_c", "float64", "temperature, Celsius"),
        ("power_w", "float64", "power draw, watts"),
        ("ecc_uncorrected", "int64", "uncorrectable ECC errors since the driver loaded (volatile)"),
        ("retired_pending", "int32", "1: pages wait to be retired (the device needs a reset)"),
        ("healthy", "int32", "1: in placement; 0: taken out (see problem)"),
        ("problem", "string", "why it failed its health check ('' when it passed)"),
        ("held_by", "string", "APP/ROLE/REPLICA (or an actor mesh's proc) holding it, null when free"),
    ],
    "events": [
        ("ts", "timestamp", "when it happened"),
        ("host", "int32", "host index in the pool"),
        ("kind", "string", "what happened to: 'pool' (this host), 'app' (its part on this host) or 'replica'"),
        ("name", "string", "pool: host_start; app: launch, end; replica: start, exit"),
        ("app_id", "string", "the app, for app and replica events"),
        ("duration_s", "float64", "for app end and replica exit: how long it ran (a span)"),
        ("fields", "string", "the rest, as JSON"),
    ],
}


def arrow_schema(table: str):  # -> pyarrow.Schema
    import pyarrow as pa

    types = {
        "timestamp": pa.timestamp("us", tz="UTC"),
        "int32": pa.int32(),
        "int64": pa.int64(),
        "string": pa.string(),
        "float64": pa.float64(),
    }
    return pa.schema([(name, types[t]) for name, t, _ in TABLES[table]])


def describe_tables() -> str:
    """Markdown for `monarch-torchx tables` and the docs."""
    out = []
    for table, cols in TABLES.items():
        out += [f"{table}", *[f"  {c:<10} {t:<10} {m}" for c, t, m in cols], ""]
    return "\n".join(out).rstrip()
