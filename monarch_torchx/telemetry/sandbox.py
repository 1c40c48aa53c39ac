"""Where telemetry SQL runs: a process of its own per query, under a memory and a time limit.

A query is the user's text, and DataFusion cannot bound what it costs from inside: its memory
pool bounds operators (sorts, joins and aggregates, which spill), not a scalar function's output
per batch (``repeat(line, 5000)`` asks for gigabytes for one batch whatever the pool), and an
allocation that fails in native code aborts the process it runs in. In an agent that abort took
every replica of the host with it. So no query runs in an agent, and a join or a sort the client
finishes does not run in the client either: each runs in a query process of its own, forked for
it by a ``QueryServer`` (``python -P -m monarch_torchx.telemetry.sandbox``, started at the first
query, cwd private, pyarrow and DataFusion imported once), which

- caps its own data segment (``RLIMIT_DATA``: heap, private writable maps, threads' stacks) at
  what it had once its tables were registered plus the query's memory budget, with the
  allocators told not to reserve gigabytes of address space up front (``MIMALLOC_ARENA_RESERVE=0``,
  Arrow's system allocator), so that the cap is the budget; DataFusion's fair spill pool gets half
  of it and spills to the query's private directory;
- reads its tables from memory files (``memfd``) that it maps read-only and shared, handed over
  as fds: the data costs no copy and does not count against the cap (the agent's log index lives
  in such files);
- cuts every input into small batches (``MONARCH_TORCHX_SQL_BATCH_ROWS``), so that a scalar
  function's output per batch is small too;
- runs under a supervisor, the leader of its process group, which the owner kills at the
  deadline (the caller's timeout, capped by ``MONARCH_TORCHX_SQL_TIMEOUT_S`` on agents): the
  work stops, not only the waiting;
- writes its answer back on a pipe as lz4 Arrow IPC frames, then a last record: done, or an
  error; a process that died instead (an allocation refused under the cap aborts it) is
  reported by its supervisor.

A query over a limit fails alone, in one line (``QueryStopped`` and its kinds); whoever asked
it (the agent, its replicas, the client) is not touched. The kinds travel over the wire by name
(``RemoteError.kind``) and are branched on by name, never by message text.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import resource
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any, AsyncIterator, Iterator

from ..errors import MonarchError

MODULE = "monarch_torchx.telemetry.sandbox"
FRAME_ROWS = 262_144  # rows per frame of an answer at most
FRAME_BYTES = 32 << 20  # ... and about this many bytes before compression
_ALIGN = 64  # where each IPC message or stream starts in a memory file: buffers stay aligned
_HEADER = struct.Struct("<cQ")  # a record on the process's stdout: kind, payload length


class QueryStopped(MonarchError, ValueError):
    """A query ended by one of its limits, or by its own error; nothing else was affected.

    Also a ValueError: an agent's server treats it as a refused request, not as its own failure."""


class QueryOutOfMemory(QueryStopped):
    """The query needed more memory than its budget."""


class QueryTimedOut(QueryStopped):
    """The query ran past its time limit and was stopped."""


class QueryTooManyRows(QueryStopped):
    """The query's answer has more rows than its row limit."""


class QueryFailed(QueryStopped):
    """DataFusion refused or failed the query (its own one-line reason), or its process died."""


# by the name that travels as a RemoteError's kind
STOPPED = {c.__name__: c for c in (QueryOutOfMemory, QueryTimedOut, QueryTooManyRows, QueryFailed)}


