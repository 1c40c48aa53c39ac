"""Agent side of telemetry: this host's tables, built from what the agent already keeps, and
the part of a query the client pushes down (projection, filters, limit, or partial aggregates
that relays merge per subtree), run by DataFusion.

Loaded into every agent through the ``monarch_torchx.modules`` entry point; DataFusion and
pyarrow are imported at the first query (or once a host has much output waiting to be indexed),
not at agent start.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..private import private_dir
from ..specs import TERMINAL
from .arrow_ipc import from_ipc, to_ipc
from .partial import merge, record_batches
from .query import read_only_options
from .schema import TABLES, arrow_schema

_CHUNK = 8 << 20


def _env_int(name: str, default: int) -> int:
    try:
        return int(float(os.environ.get(name, default)))
    except ValueError:
        return default


class LogIndex:
    """Every replica's log lines as Arrow, kept up to date in the background, bounded.

    The newest ``max_rows`` rows stay in memory; older batches spill to Parquet on node-local disk
    (``$TMPDIR``) and stay queryable; spilled files past ``max_age_s`` or beyond ``max_spill_bytes``
    are dropped, oldest first. (The replica log files that `torchx log` reads are not affected.)
    """

    def __init__(self, agent: Any, spill_dir: Path):
        self.agent = agent
        self.offsets: Dict[Path, int] = {}
        self.batches: List[Any] = []
        self.rows = 0
        self.spill_dir = spill_dir
        self.spilled: List[Tuple[Path, int, int]] = []  # (file, newest ts in us, bytes)
        self.max_rows = _env_int("MONARCH_TORCHX_TELEMETRY_MAX_ROWS", 5_000_000)
        self.max_spill_bytes = _env_int("MONARCH_TORCHX_TELEMETRY_MAX_SPILL_BYTES", 4 << 30)
        self.max_age_s = _env_int("MONARCH_TORCHX_TELEMETRY_MAX_AGE_S", 7 * 86400)
        self._lock = threading.Lock()  # the background refresh and queries run in worker threads
        self.queried = False  # from the first query on, new output is indexed in the background
        # the final sizes of the log files of replicas that have ended and closed them: a warm pool
        # keeps hundreds of ended apps, whose files no longer grow, and the loop is not to stat
        # them all every second (a replica dropped from the agent's history drops out of here)
        self._final: "weakref.WeakKeyDictionary[Any, List[Tuple[Path, int]]]" = weakref.WeakKeyDictionary()

    def log_sizes(self, rep: Any) -> List[Tuple[Path, int]]:
        """(path, size) of a replica's log files that exist: stat'ed while it may still write
        them, remembered once it has ended and closed them."""
        final = self._final.get(rep)
        if final is not None:
            return final
        settled = rep.state in TERMINAL and all(c.closed.done() for c in rep.captures)  # stat'ed after the close
        out = []
        for stream in ("stdout", "stderr"):
            path = rep.log_dir / f"{stream}.log"
            try:
                out.append((path, path.stat().st_size))
            except FileNotFoundError:
                continue
        if settled:
            self._final[rep] = out
        return out

    def backlog(self) -> Tuple[int, int]:
        """(bytes written to the log files in all, bytes of them not indexed yet): stats of the
        files that may still grow only."""
        total = pending = 0
        for rep in list(self.agent.procs.replicas.values()):
            for path, size in self.log_sizes(rep):
                total += size
                pending += size - self.offsets.get(path, 0)
        return total, pending

    def refresh(self) -> Tuple[List[Any], List[str]]:
        """New lines in; retention applied; returns (in-memory batches, spilled parquet files)."""
        with self._lock:
            self._append_new()
            self._retain()
            return list(self.batches), [str(p) for p, _, _ in self.spilled]

    def _retain(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if self.rows > self.max_rows:
            keep, old = self.rows, []
            target = self.max_rows // 2  # spill down to half, so that it happens rarely
            while self.batches and keep > target:
                b = self.batches.pop(0)
                extra = keep - target
                if b.num_rows > extra:  # split: the newest rows of this batch stay in memory
                    self.batches.insert(0, b.slice(extra))
                    b = b.slice(0, extra)
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
        while self.spilled and (self.spilled[0][1] < cutoff or sum(b for _, _, b in self.spilled) > self.max_spill_bytes):
            path, _, _ = self.spilled.pop(0)
            path.unlink(missing_ok=True)

    def _append_new(self) -> None:
        hostname = socket.gethostname()
        for (app_id, role, replica), rep in list(self.agent.procs.replicas.items()):
            for path, size in self.log_sizes(rep):
                stream = path.stem
                off = self.offsets.get(path, 0)
                while off < size:
                    with open(path, "rb") as f:
                        f.seek(off)
                        data = f.read(_CHUNK)
                    end = data.rfind(b"\n")
                    if end < 0:
                        break
                    off += end + 1
                    batch = _parse_lines(data[:end], self.agent.index, hostname, app_id, role, replica, rep.pid, stream)
                    self.batches.append(batch)
                    self.rows += batch.num_rows
                self.offsets[path] = off


def _parse_lines(body: bytes, host: int, hostname: str, app_id: str, role: str, replica: int,
                 pid: Optional[int], stream: str) -> Any:
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
        line = pa.array([b.decode("utf-8", errors="replace").rstrip("\n") if b is not None else "" for b in text.to_pylist()])
    zeros = pa.nulls(len(raw), pa.int32()).fill_null(0)

    def const(value: Any, typ: Any) -> Any:
        return pa.array([value], typ).take(zeros)

    schema = arrow_schema("logs")
    return pa.record_batch([
        ts.cast(pa.timestamp("us", tz="UTC")), const(host, pa.int32()), const(hostname, pa.string()),
        const(app_id, pa.string()), const(role, pa.string()), const(replica, pa.int32()),
        const(pid, pa.int64()), const(stream, pa.string()), line,
    ], schema=schema)


def _proc_usage(pid: Optional[int]) -> Tuple[Optional[float], Optional[int]]:
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


class Metrics:
    """Host, replica and GPU gauges sampled every few seconds into a bounded buffer."""

    def __init__(self, agent: Any):
        self.agent = agent
        self.rows: List[tuple] = []
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
                out = subprocess.run([self._nvidia_smi, "--query-gpu=index,utilization.gpu,memory.used",
                                      "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5).stdout
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
        cols = list(zip(*self.rows)) if self.rows else [[] for _ in schema]
        return pa.record_batch([pa.array(list(c), _storage(f.type)).cast(f.type) for c, f in zip(cols, schema)],
                               schema=schema)


def procs_batch(agent: Any) -> Any:
    import pyarrow as pa

    rows: Dict[str, list] = {name: [] for name, _, _ in TABLES["procs"]}
    hostname = socket.gethostname()
    for (app_id, role, replica), rep in list(agent.procs.replicas.items()):
        live = rep.state == "RUNNING"
        cpu, rss = _proc_usage(rep.pid) if live else (None, None)
        values = {"host": agent.index, "hostname": hostname, "pid": rep.pid, "app_id": app_id, "role": role,
                  "replica": replica, "state": rep.state, "cpu_s": cpu, "rss_bytes": rss,
                  "started": _us(rep.started), "ended": _us(rep.ended), "exit_code": rep.exit_code,
                  "attempts": rep.attempts, "msg": rep.msg}
        for k, v in values.items():
            rows[k].append(v)
    return pa.record_batch([pa.array(rows[f.name], _storage(f.type)).cast(f.type) for f in arrow_schema("procs")],
                           schema=arrow_schema("procs"))


def events_batch(agent: Any) -> Any:
    import pyarrow as pa

    rows: Dict[str, list] = {name: [] for name, _, _ in TABLES["events"]}

    def add(ts: float, kind: str, name: str, app_id: Optional[str], duration: Optional[float], fields: dict) -> None:
        for k, v in zip(rows, (_us(ts), agent.index, kind, name, app_id, duration, json.dumps(fields))):
            rows[k].append(v)

    add(agent.started, "pool", "host_start", None, None, {"pid": os.getpid(), "incarnation": agent.incarnation,
                                                            "pool": agent.pool})
    by_app: Dict[str, List[Any]] = {}
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
            add(rep.ended, "replica", "exit", app_id, rep.ended - rep.started,
                {"role": role, "replica": replica, "state": rep.state, "exit_code": rep.exit_code,
                 "attempts": rep.attempts, "msg": rep.msg})
    return pa.record_batch([pa.array(rows[f.name], _storage(f.type)).cast(f.type) for f in arrow_schema("events")],
                           schema=arrow_schema("events"))


def _us(ts: Optional[float]) -> Optional[int]:
    return None if ts is None else int(ts * 1_000_000)


def _storage(t: Any) -> Any:
    import pyarrow as pa

    return pa.int64() if pa.types.is_timestamp(t) else t


def query_tables(agent: Any, logs: LogIndex, stacks: "Stacks", metrics: "Metrics", sql: str,
                 tables: List[str]) -> Any:
    """Runs a pushed-down query (or a partial aggregate) over this host's tables -> pyarrow.Table."""
    import pyarrow as pa
    from datafusion import SessionContext

    ctx = SessionContext()
    for name in tables:
        if name == "logs":
            logs.queried = True
            batches, spilled = logs.refresh()
            if spilled:  # memory and Parquet on local disk, one table, filters pushed into both
                import pyarrow.dataset as ds

                parts = [ds.dataset(spilled, format="parquet", schema=arrow_schema("logs"))]
                if batches:
                    parts.append(ds.dataset(pa.Table.from_batches(batches, schema=arrow_schema("logs"))))
                ctx.register_dataset(name, ds.dataset(parts))
                continue
        elif name == "procs":
            batches = [procs_batch(agent)]
        elif name == "events":
            batches = [events_batch(agent)]
        elif name == "stacks":
            batches = [stacks.batch()]
        elif name == "metrics":
            batches = [metrics.batch()]
        else:
            raise ValueError(f"unknown table {name!r}: tables are {', '.join(TABLES)}")
        ctx.register_record_batches(name, [batches or [pa.record_batch([pa.array([], f.type) for f in arrow_schema(name)],
                                                                        schema=arrow_schema(name))]])
    return ctx.sql_with_options(sql, read_only_options()).to_arrow_table()




