"""Agent side of telemetry: this host's tables, built from what the agent already keeps, and
the part of a query the client pushes down (projection, filters, limit, or partial aggregates
that relays merge per subtree), run by DataFusion.

Loaded into every agent through the ``monarch_torchx.modules`` entry point; pyarrow is imported
at the first query (or once a host has much output waiting to be indexed), not at agent start.
No query runs in the agent: each runs in a process of its own under a memory and a time limit
(``sandbox.py``), which maps this host's tables from memory files, so a query that asks too
much fails alone and the agent and its replicas live on. (A relay merging its subtree's partial
aggregates runs DataFusion here, with SQL of ours only and a bounded memory pool.)
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

from ..private import private_dir
from ..seam import AgentHost
from .arrow_ipc import from_ipc, to_ipc
from .partial import merge
from .sandbox import (
    Inputs,
    QueryServer,
    QueryTimedOut,
    agent_limits,
    aligned,
    bounded_context,
    collect_query,
    memory_file,
    pwrite_all,
    run_query,
)
from .schema import TABLES, arrow_schema

_CHUNK = 8 << 20


def _env_int(name: str, default: int) -> int:
    try:
        return int(float(os.environ.get(name, default)))
    except ValueError:
        return default


class _Segment:
    """One memory file of the log index: serialized record batches one after another, mapped
    read-only here (the index's batches are views on it, no copy) and by query processes."""

    def __init__(self, capacity: int):
        import mmap

        import pyarrow as pa

        self.fd = memory_file("logs")
        os.ftruncate(self.fd, capacity)  # sparse: pages exist once written
        self.capacity = capacity
        self.used = 0
        self.live = 0  # stored batches that still point into it
        self.sealed = False  # a newer segment takes new batches
        self.view = pa.py_buffer(mmap.mmap(self.fd, capacity, mmap.MAP_SHARED, mmap.PROT_READ))

    def close(self) -> None:
        """Its memory goes once no batch maps it any more (a query process holds its own map)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass(frozen=True)
class Stored:
    """One batch of the log index: rows ``start``.. of the batch serialized at ``offset``."""

    segment: _Segment
    offset: int
    length: int
    start: int
    rows: int
    whole: Any  # the serialized batch, zero-copy over the segment's map

    @property
    def batch(self) -> Any:
        return self.whole.slice(self.start, self.rows)

    def without_first(self, n: int) -> Stored:
        return Stored(self.segment, self.offset, self.length, self.start + n, self.rows - n, self.whole)


class BatchArena:
    """Where the log index keeps its batches: memory files (``memfd``, close-on-exec) that a query
    process maps without a copy, instead of the agent's heap, where every query would have to
    copy them out. A file is closed once none of its batches is kept."""

    def __init__(self, segment_bytes: int = 64 << 20):
        self.segment_bytes = segment_bytes
        self.current: _Segment | None = None
        self.segments: list[_Segment] = []

    def put(self, batch: Any) -> Stored:
        """``batch`` written to the current memory file (a new one when it is full); its view."""
        import mmap

        import pyarrow as pa

        message = batch.serialize()
        need = aligned(message.size)
        seg = self.current
        if seg is None or seg.used + need > seg.capacity:
            if seg is not None:
                seg.sealed = True
                self._close_if_unused(seg)
            pages = (need + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
            seg = self.current = _Segment(max(self.segment_bytes, pages))
            self.segments.append(seg)
        offset = seg.used
        pwrite_all(seg.fd, message, offset)
        seg.used += need
        seg.live += 1
        whole = pa.ipc.read_record_batch(seg.view.slice(offset, message.size), batch.schema)
        return Stored(seg, offset, message.size, 0, batch.num_rows, whole)

    def release(self, stored: Stored) -> None:
        stored.segment.live -= 1
        self._close_if_unused(stored.segment)

    def _close_if_unused(self, seg: _Segment) -> None:
        if seg.sealed and seg.live == 0:
            seg.close()
            self.segments.remove(seg)

    def sources(self, kept: list[Stored]) -> tuple[list[list[int]], list[int]]:
        """``kept`` as a query process finds them: [fd, offset, length, first row, rows] each, and
        the fds (duplicates, the caller's to close), so that a file closed meanwhile stays valid."""
        dups: dict[int, int] = {}
        out = []
        try:
            for s in kept:
                seg = s.segment
                if id(seg) not in dups:
                    dups[id(seg)] = os.dup(seg.fd)
                out.append([dups[id(seg)], s.offset, s.length, s.start, s.rows])
        except BaseException:
            for fd in dups.values():
                os.close(fd)
            raise
        return out, list(dups.values())

    def close(self) -> None:
        for seg in self.segments:
            seg.close()
        self.segments = []
        self.current = None


class LogIndex:
    """Every replica's log lines as Arrow, kept up to date in the background, bounded.

    The newest ``max_rows`` rows stay in memory; older batches spill to Parquet on node-local disk
    (``$TMPDIR``) and stay queryable; spilled files past ``max_age_s`` or beyond ``max_spill_bytes``
    are dropped, oldest first. (The replica log files that `torchx log` reads are not affected;
    a segment of them the agent dropped before it was indexed is not indexed.)
    """

    def __init__(self, agent: AgentHost, spill_dir: Path):
        self.agent = agent
        self.offsets: dict[Path, int] = {}
        self.arena = BatchArena()
        self.batches: list[Stored] = []
        self.rows = 0
        self.spill_dir = spill_dir
        self.spilled: list[tuple[Path, int, int]] = []  # (file, newest ts in us, bytes)
        self.max_rows = _env_int("MONARCH_TORCHX_TELEMETRY_MAX_ROWS", 5_000_000)
        self.max_spill_bytes = _env_int("MONARCH_TORCHX_TELEMETRY_MAX_SPILL_BYTES", 4 << 30)
        self.max_age_s = _env_int("MONARCH_TORCHX_TELEMETRY_MAX_AGE_S", 7 * 86400)
        self._lock = threading.Lock()  # the background refresh and queries run in worker threads
        self.queried = False  # from the first query on, new output is indexed in the background

    def backlog(self) -> tuple[int, int]:
        """(bytes written to the replicas' logs in all, bytes on disk not indexed yet), from the
        sizes the agent keeps (``ReplicaLog.files``): a warm pool keeps hundreds of ended apps,
        and the loop is not to stat their files every second."""
        total = pending = 0
        for rep in list(self.agent.procs.replicas.values()):
            total += sum(s.written for s in rep.log.streams.values())
            for _, path, size in rep.log.files():
                pending += size - self.offsets.get(path, 0)
        return total, pending

    def refresh(self) -> None:
        """New lines in; retention applied."""
        with self._lock:
            self._append_new()
            self._retain()

    def add_to(self, inputs: Inputs) -> None:
        """Brought up to date, then given to a query as table ``logs``: the batches in memory (as
        memory files to map) and the spilled Parquet files."""
        with self._lock:
            self._append_new()
            self._retain()
            sources, fds = self.arena.sources(self.batches)
            inputs.add_batches("logs", "logs", sources, fds)
            inputs.add_parquet("logs", "logs", [str(p) for p, _, _ in self.spilled])

    def close(self) -> None:
        with self._lock:
            self.batches = []
            self.arena.close()

    def _retain(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if self.rows > self.max_rows:
            keep, old = self.rows, []
            target = self.max_rows // 2  # spill down to half, so that it happens rarely
            while self.batches and keep > target:
                s = self.batches.pop(0)
                extra = keep - target
                b = s.batch
                if s.rows > extra:  # split: the newest rows of this batch stay in memory
                    self.batches.insert(0, s.without_first(extra))
                    b = b.slice(0, extra)
                else:
                    self.arena.release(s)
                keep -= b.num_rows
                old.append(b)
            self.rows = keep
            private_dir(self.spill_dir)  # on a shared node: ours alone, checked
            path = self.spill_dir / f"logs-{time.time_ns()}.parquet"
            table = pa.Table.from_batches(old)
            pq.write_table(table, path)
            newest = table.column("ts").cast(pa.int64()).to_numpy().max() if table.num_rows else 0
            self.spilled.append((path, int(newest), path.stat().st_size))
        cutoff = (time.time() - self.max_age_s) * 1_000_000
        while self.spilled and (
            self.spilled[0][1] < cutoff or sum(b for _, _, b in self.spilled) > self.max_spill_bytes
        ):
            path, _, _ = self.spilled.pop(0)
            path.unlink(missing_ok=True)

    def _append_new(self) -> None:
        hostname = socket.gethostname()
        offsets: dict[Path, int] = {}  # of the segments still on disk: a dropped one's entry goes
        for (app_id, role, replica), rep in list(self.agent.procs.replicas.items()):
            for stream, path, size in rep.log.files():
                off = self.offsets.get(path, 0)
                while off < size:
                    try:
                        with open(path, "rb") as f:
                            f.seek(off)
                            data = f.read(min(_CHUNK, size - off))
                    except FileNotFoundError:  # dropped by the agent meanwhile: not to be indexed
                        off = size
                        break
                    end = data.rfind(b"\n")
                    if end < 0:
                        break
                    off += end + 1
                    batch = _parse_lines(data[:end], self.agent.index, hostname, app_id, role, replica, rep.pid, stream)
                    self.batches.append(self.arena.put(batch))
                    self.rows += batch.num_rows
                offsets[path] = off
        self.offsets = offsets


def _parse_lines(
    body: bytes, host: int, hostname: str, app_id: str, role: str, replica: int, pid: int | None, stream: str
) -> Any:
    """``TS LINE`` lines -> one record batch without a Python object per line.

    Offsets of the lines come from numpy, the timestamp is the fixed-width prefix the agent wrote
    (``%.6f``, 17 bytes), and Arrow slices and casts in C++ (off the GIL): indexing must not
    slow down the agent that is reading a chatty process's pipe.
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    buf = np.frombuffer(body + b"\n", np.uint8)
    ends = np.flatnonzero(buf == 10)
    offsets = np.empty(len(ends) + 1, np.int32)
    offsets[0] = 0
    offsets[1:] = ends + 1
    raw = pa.Array.from_buffers(pa.binary(), len(ends), [None, pa.py_buffer(offsets), pa.py_buffer(buf)])
    if len(ends) and (np.diff(offsets).min() < 19 or not (buf[offsets[:-1] + 17] == 32).all()):
        parts = pc.split_pattern(pc.binary_slice(raw, 0, -1), b" ", max_splits=1)  # not our stamp: the slow way
        ts_text, text = pc.list_element(parts, 0), pc.list_element(parts, 1)
    else:
        ts_text, text = pc.binary_slice(raw, 0, 17), pc.binary_slice(raw, 18, -1)
    ts = pc.cast(pc.multiply(pc.cast(pc.cast(ts_text, pa.string()), pa.float64()), 1e6), pa.int64())
    try:
        line = pc.cast(text, pa.string())
    except pa.ArrowInvalid:  # not UTF-8: decode as the log reader does
        line = pa.array(
            [b.decode("utf-8", errors="replace").rstrip("\n") if b is not None else "" for b in text.to_pylist()]
        )
    zeros = pa.nulls(len(raw), pa.int32()).fill_null(0)

    def const(value: Any, typ: Any) -> Any:
        return pa.array([value], typ).take(zeros)

    schema = arrow_schema("logs")
    return pa.record_batch(
        [
            ts.cast(pa.timestamp("us", tz="UTC")),
            const(host, pa.int32()),
            const(hostname, pa.string()),
            const(app_id, pa.string()),
            const(role, pa.string()),
            const(replica, pa.int32()),
            const(pid, pa.int64()),
            const(stream, pa.string()),
            line,
        ],
        schema=schema,
    )


def _proc_usage(pid: int | None) -> tuple[float | None, int | None]:
    if not pid:
        return None, None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return (int(stat[11]) + int(stat[12])) / ticks, int(stat[21]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return None, None


MAX_METRIC_ROWS = 500_000
METRICS_INTERVAL_S = float(os.environ.get("MONARCH_TORCHX_METRICS_S", "5"))
# an agent ends its query server after this long without a query (the next query starts it again)
QUERY_SERVER_IDLE_S = float(os.environ.get("MONARCH_TORCHX_SQL_SERVER_IDLE_S", "120"))


class Metrics:
    """Host, replica and GPU gauges sampled every few seconds into a bounded buffer."""

    def __init__(self, agent: AgentHost):
        self.agent = agent
        self.rows: list[tuple] = []
        self._nvidia_smi = shutil.which("nvidia-smi")

    def sample(self) -> None:
        now = _us(time.time())
        add = self.rows.append
        h = self.agent.index
        add((now, h, "host.load1", os.getloadavg()[0], "{}"))
        try:
            mem = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
            total, avail = (int(mem[k].split()[0]) * 1024 for k in ("MemTotal", "MemAvailable"))
            add((now, h, "host.mem_used_bytes", float(total - avail), "{}"))
        except (OSError, KeyError, ValueError):
            pass
        for (app_id, role, replica), rep in list(self.agent.procs.replicas.items()):
            if rep.state != "RUNNING":
                continue
            cpu, rss = _proc_usage(rep.pid)
            labels = json.dumps({"app_id": app_id, "role": role, "replica": replica, "pid": rep.pid})
            if cpu is not None:
                add((now, h, "proc.cpu_s", cpu, labels))
                add((now, h, "proc.rss_bytes", float(rss or 0), labels))
        if self._nvidia_smi:
            import subprocess

            try:
                out = subprocess.run(
                    [
                        self._nvidia_smi,
                        "--query-gpu=index,utilization.gpu,memory.used",
                        "--format=csv,noheader,nounits",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=5,
                ).stdout
                for line in out.strip().splitlines():
                    idx, util, used = (x.strip() for x in line.split(","))
                    add((now, h, "gpu.util_pct", float(util), json.dumps({"gpu": int(idx)})))
                    add((now, h, "gpu.mem_used_bytes", float(used) * 2**20, json.dumps({"gpu": int(idx)})))
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
        del self.rows[:-MAX_METRIC_ROWS]

    def batch(self) -> Any:
        import pyarrow as pa

        schema = arrow_schema("metrics")
        cols: list[Any] = list(zip(*self.rows)) if self.rows else [[] for _ in schema]
        return pa.record_batch(
            [pa.array(list(c), _storage(f.type)).cast(f.type) for c, f in zip(cols, schema)], schema=schema
        )


def procs_batch(agent: Any) -> Any:
    import pyarrow as pa

    rows: dict[str, list] = {name: [] for name, _, _ in TABLES["procs"]}
    hostname = socket.gethostname()
    for (app_id, role, replica), rep in list(agent.procs.replicas.items()):
        live = rep.state == "RUNNING"
        cpu, rss = _proc_usage(rep.pid) if live else (None, None)
        values = {
            "host": agent.index,
            "hostname": hostname,
            "pid": rep.pid,
            "app_id": app_id,
            "role": role,
            "replica": replica,
            "state": rep.state,
            "cpu_s": cpu,
            "rss_bytes": rss,
            "started": _us(rep.started),
            "ended": _us(rep.ended),
            "exit_code": rep.exit_code,
            "attempts": rep.attempts,
            "msg": rep.msg,
        }
        for k, v in values.items():
            rows[k].append(v)
    return pa.record_batch(
        [pa.array(rows[f.name], _storage(f.type)).cast(f.type) for f in arrow_schema("procs")],
        schema=arrow_schema("procs"),
    )


def gpus_batch(agent: Any) -> Any:
    """This host's GPU samples (NVML, through its agent); none on a host without NVML (its
    `pool status` says why: ``capacity.gpu_note``)."""
    import pyarrow as pa

    samples = agent.gpu_samples()
    rows: dict[str, list] = {name: [] for name, _, _ in TABLES["gpus"]}
    for s in samples:
        values = {
            "ts": _us(s["ts"]),
            "host": agent.index,
            "gpu": s["gpu"],
            "uuid": s["uuid"],
            "name": s["name"],
            "util_pct": s["util_pct"],
            "mem_used_mb": s["mem_used_mb"],
            "mem_total_mb": s["mem_total_mb"],
            "temp_c": s["temp_c"],
            "power_w": s["power_w"],
            "ecc_uncorrected": s["ecc_uncorrected"],
            "retired_pending": None if s["retired_pending"] is None else int(s["retired_pending"]),
            "healthy": int(s["healthy"]),
            "problem": s["problem"],
            "held_by": s["held_by"],
        }
        for k, v in values.items():
            rows[k].append(v)
    return pa.record_batch(
        [pa.array(rows[f.name], _storage(f.type)).cast(f.type) for f in arrow_schema("gpus")],
        schema=arrow_schema("gpus"),
    )


def events_batch(agent: Any) -> Any:
    import pyarrow as pa

    rows: dict[str, list] = {name: [] for name, _, _ in TABLES["events"]}

    def add(ts: float, kind: str, name: str, app_id: str | None, duration: float | None, fields: dict) -> None:
        for k, v in zip(rows, (_us(ts), agent.index, kind, name, app_id, duration, json.dumps(fields))):
            rows[k].append(v)

    add(
        agent.started,
        "pool",
        "host_start",
        None,
        None,
        {"pid": os.getpid(), "incarnation": agent.incarnation, "pool": agent.pool},
    )
    by_app: dict[str, list[Any]] = {}
    for (app_id, _, _), rep in list(agent.procs.replicas.items()):
        by_app.setdefault(app_id, []).append(rep)
    for app_id, reps in by_app.items():  # an app's life on this host: from its first launch to its last exit
        first = min(r.started for r in reps)
        add(first, "app", "launch", app_id, None, {"replicas": len(reps)})
        if all(r.ended for r in reps):
            last = max(r.ended for r in reps)
            states = sorted({r.state for r in reps})
            add(last, "app", "end", app_id, last - first, {"replicas": len(reps), "states": states})
    for (app_id, role, replica), rep in list(agent.procs.replicas.items()):
        add(rep.started, "replica", "start", app_id, None, {"role": role, "replica": replica, "argv": rep.spec.argv})
        if rep.ended:
            add(
                rep.ended,
                "replica",
                "exit",
                app_id,
                rep.ended - rep.started,
                {
                    "role": role,
                    "replica": replica,
                    "state": rep.state,
                    "exit_code": rep.exit_code,
                    "attempts": rep.attempts,
                    "msg": rep.msg,
                },
            )
    return pa.record_batch(
        [pa.array(rows[f.name], _storage(f.type)).cast(f.type) for f in arrow_schema("events")],
        schema=arrow_schema("events"),
    )


def _us(ts: float | None) -> int | None:
    return None if ts is None else int(ts * 1_000_000)


def _storage(t: Any) -> Any:
    import pyarrow as pa

    return pa.int64() if pa.types.is_timestamp(t) else t


def query_inputs(agent: Any, logs: LogIndex, stacks: Stacks, metrics: Metrics, tables: list[str]) -> Inputs:
    """This host's tables ``tables`` as a query process finds them (``sandbox.Inputs``): the log
    index's memory files and spilled Parquet, the small tables written out for this query."""
    import pyarrow as pa

    inputs = Inputs()
    try:
        for name in tables:
            if name == "logs":
                logs.queried = True
                logs.add_to(inputs)
                continue
            if name == "procs":
                batch = procs_batch(agent)
            elif name == "events":
                batch = events_batch(agent)
            elif name == "stacks":
                batch = stacks.batch()
            elif name == "metrics":
                batch = metrics.batch()
            elif name == "gpus":
                batch = gpus_batch(agent)
            else:
                raise ValueError(f"unknown table {name!r}: tables are {', '.join(TABLES)}")
            inputs.add_table(name, pa.Table.from_batches([batch]))
    except BaseException:
        inputs.close()
        raise
    return inputs


async def _acquire(slots: Any, timeout: float) -> bool:
    """One of ``slots`` (an asyncio.Semaphore) within ``timeout``; False if none came free. A
    slot granted as the wait ends (or as the caller is cancelled) is given back, never lost."""
    import asyncio

    task = asyncio.ensure_future(slots.acquire())
    try:
        done, _ = await asyncio.wait([task], timeout=timeout)
    except BaseException:
        done = set()
        if not task.cancel() and not task.cancelled() and task.exception() is None:
            slots.release()
        raise
    if task in done:
        return True
    if not task.cancel() and not task.cancelled() and task.exception() is None:
        slots.release()
    return False


MAX_STACK_ROWS = 200_000
# query processes running at once on a host (each under the memory limit); a further query waits,
# its wait counted in its time limit
QUERY_SLOTS = 2
INDEX_INTERVAL_S = float(os.environ.get("MONARCH_TORCHX_TELEMETRY_INDEX_S", "1"))
BUSY_BYTES_PER_INTERVAL = 1 << 20  # more new output than this per interval: wait for a pause
MAX_BACKLOG_BYTES = 256 << 20  # ... unless this much is waiting
# a host that was never queried leaves its logs in their files until this much output waits: an
# agent that only runs short jobs never imports pyarrow (memory and CPU on every host:
# benchmarks/RESULTS.md, "numbers behind the code")
LAZY_BYTES = _env_int("MONARCH_TORCHX_TELEMETRY_LAZY_BYTES", 8 << 20)
_FORKSERVER = os.path.join("monarch_torchx", "agent", "forkserver.py")


class Stacks:
    """py-spy dumps of replicas (and their children), kept as rows for the ``stacks`` table."""

    def __init__(self, agent: AgentHost):
        self.agent = agent
        self.rows: list[dict] = []

    def _py_spy(self) -> str:
        import shutil
        import sys

        beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
        found = beside if os.path.exists(beside) else shutil.which("py-spy")
        if not found:
            raise ValueError("py-spy is not installed on this host (pip install py-spy)")
        return found

    async def dump(self, app_id: str | None) -> dict:
        import asyncio

        exe = self._py_spy()
        now = _us(time.time())
        reps = [
            (k, r)
            for k, r in list(self.agent.procs.replicas.items())
            if r.state == "RUNNING" and r.pid and (app_id is None or k[0] == app_id)
        ]
        added, errors = 0, []
        for (a, role, replica), rep in reps:
            proc = await asyncio.create_subprocess_exec(
                exe,
                "dump",
                "--pid",
                str(rep.pid),
                "--json",
                "--subprocesses",
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            try:
                out, err = await asyncio.wait_for(proc.communicate(), 20)
            except asyncio.TimeoutError:
                proc.kill()
                errors.append(f"{a} {role}/{replica} pid {rep.pid}: py-spy timed out")
                continue
            if proc.returncode != 0:  # exited meanwhile, or not a Python process
                why = [x for x in (err or out).decode(errors="replace").splitlines() if x.startswith("Error")]
                errors.append(
                    f"{a} {role}/{replica} pid {rep.pid}: {why[0].removeprefix('Error: ') if why else 'py-spy failed'}"
                )
                continue
            for thread in json.loads(out or b"[]"):
                frames = thread.get("frames") or []
                # a warm-started replica sits on the fork server's frames: they are ours, not the user's
                cut = next(
                    (k for k, fr in enumerate(frames) if str(fr.get("filename", "")).endswith(_FORKSERVER)), None
                )
                for depth, fr in enumerate(frames[:cut]):
                    self.rows.append(
                        {
                            "ts": now,
                            "host": self.agent.index,
                            "app_id": a,
                            "role": role,
                            "replica": replica,
                            "pid": thread.get("pid", rep.pid),
                            "thread": thread.get("os_thread_id") or thread.get("thread_id"),
                            "thread_name": thread.get("thread_name"),
                            "depth": depth,
                            "function": fr.get("name"),
                            "file": fr.get("filename"),
                            "line": fr.get("line"),
                        }
                    )
                    added += 1
        del self.rows[:-MAX_STACK_ROWS]
        return {"rows": added, "processes": len(reps), "errors": errors}

    def batch(self) -> Any:
        import pyarrow as pa

        schema = arrow_schema("stacks")
        return pa.record_batch(
            [pa.array([r[f.name] for r in self.rows], _storage(f.type)).cast(f.type) for f in schema], schema=schema
        )


class TelemetryModule:
    """This host's telemetry, plugged into its agent (``AgentModule``): the ``telemetry.*``
    operations, log indexing and metrics sampling in the background, the spill dropped at stop."""

    def __init__(self, agent: AgentHost):
        import asyncio

        from ..private import agent_temp_dir, node_temp_root

        self.agent = agent
        self.root = node_temp_root()
        self.spill = agent_temp_dir("telemetry", agent.pool, agent.index)
        self.logs = LogIndex(agent, self.spill)
        self.stacks = Stacks(agent)
        self.metrics = Metrics(agent)
        self.limits = agent_limits()
        self.slots = asyncio.Semaphore(QUERY_SLOTS)
        self.server = QueryServer(self.spill)  # started at the first query
        # Log indexing, and the tables a query reads, are made on two threads of our own: a query
        # (or the indexer) does not wait for the agent's shared executor, nor holds it.
        self.worker = ThreadPoolExecutor(2, thread_name_prefix="telemetry")

    # ------------------------------------------------------------ the seam

    def operations(self) -> dict[str, Any]:
        return {
            "telemetry.stacks": (self.op_stacks, None),
            "telemetry.query": (self.op_query, None),
            "telemetry.partial": (self.op_partial, self.merge_subtree),
            "telemetry.rows": (self.op_rows, self.cut_subtree),
        }

    def background_tasks(self) -> list[Any]:
        return [self.index_in_background(), self.sample_metrics(), self.close_idle_server()]

    def warm_imports(self) -> list[str]:
        return []

    def stop(self) -> None:
        """The data lives as long as the pool: its spill goes with the agent."""
        from ..private import remove_empty_dirs

        self.worker.shutdown(wait=False, cancel_futures=True)
        self.server.close()
        self.logs.close()
        shutil.rmtree(self.spill, ignore_errors=True)
        remove_empty_dirs(self.spill.parent, self.root)

    # ------------------------------------------------------------ operations

    async def op_stacks(self, peer: Any, app_id: str | None = None) -> dict:
        return await self.stacks.dump(app_id)

    async def op_query(self, peer: Any, sql: str, tables: list[str], timeout_s: float | None = None) -> Any:
        """A pushed-down query's rows, as Arrow IPC streams of at most ``sandbox.FRAME_ROWS`` rows
        each, passed on one frame at a time as the query process writes them. ``timeout_s``: the
        caller's time limit (the agent's own, ``MONARCH_TORCHX_SQL_TIMEOUT_S``, where that is less)."""
        from ..wire import Stream

        return Stream(self.answer(sql, tables, "stream", timeout_s))

    async def op_partial(self, peer: Any, sql: str, table: str, merge: str, timeout_s: float | None = None) -> bytes:
        """This host's partial aggregates (``partial.py``); relays merge their subtree's with ``merge``."""
        return await self._one_answer(sql, table, timeout_s)

    async def op_rows(self, peer: Any, sql: str, table: str, timeout_s: float | None = None) -> bytes:
        """A LIMIT-bounded pushed-down query's rows (``query.pushdowns``); relays cut their
        subtree's to the same limit (``cut_subtree``)."""
        return await self._one_answer(sql, table, timeout_s)

    async def _one_answer(self, sql: str, table: str, timeout_s: float | None) -> bytes:
        """This host's answer to ``sql`` over ``table``, as one Arrow IPC stream (for relays to combine)."""
        frames = [f async for f in self.answer(sql, [table], "one", timeout_s)]
        return frames[0]

    async def answer(self, sql: str, tables: list[str], mode: str, timeout_s: float | None) -> AsyncIterator[bytes]:
        """``sql`` over this host's ``tables``, run by a query process of its own (``sandbox.py``)
        under this host's limits: frames of its answer. Raises a ``sandbox.QueryStopped``."""
        import asyncio

        loop = asyncio.get_running_loop()
        limits = self.limits.within(timeout_s)
        deadline = loop.time() + limits.timeout_s
        if not await _acquire(self.slots, limits.timeout_s):
            raise QueryTimedOut(
                f"it waited its whole time limit of {limits.timeout_s:.3g} s for one of the "
                f"{QUERY_SLOTS} queries running on this host to end"
            )
        try:
            inputs = await self._inputs(tables)
            async for frame in run_query(
                self.server, sql, inputs, limits.within(deadline - loop.time()), self.spill, mode
            ):
                yield frame
        finally:
            self.slots.release()

    async def _inputs(self, tables: list[str]) -> Inputs:
        """The tables, made on our thread; if the caller goes meanwhile, their memory files are closed."""
        import asyncio

        made = self.worker.submit(query_inputs, self.agent, self.logs, self.stacks, self.metrics, tables)
        try:
            return await asyncio.wrap_future(made)
        except asyncio.CancelledError:

            def close_unclaimed(f: Future[Inputs]) -> None:
                if not f.cancelled() and f.exception() is None:
                    f.result().close()

            made.add_done_callback(close_unclaimed)
            raise

    def merge_subtree(self, args: dict, values: list[Any]) -> Any:
        """The relay's combiner for ``telemetry.partial``: its subtree's partials, merged into one.
        Runs here: the SQL is ours (sums, minima and maxima by group, no function of the user's),
        whose memory DataFusion's pool bounds, spilling to this agent's private directory."""
        from ..private import private_dir

        ctx = bounded_context(self.limits, private_dir(self.spill / "merge"))
        return to_ipc(merge([from_ipc([v]) for v in values], args["merge"], ctx))[0]

    def cut_subtree(self, args: dict, values: list[Any]) -> Any:
        """The relay's combiner for ``telemetry.rows``: its subtree's rows, cut to the query's LIMIT
        by running the hosts' query again over them (its filters hold already), in a query process
        as the hosts' own ran (the filters and order are the user's)."""
        inputs = Inputs()
        try:
            inputs.add_streams(args["table"], values)
        except BaseException:
            inputs.close()
            raise
        return collect_query(
            self.server, args["sql"], inputs, self.limits.within(args.get("timeout_s")), self.spill, "one"
        )[0]

    # ------------------------------------------------------------ background

    async def index_in_background(self) -> None:
        """Indexes when output pauses (or the backlog grows large), so that a chatty process is not
        competing with its own indexing for CPU; a query indexes whatever is pending anyway."""
        import asyncio

        loop = asyncio.get_running_loop()
        last_total = 0
        while True:
            await asyncio.sleep(INDEX_INTERVAL_S)
            total, pending = self.logs.backlog()
            busy = total - last_total > BUSY_BYTES_PER_INTERVAL
            last_total = total
            if (
                not pending
                or (busy and pending < MAX_BACKLOG_BYTES)
                or (not self.logs.queried and pending < LAZY_BYTES)
            ):
                continue
            try:
                await loop.run_in_executor(self.worker, self.logs.refresh)
            except Exception as e:  # a bad file must not stop indexing the others
                import logging

                logging.getLogger("monarch_torchx.telemetry").warning("indexing logs: %s", e)

    async def sample_metrics(self) -> None:
        import asyncio

        while True:
            self.metrics.sample()
            await asyncio.sleep(METRICS_INTERVAL_S)

    async def close_idle_server(self) -> None:
        """Ends the query server once no query came for QUERY_SERVER_IDLE_S (and for longer than
        any query may run here), so that an idle host holds no DataFusion process."""
        import asyncio

        idle_s = max(QUERY_SERVER_IDLE_S, self.limits.timeout_s + 5.0)
        while True:
            await asyncio.sleep(min(30.0, idle_s / 2))
            await asyncio.get_running_loop().run_in_executor(self.worker, self.server.close_if_idle, idle_s)


def setup(agent: AgentHost) -> None:
    """Entry point (group ``monarch_torchx.modules``): serve ``telemetry.*`` on this agent."""
    agent.install(TelemetryModule(agent))