def _env_number(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


@dataclass(frozen=True)
class Limits:
    """What one query may use. ``memory_knob`` names the setting that raises the budget, for messages."""

    memory_bytes: int
    timeout_s: float
    batch_rows: int
    threads: int
    max_rows: int = 0  # 0: any number of rows
    memory_knob: str = ""

    def within(self, timeout_s: float | None) -> Limits:
        """These limits, with the time limit cut to ``timeout_s`` (the caller's own) where that is less."""
        if timeout_s is None:
            return self
        return replace(self, timeout_s=max(0.0, min(self.timeout_s, float(timeout_s))))


def _common(memory_env: str, memory_mb: float, timeout_s: float, max_rows: int, knob: str) -> Limits:
    return Limits(
        memory_bytes=int(_env_number(memory_env, memory_mb) * (1 << 20)),
        timeout_s=timeout_s,
        batch_rows=max(1, int(_env_number("MONARCH_TORCHX_SQL_BATCH_ROWS", 2048))),
        threads=max(1, int(_env_number("MONARCH_TORCHX_SQL_THREADS", min(4, os.cpu_count() or 1)))),
        max_rows=max_rows,
        memory_knob=knob,
    )


def agent_limits() -> Limits:
    """A host's part of a query: ``MONARCH_TORCHX_SQL_MEMORY_MB`` (1024) and
    ``MONARCH_TORCHX_SQL_TIMEOUT_S`` (60) from the environment the pool was created in."""
    return _common(
        "MONARCH_TORCHX_SQL_MEMORY_MB",
        1024,
        _env_number("MONARCH_TORCHX_SQL_TIMEOUT_S", 60.0),
        0,
        "MONARCH_TORCHX_SQL_MEMORY_MB in the environment that created the pool",
    )


def client_limits(timeout_s: float, max_rows: int | None = None) -> Limits:
    """What the client finishes: ``MONARCH_TORCHX_SQL_CLIENT_MEMORY_MB`` (4096), the caller's
    timeout, and at most ``MONARCH_TORCHX_SQL_MAX_ROWS`` (10,000,000) rows in the answer."""
    rows = int(_env_number("MONARCH_TORCHX_SQL_MAX_ROWS", 10_000_000)) if max_rows is None else int(max_rows)
    return _common(
        "MONARCH_TORCHX_SQL_CLIENT_MEMORY_MB", 4096, timeout_s, max(0, rows), "MONARCH_TORCHX_SQL_CLIENT_MEMORY_MB"
    )


def read_only_options() -> Any:
    """Our tables, SELECT only: no DDL, DML, COPY or statements, at the client and on every host."""
    from datafusion import SQLOptions

    return SQLOptions().with_allow_ddl(False).with_allow_dml(False).with_allow_statements(False)


def one_line(e: BaseException) -> str:
    """DataFusion's (or any) message, first line only."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text.removeprefix("Error during planning: ")


def bounded_context(limits: Limits, spill_dir: Path) -> Any:
    """A DataFusion context whose operators share a fair spill pool of half the budget and spill
    to ``spill_dir`` (private). Enough on its own only for SQL of ours without scalar functions
    (a relay merging partial aggregates); a user's query runs in a process (``run_query``)."""
    from datafusion import RuntimeEnvBuilder, SessionConfig, SessionContext

    config = SessionConfig().with_batch_size(limits.batch_rows).with_target_partitions(limits.threads)
    runtime = (
        RuntimeEnvBuilder()
        .with_fair_spill_pool(max(1 << 20, limits.memory_bytes // 2))
        .with_disk_manager_specified(str(spill_dir))
    )
    return SessionContext(config, runtime)


# ---------------------------------------------------------------- a query's inputs


def memory_file(name: str) -> int:
    """A new anonymous memory file (close-on-exec), for tables a query process maps: a ``memfd``,
    or where there is none (not Linux) an unlinked file in our private temp directory."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create(f"monarch_torchx-{name}")
    from ..private import node_temp_root, private_dir

    with tempfile.TemporaryFile(dir=private_dir(node_temp_root() / "sql", from_=node_temp_root())) as f:
        return os.dup(f.fileno())


def aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class Inputs:
    """The tables of one query as its process will find them: sources that name memory files by
    fd (owned here until ``close``), and Parquet files by path. Small tables and the client's rows
    are written to one memory file of this query's own, as uncompressed IPC (mapped without a copy)."""

    def __init__(self) -> None:
        self.tables: dict[str, dict[str, Any]] = {}
        self.fds: list[int] = []
        self._file: int | None = None

    def _table(self, name: str, schema: str | None = None) -> dict[str, Any]:
        return self.tables.setdefault(name, {"schema": schema, "sources": []})

    def _own_file(self) -> int:
        if self._file is None:
            self._file = memory_file("query")
            self.fds.append(self._file)
        return self._file

    def add_table(self, name: str, table: Any) -> None:
        """``table`` (pyarrow) as table ``name``, written into this query's memory file."""
        import pyarrow as pa

        fd = self._own_file()
        offset = aligned(os.fstat(fd).st_size)
        with os.fdopen(os.dup(fd), "r+b") as f:
            f.seek(offset)
            with pa.ipc.new_stream(f, table.schema) as writer:
                writer.write_table(table)
            length = f.tell() - offset
        self._table(name)["sources"].append({"stream": [fd, offset, length]})

    def add_streams(self, name: str, streams: list[bytes]) -> None:
        """Arrow IPC streams as they came over the wire (e.g. hosts' answers), as one table."""
        fd = self._own_file()
        for data in streams:
            offset = aligned(os.fstat(fd).st_size)
            pwrite_all(fd, data, offset)
            self._table(name)["sources"].append({"stream": [fd, offset, len(data)]})

    def add_batches(self, name: str, schema: str, sources: list[list[int]], fds: list[int]) -> None:
        """Serialized record batches of table schema ``schema`` in memory files that ``fds`` (now
        owned here) open: each source is [fd, offset, length, first row, rows]."""
        self.fds.extend(fds)
        self._table(name, schema)["sources"].extend({"batch": s} for s in sources)

    def add_parquet(self, name: str, schema: str, paths: list[str]) -> None:
        self._table(name, schema)["sources"].extend({"parquet": p} for p in paths)

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []
        self._file = None


# ---------------------------------------------------------------- the owner: a server, its queries


def _argv() -> list[str]:
    from ..interpreter import module_argv

    return module_argv(MODULE)


def _server_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "MIMALLOC_ARENA_RESERVE": "0",  # DataFusion's allocator: no 1 GiB reserved up front (it counts)
            "ARROW_DEFAULT_MEMORY_POOL": "system",  # nor Arrow's
            # one thread only in the server, which forks: no jemalloc background thread, no BLAS pool
            "JE_ARROW_MALLOC_CONF": "background_thread:false",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "RUST_BACKTRACE": "0",
        }
    )
    return env


class QueryServer:
    """The process that query processes are forked from: it has imported pyarrow and DataFusion
    once (a cold start costs far more CPU: benchmarks/RESULTS.md, "numbers behind the code"), so a
    query costs two forks, not a new interpreter.

    Started at the first query and kept (an agent kept DataFusion loaded after its first query
    before, so this costs what that did). It reads requests from a socket pair whose other end
    only its owner holds, and ends when that end closes (the owner exited or was killed),
    killing any query still running. Each request brings, as fds: the write end of a pipe for the
    answer, and the memory files of the tables. Thread-safe."""

    def __init__(self, cwd: Path, quiet: bool = False):
        self.cwd = cwd  # private
        self.quiet = quiet  # the client's terminal is not for DataFusion's own last words
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.lock = threading.Lock()
        self.last_submit = 0.0  # monotonic

    def close_if_idle(self, idle_s: float) -> bool:
        """Ends the server when no query was submitted for ``idle_s`` seconds, which must be more
        than any query's time limit (so none still runs): an idle agent of a large pool should
        not keep DataFusion's ~60 MiB for a query it answered once. The next query starts it again."""
        with self.lock:
            if self.proc is None or time.monotonic() - self.last_submit <= idle_s:
                return False
            self._stop()
            return True

    def _start(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = subprocess.Popen(
                _argv(),
                stdin=theirs.fileno(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL if self.quiet else None,
                cwd=str(self.cwd),
                env=_server_env(),
                start_new_session=True,
            )  # (Ctrl-C is for its owner)
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        self.sock = mine

    def submit(self, request: bytes, fds: list[int]) -> None:
        """Starts one query process with ``fds`` (the answer's pipe first), which stay the caller's."""
        with self.lock:
            for attempt in (0, 1):
                if self.proc is None or self.proc.poll() is not None:
                    self._stop()
                    self._start()
                assert self.sock is not None  # set by _start with the process it talks to
                try:
                    self.last_submit = time.monotonic()
                    socket.send_fds(self.sock, [struct.pack("<Q", len(request))], fds)
                    self.sock.sendall(request)
                    return
                except OSError:  # it died between two queries: once more, with a new one
                    self._stop()
                    if attempt:
                        raise

    def _stop(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def close(self) -> None:
        """Ends the server and every query it runs (they are killed)."""
        with self.lock:
            self._stop()


def _request(sql: str, inputs: Inputs, limits: Limits, mode: str, cwd: Path) -> bytes:
    return json.dumps(
        {
            "sql": sql,
            "tables": inputs.tables,
            "fds": inputs.fds,
            "mode": mode,
            "cwd": str(cwd),
            "frame_rows": FRAME_ROWS,
            "memory_bytes": limits.memory_bytes,
            "batch_rows": limits.batch_rows,
            "threads": limits.threads,
            "max_rows": limits.max_rows,
        }
    ).encode()


def _hand_over(server: QueryServer, request: bytes, inputs: Inputs, answer: int) -> None:
    """Gives the query to ``server`` with the write end of its answer's pipe, then closes ours and
    the tables' fds (the query process has its own). (On a thread of its own in an agent: if the
    asker goes meanwhile, it closes the read end, and the query ends at its first write.)"""
    try:
        server.submit(request, [answer, *inputs.fds])
    finally:
        os.close(answer)
        inputs.close()


def _prepare(spill_root: Path, inputs: Inputs, buffering: int = -1) -> tuple[Path, IO[bytes], int]:
    """A fresh private directory under ``spill_root`` for one query process (its cwd and its spill
    directory), and the pipe of its answer (read end as a file, write end); ``inputs`` is closed
    if either cannot be made."""
    from ..private import node_temp_root, private_dir

    try:
        work = Path(tempfile.mkdtemp(prefix="sql-", dir=private_dir(spill_root, from_=node_temp_root())))
        try:
            r, w = os.pipe()
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    except BaseException:
        inputs.close()
        raise
    return work, os.fdopen(r, "rb", buffering=buffering), w


def _died(status: int | None, timed_out: bool, limits: Limits) -> QueryStopped:
    """Why a query process ended without its last record (``status``: its exit code, negative
    for a signal, None where its supervisor did not say)."""
    if timed_out:
        # (.2g: a limit the client shortened by its own deadline, 1.99 s of 2, reads as the limit set)
        return QueryTimedOut(f"it ran past its time limit of {limits.timeout_s:.2g} s and was stopped")
    if status in (-signal.SIGABRT, -signal.SIGKILL, -signal.SIGSEGV, -signal.SIGBUS):
        # an allocation refused under the cap aborts (Rust, C++) or, for a thread's stack, faults
        return _out_of_memory(limits)
    how = (
        "was ended"
        if status is None
        else (f"ended with signal {-status}" if status < 0 else f"ended with exit code {status}")
    )
    return QueryFailed(f"its process {how} before it answered")


def _out_of_memory(limits: Limits) -> QueryOutOfMemory:
    return QueryOutOfMemory(
        f"it needed more than the {limits.memory_bytes / (1 << 20):.0f} MiB of memory a query "
        f"may use ({limits.memory_knob}) and was stopped; narrow it with filters, a LIMIT or "
        "an aggregate"
    )


def _error(payload: bytes, limits: Limits) -> QueryStopped:
    """The process's own error record as its exception."""
    record = json.loads(payload)
    kind = STOPPED.get(record.get("kind", ""), QueryFailed)
    if kind is QueryOutOfMemory:
        return _out_of_memory(limits)
    return kind(record.get("message") or kind.__name__)


class _Run:
    """What the owner knows of one query process while reading its records: its process group
    (from its first record), whether it was stopped for time, what it ended with."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.group: int | None = None
        self.timed_out = False
        self.finished = False  # it sent its last record (or its supervisor did)

    def abandon(self) -> None:
        """The owner stops reading before the end: nothing of the query is left running."""
        if not self.finished and self.group is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.group, signal.SIGKILL)

    def stop(self) -> None:
        """At the deadline: SIGKILL to the query's process group (its supervisor and itself)."""
        self.timed_out = True
        if self.group is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.group, signal.SIGKILL)

    def record(self, kind: bytes, payload: bytes) -> bytes | None:
        """A frame to pass on, or None for a record that is not one; raises at the end."""
        self.finished = kind in (b"D", b"E", b"X")
        if kind == b"P":
            self.group = json.loads(payload)["group"]
            if self.timed_out:
                self.stop()
            return None
        if kind == b"F":
            return payload
        if kind == b"E":
            raise _error(payload, self.limits)
        if kind == b"X":
            raise _died(json.loads(payload)["status"], self.timed_out, self.limits)
        raise _Done()

    def ended(self) -> QueryStopped:
        """The pipe closed without a last record: killed for time, or its supervisor was killed."""
        return _died(None, self.timed_out, self.limits)


class _Done(Exception):
    """The query's last record: its answer is complete."""


async def run_query(
    server: QueryServer, sql: str, inputs: Inputs, limits: Limits, spill_root: Path, mode: str = "stream"
) -> AsyncIterator[bytes]:
    """The answer to ``sql`` over ``inputs``, as lz4 Arrow IPC frames (``mode="one"``: one frame),
    from a query process of its own forked by ``server`` (see the module's docstring). Raises a
    ``QueryStopped``. Closing the iterator early kills the process; ``inputs`` is closed here."""
    import asyncio

    loop = asyncio.get_running_loop()
    work, pipe, w = _prepare(spill_root, inputs, buffering=0)
    run = _Run(limits)
    try:
        try:
            await loop.run_in_executor(None, _hand_over, server, _request(sql, inputs, limits, mode, work), inputs, w)
            reader = asyncio.StreamReader(limit=1 << 20)
            transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
        except BaseException:
            pipe.close()
            raise
        timer = loop.call_later(limits.timeout_s, run.stop)
        try:
            while True:
                try:
                    kind, size = _HEADER.unpack(await reader.readexactly(_HEADER.size))
                    frame = run.record(kind, await reader.readexactly(size))
                except asyncio.IncompleteReadError:
                    raise run.ended() from None
                except _Done:
                    return
                if frame is not None:
                    yield frame
        finally:
            timer.cancel()
            run.abandon()
            transport.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def collect_query(
    server: QueryServer, sql: str, inputs: Inputs, limits: Limits, spill_root: Path, mode: str = "stream"
) -> list[bytes]:
    """``run_query`` for callers without an event loop (the client, a relay's combiner): every
    frame of the answer. An interrupt (Ctrl-C) kills the query process on the way out."""
    work, pipe, w = _prepare(spill_root, inputs)
    run = _Run(limits)
    frames: list[bytes] = []
    try:
        try:
            _hand_over(server, _request(sql, inputs, limits, mode, work), inputs, w)
        except BaseException:
            pipe.close()
            raise
        timer = threading.Timer(limits.timeout_s, run.stop)
        timer.daemon = True
        timer.start()
        try:
            with pipe:
                while True:
                    got = _read_record(pipe)
                    if got is None:
                        raise run.ended()
                    try:
                        frame = run.record(*got)
                    except _Done:
                        return frames
                    if frame is not None:
                        frames.append(frame)
        finally:
            timer.cancel()
            run.abandon()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _read_record(stream: IO[bytes]) -> tuple[bytes, bytes] | None:
    """(kind, payload) of the next record; None at the end of the pipe."""
    head = _read_exact(stream, _HEADER.size)
    if head is None:
        return None
    kind, size = _HEADER.unpack(head)
    payload = _read_exact(stream, size)
    return None if payload is None else (kind, payload)


def _read_exact(stream: IO[bytes], n: int) -> bytes | None:
    parts, got = [], 0
    while got < n:
        chunk = stream.read(n - got)
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


# ---------------------------------------------------------------- the query process


def _record(out: IO[bytes], kind: bytes, payload: bytes) -> None:
    out.write(_HEADER.pack(kind, len(payload)))
    out.write(payload)
    out.flush()


def _vm_data() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cap_memory(budget: int) -> None:
    """From here on, this process may allocate ``budget`` bytes more than it holds now (its heap,
    its threads' stacks; not the tables it maps shared and read-only)."""
    now = _vm_data()
    if now is None:
        return  # not Linux: only the time limit holds
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    cap = now + budget if hard == resource.RLIM_INFINITY else min(hard, now + budget)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))


class _Maps:
    """Read-only shared maps of the memory files this process was handed, one per fd."""

    def __init__(self) -> None:
        self.views: dict[int, Any] = {}

    def view(self, fd: int) -> Any:
        import pyarrow as pa

        if fd not in self.views:
            self.views[fd] = pa.py_buffer(mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ))
        return self.views[fd]