def merge_subtree(args: dict, values: List[Any]) -> Any:
    """The relay's combiner for ``telemetry.partial``: its subtree's partials, merged into one."""
    return to_ipc(merge([from_ipc([v]) for v in values], args["merge"]))[0]


def cut_subtree(args: dict, values: List[Any]) -> Any:
    """The relay's combiner for ``telemetry.rows``: its subtree's rows, cut to the query's LIMIT
    by running the hosts' query again over them (its filters hold already)."""
    import pyarrow as pa
    from datafusion import SessionContext

    rows = pa.concat_tables([from_ipc([v]) for v in values], promote_options="permissive")
    ctx = SessionContext()
    ctx.register_record_batches(args["table"], [record_batches(rows)])
    return to_ipc(ctx.sql_with_options(args["sql"], read_only_options()).to_arrow_table())[0]


MAX_STACK_ROWS = 200_000
BATCH_ROWS = 262_144  # rows per frame of a query's answer
INDEX_INTERVAL_S = float(os.environ.get("MONARCH_TORCHX_TELEMETRY_INDEX_S", "1"))
BUSY_BYTES_PER_INTERVAL = 1 << 20  # more new output than this per interval: wait for a pause
MAX_BACKLOG_BYTES = 256 << 20  # ... unless this much is waiting
# a host that was never queried leaves its logs in their files until this much output waits: an
# agent that only runs short jobs never imports pyarrow (tens of MiB and ~0.2 s of CPU per host)
LAZY_BYTES = _env_int("MONARCH_TORCHX_TELEMETRY_LAZY_BYTES", 8 << 20)
_FORKSERVER = os.path.join("monarch_torchx", "agent", "forkserver.py")