def _pieces(batch: Any, rows: int) -> Iterator[Any]:
    """``batch`` in slices of at most ``rows`` rows (no copy): what a scalar function sees at once."""
    if batch.num_rows <= rows:
        yield batch
        return
    for start in range(0, batch.num_rows, rows):
        yield batch.slice(start, rows)


def _register(ctx: Any, maps: _Maps, name: str, spec: dict[str, Any], batch_rows: int) -> None:
    import pyarrow as pa

    from .schema import arrow_schema

    schema = arrow_schema(spec["schema"]) if spec.get("schema") else None
    batches: list[Any] = []
    streams: list[Any] = []
    parquet: list[str] = []
    for src in spec["sources"]:
        if "stream" in src:
            fd, offset, length = src["stream"]
            streams.append(pa.ipc.open_stream(maps.view(fd).slice(offset, length)).read_all())
        elif "batch" in src:
            fd, offset, length, first, rows = src["batch"]
            whole = pa.ipc.read_record_batch(maps.view(fd).slice(offset, length), schema)
            batches.append(whole.slice(first, rows))
        else:
            parquet.append(src["parquet"])
    if streams:
        table = pa.concat_tables(streams, promote_options="permissive") if len(streams) > 1 else streams[0]
        schema = table.schema
        batches.extend(table.to_batches())
    pieces = [p for b in batches for p in _pieces(b, batch_rows)]
    if parquet:  # memory and Parquet on local disk, one table, filters pushed into both
        import pyarrow.dataset as ds

        parts = [ds.dataset(parquet, format="parquet", schema=schema)]
        if pieces:
            parts.append(ds.dataset(pa.Table.from_batches(pieces, schema=schema)))
        ctx.register_dataset(name, ds.dataset(parts))
        return
    assert schema is not None  # a table's spec names its schema, or has streams that carry theirs
    empty = pa.record_batch([pa.array([], f.type) for f in schema], schema=schema)
    ctx.register_record_batches(name, [pieces or [empty]])


def _batches(df: Any, max_rows: int) -> Iterator[Any]:
    """The answer's record batches (pyarrow), counting rows against ``max_rows`` (0: no limit)."""
    total = 0
    for rb in df.execute_stream():
        batch = rb.to_pyarrow()
        total += batch.num_rows
        if max_rows and total > max_rows:
            raise QueryTooManyRows(
                f"its answer has more than {max_rows:,} rows (MONARCH_TORCHX_SQL_MAX_ROWS); add a "
                "LIMIT, filters or an aggregate"
            )
        yield batch


def _frames(df: Any, frame_rows: int, max_rows: int) -> Iterator[bytes]:
    """The answer as lz4 IPC frames of up to ``frame_rows`` rows or about FRAME_BYTES (at least one)."""
    import pyarrow as pa

    from .arrow_ipc import to_ipc

    pending: list[Any] = []
    held = size = 0
    schema = None
    for batch in _batches(df, max_rows):
        schema = batch.schema
        pending.append(batch)
        held += batch.num_rows
        size += batch.nbytes
        if held >= frame_rows or size >= FRAME_BYTES:
            yield to_ipc(pa.Table.from_batches(pending, schema=schema))[0]
            pending, held, size = [], 0, 0
    if pending or schema is None:
        yield to_ipc(pa.Table.from_batches(pending, schema=schema or df.schema()))[0]