class Stacks:
    """py-spy dumps of replicas (and their children), kept as rows for the ``stacks`` table."""

    def __init__(self, agent: Any):
        self.agent = agent
        self.rows: List[dict] = []

    def _py_spy(self) -> str:
        import shutil
        import sys

        beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
        found = beside if os.path.exists(beside) else shutil.which("py-spy")
        if not found:
            raise ValueError("py-spy is not installed on this host (pip install py-spy)")
        return found

    async def dump(self, app_id: Optional[str]) -> dict:
        import asyncio

        exe = self._py_spy()
        now = _us(time.time())
        reps = [(k, r) for k, r in list(self.agent.procs.replicas.items())
                if r.state == "RUNNING" and r.pid and (app_id is None or k[0] == app_id)]
        added, errors = 0, []
        for (a, role, replica), rep in reps:
            proc = await asyncio.create_subprocess_exec(exe, "dump", "--pid", str(rep.pid), "--json", "--subprocesses",
                                                        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            try:
                out, err = await asyncio.wait_for(proc.communicate(), 20)
            except asyncio.TimeoutError:
                proc.kill()
                errors.append(f"{a} {role}/{replica} pid {rep.pid}: py-spy timed out")
                continue
            if proc.returncode != 0:  # exited meanwhile, or not a Python process
                why = [x for x in (err or out).decode(errors="replace").splitlines() if x.startswith("Error")]
                errors.append(f"{a} {role}/{replica} pid {rep.pid}: "
                              f"{why[0].removeprefix('Error: ') if why else 'py-spy failed'}")
                continue
            for thread in json.loads(out or b"[]"):
                frames = thread.get("frames") or []
                # a warm-started replica sits on the fork server's frames: they are ours, not the user's
                cut = next((k for k, fr in enumerate(frames) if str(fr.get("filename", "")).endswith(_FORKSERVER)), None)
                for depth, fr in enumerate(frames[:cut]):
                    self.rows.append({"ts": now, "host": self.agent.index, "app_id": a, "role": role,
                                      "replica": replica, "pid": thread.get("pid", rep.pid),
                                      "thread": thread.get("os_thread_id") or thread.get("thread_id"),
                                      "thread_name": thread.get("thread_name"), "depth": depth,
                                      "function": fr.get("name"), "file": fr.get("filename"), "line": fr.get("line")})
                    added += 1
        del self.rows[:-MAX_STACK_ROWS]
        return {"rows": added, "processes": len(reps), "errors": errors}

    def batch(self) -> Any:
        import pyarrow as pa

        schema = arrow_schema("stacks")
        return pa.record_batch([pa.array([r[f.name] for r in self.rows], _storage(f.type)).cast(f.type)
                                for f in schema], schema=schema)


class TelemetryModule:
    """This host's telemetry, plugged into its agent (``AgentModule``): the ``telemetry.*``
    operations, log indexing and metrics sampling in the background, the spill dropped at stop."""

    def __init__(self, agent: Any):
        from ..private import agent_temp_dir, node_temp_root

        self.agent = agent
        self.root = node_temp_root()
        self.spill = agent_temp_dir("telemetry", agent.pool, agent.index)
        self.logs = LogIndex(agent, self.spill)
        self.stacks = Stacks(agent)
        self.metrics = Metrics(agent)
        # The first query a thread runs makes DataFusion's native code fault in fresh memory for
        # that thread (a profile shows the kernel zeroing huge pages), which costs many times a
        # warm query. On the agent's shared executor a query landed on whichever thread was free,
        # often a new one. Two threads of our own stay warm (one query after another uses the
        # same one); a second lets a query answer while a slow one or the indexer holds the
        # first. DataFusion still spreads each query over its own workers.
        self.worker = ThreadPoolExecutor(2, thread_name_prefix="telemetry")

    # ------------------------------------------------------------ the seam

    def operations(self) -> Dict[str, Any]:
        return {"telemetry.stacks": (self.op_stacks, None), "telemetry.query": (self.op_query, None),
                "telemetry.partial": (self.op_partial, merge_subtree), "telemetry.rows": (self.op_rows, cut_subtree)}

    def background_tasks(self) -> List[Any]:
        return [self.index_in_background(), self.sample_metrics()]

    def stop(self) -> None:
        """The data lives as long as the pool: its spill goes with the agent."""
        from ..private import remove_empty_dirs

        self.worker.shutdown(wait=False, cancel_futures=True)
        shutil.rmtree(self.spill, ignore_errors=True)
        remove_empty_dirs(self.spill.parent, self.root)

    # ------------------------------------------------------------ operations

    async def op_stacks(self, peer: Any, app_id: Optional[str] = None) -> dict:
        return await self.stacks.dump(app_id)

    async def op_query(self, peer: Any, sql: str, tables: List[str]) -> Any:
        """A pushed-down query's rows, as Arrow IPC streams of at most ``BATCH_ROWS`` rows each,
        sent back one frame at a time."""
        import asyncio

        from ..wire import Stream

        table = await asyncio.get_running_loop().run_in_executor(self.worker, self.query, sql, tables)
        chunks = to_ipc(table, BATCH_ROWS)

        async def batches() -> Any:
            for chunk in chunks:
                yield chunk

        return Stream(batches())

    async def op_partial(self, peer: Any, sql: str, table: str, merge: str) -> bytes:
        """This host's partial aggregates (``partial.py``); relays merge their subtree's with ``merge``."""
        return await self._one_answer(sql, table)

    async def op_rows(self, peer: Any, sql: str, table: str) -> bytes:
        """A LIMIT-bounded pushed-down query's rows (``query.pushdowns``); relays cut their
        subtree's to the same limit (``cut_subtree``)."""
        return await self._one_answer(sql, table)

    async def _one_answer(self, sql: str, table: str) -> bytes:
        """This host's answer to ``sql`` over ``table``, as one Arrow IPC stream (for relays to combine)."""
        import asyncio

        answer = await asyncio.get_running_loop().run_in_executor(self.worker, self.query, sql, [table])
        return to_ipc(answer)[0]

    def query(self, sql: str, tables: List[str]) -> Any:
        return query_tables(self.agent, self.logs, self.stacks, self.metrics, sql, tables)

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
            if not pending or (busy and pending < MAX_BACKLOG_BYTES) or (
                    not self.logs.queried and pending < LAZY_BYTES):
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


def setup(agent: Any) -> None:
    """Entry point (group ``monarch_torchx.modules``): serve ``telemetry.*`` on this agent."""
    agent.install(TelemetryModule(agent))