def _serve(request: dict[str, Any], out: IO[bytes]) -> None:
    import pyarrow as pa
    from datafusion import RuntimeEnvBuilder, SessionConfig, SessionContext

    from .arrow_ipc import to_ipc

    budget = int(request["memory_bytes"])
    config = SessionConfig().with_batch_size(int(request["batch_rows"])).with_target_partitions(int(request["threads"]))
    runtime = (
        RuntimeEnvBuilder().with_fair_spill_pool(max(1 << 20, budget // 2)).with_disk_manager_specified(os.getcwd())
    )
    ctx = SessionContext(config, runtime)
    maps = _Maps()
    for name, spec in request["tables"].items():
        _register(ctx, maps, name, spec, int(request["batch_rows"]))
    ctx.sql("SELECT 1").collect()  # DataFusion's runtime and threads up: part of what is there before the cap
    _cap_memory(budget)
    try:
        df = ctx.sql_with_options(request["sql"], read_only_options())
    except Exception as e:  # DataFusion's own message, one line
        raise QueryFailed(one_line(e)) from None
    max_rows = int(request.get("max_rows") or 0)
    if request["mode"] == "one":  # one IPC stream: what a relay combines
        batches = list(_batches(df, max_rows))
        schema = batches[0].schema if batches else df.schema()
        _record(out, b"F", to_ipc(pa.Table.from_batches(batches, schema=schema))[0])
        return
    for frame in _frames(df, int(request["frame_rows"]), max_rows):
        _record(out, b"F", frame)


def _query(request: dict[str, Any], fds: list[int]) -> None:
    """The query process (forked by a supervisor): one request, its records on ``fds[0]``."""
    os.environ["TOKIO_WORKER_THREADS"] = str(request["threads"])  # DataFusion's runtime starts here
    os.chdir(request["cwd"])
    own = dict(zip(request["fds"], fds[1:]))  # the owner's fd numbers -> ours
    for spec in request["tables"].values():
        for src in spec["sources"]:
            for key in ("stream", "batch"):
                if key in src:
                    src[key][0] = own[src[key][0]]
    out = os.fdopen(fds[0], "wb")
    reserve = bytearray(1 << 20)  # given back to say "out of memory" when Python runs out
    try:
        _serve(request, out)
    except QueryStopped as e:
        _record(out, b"E", json.dumps({"kind": type(e).__name__, "message": str(e)}).encode())
    except MemoryError:
        del reserve
        _record(out, b"E", json.dumps({"kind": QueryOutOfMemory.__name__, "message": ""}).encode())
    except Exception as e:  # noqa: BLE001 (DataFusion raises plain Exception: its message is the answer)
        _record(out, b"E", json.dumps({"kind": QueryFailed.__name__, "message": one_line(e)}).encode())
    else:
        _record(out, b"D", b"")


def _supervise(request: dict[str, Any], fds: list[int]) -> int:
    """A query's supervisor (forked by the server), the leader of its own process group, which the
    owner kills at the deadline: it forks the query process, waits for it and says how it ended
    when that was not with a last record of its own (an abort under the memory cap)."""
    os.setsid()
    out = fds[0]
    try:
        _write_record(out, b"P", json.dumps({"group": os.getpid()}).encode())
        pid = os.fork()
        if pid == 0:
            try:
                _query(request, fds)
                code = 0
            except BaseException:  # noqa: BLE001 (the owner is gone, or worse: it reads the end of the pipe)
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        _write_record(out, b"X", json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode())
    except OSError:  # the owner stopped reading
        return 1
    return 0


def _write_record(fd: int, kind: bytes, payload: bytes) -> None:
    left = memoryview(_HEADER.pack(kind, len(payload)) + payload)
    while left:
        left = left[os.write(fd, left) :]


def _receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """One request and its fds from the owner; None once the owner is gone."""
    head, fds, _, _ = socket.recv_fds(sock, 8, 1024)
    if not head:
        for fd in fds:
            os.close(fd)
        return None
    while len(head) < 8:
        more = sock.recv(8 - len(head))
        if not more:
            return None
        head += more
    (size,) = struct.unpack("<Q", head)
    body = bytearray()
    while len(body) < size:
        chunk = sock.recv(min(size - len(body), 1 << 20))
        if not chunk:
            return None
        body += chunk
    return json.loads(body), fds


def serve_forever() -> None:
    """The server: forks a supervisor per request, reaps them, and ends with its owner's socket
    (killing the queries still running). One thread only, so that forking is safe."""
    import select

    import datafusion  # noqa: F401 (imported once, here: what every query process starts with)
    import pyarrow.dataset  # noqa: F401
    import pyarrow.ipc  # noqa: F401

    from . import arrow_ipc, schema  # noqa: F401

    sock = socket.socket(fileno=os.dup(0))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # (fd 0 is not to be taken by a query's fds)
    os.close(null)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    running: set[int] = set()  # supervisors (each its own process group)
    watched: list[socket.socket | int] = [sock, wake_r]
    while True:
        ready, _, _ = select.select(watched, [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap(running)
        if sock not in ready:
            continue
        got = _receive(sock)
        if got is None:
            break
        request, fds = got
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            sock.close()
            os.close(wake_r)
            os.close(wake_w)
            os._exit(_supervise(request, fds))
        for fd in fds:
            os.close(fd)
        running.add(pid)
    for pid in list(running):  # the owner is gone: so are its queries
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def _reap(running: set[int]) -> None:
    while running:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        running.discard(pid)


def main() -> None:
    serve_forever()


if __name__ == "__main__":
    main()
