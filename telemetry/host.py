"""Agent side of telemetry: this host's tables, built from what the agent already keeps, and
the part of a query the client pushes down (projection, filters, limit), run by DataFusion.

Loaded into every agent through the ``monarch_torchx.modules`` entry point; DataFusion and
pyarrow are imported at the first query, not at agent start.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .schema import TABLES, arrow_schema

READ_ONLY = {"ddl": False, "dml": False, "statements": False}
_CHUNK = 8 << 20


class LogIndex:
    """Arrow batches of every replica's log files, appended to as the files grow."""

    def __init__(self, agent: Any):
        self.agent = agent
        self.offsets: Dict[Path, int] = {}
        self.batches: List[Any] = []
        self._lock = threading.Lock()  # queries run in worker threads

    def refresh(self) -> List[Any]:
        with self._lock:
            self._append_new()
            return list(self.batches)

    def _append_new(self) -> None:
        import pyarrow as pa

        schema = arrow_schema("logs")
        hostname = socket.gethostname()
        for (app_id, role, replica), rep in list(self.agent.procs.replicas.items()):
            for stream in ("stdout", "stderr"):
                path = rep.log_dir / f"{stream}.log"
                off = self.offsets.get(path, 0)
                try:
                    size = path.stat().st_size
                except FileNotFoundError:
                    continue
                while off < size:
                    with open(path, "rb") as f:
                        f.seek(off)
                        data = f.read(_CHUNK)
                    end = data.rfind(b"\n")
                    if end < 0:
                        break
                    off += end + 1
                    ts, lines = [], []
                    for raw in data[:end].split(b"\n"):
                        t, _, line = raw.partition(b" ")
                        try:
                            ts.append(int(float(t) * 1_000_000))
                        except ValueError:
                            ts.append(0)
                        lines.append(line.decode("utf-8", errors="replace"))
                    n = len(lines)
                    self.batches.append(pa.record_batch([
                        pa.array(ts, pa.int64()).cast(pa.timestamp("us", tz="UTC")),
                        pa.array([self.agent.index] * n, pa.int32()), pa.array([hostname] * n),
                        pa.array([app_id] * n), pa.array([role] * n), pa.array([replica] * n, pa.int32()),
                        pa.array([rep.pid] * n, pa.int64()), pa.array([stream] * n), pa.array(lines),
                    ], schema=schema))
                self.offsets[path] = off


def _proc_usage(pid: Optional[int]) -> Tuple[Optional[float], Optional[int]]:
    if not pid:
        return None, None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return (int(stat[11]) + int(stat[12])) / ticks, int(stat[21]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return None, None


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

    add(agent.started, "agent", "start", None, None, {"pid": os.getpid(), "incarnation": agent.incarnation})
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


def run_query(agent: Any, logs: LogIndex, sql: str, tables: List[str]) -> bytes:
    """Runs a pushed-down query over this host's tables; returns an Arrow IPC stream."""
    import pyarrow as pa
    from datafusion import SessionContext, SQLOptions

    ctx = SessionContext()
    for name in tables:
        if name == "logs":
            batches = logs.refresh()
        elif name == "procs":
            batches = [procs_batch(agent)]
        elif name == "events":
            batches = [events_batch(agent)]
        elif name == "stacks":
            batches = [agent.telemetry_stacks.batch()]
        else:
            raise ValueError(f"unknown table {name!r}: tables are {', '.join(TABLES)}")
        ctx.register_record_batches(name, [batches or [pa.record_batch([pa.array([], f.type) for f in arrow_schema(name)],
                                                                        schema=arrow_schema(name))]])
    options = SQLOptions().with_allow_ddl(False).with_allow_dml(False).with_allow_statements(False)
    table = ctx.sql_with_options(sql, options).to_arrow_table()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


MAX_STACK_ROWS = 200_000
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


def setup(agent: Any) -> None:
    """Entry point (group ``monarch_torchx.modules``): serve ``telemetry.*`` on this agent."""
    logs = LogIndex(agent)
    stacks = Stacks(agent)
    agent.telemetry_stacks = stacks

    async def dump_stacks(peer: Any, app_id: Optional[str] = None) -> dict:
        return await stacks.dump(app_id)

    agent.add_handler("telemetry.stacks", dump_stacks)

    async def query(peer: Any, sql: str, tables: List[str]) -> bytes:
        import asyncio

        t0 = time.time()
        data = await asyncio.get_running_loop().run_in_executor(None, run_query, agent, logs, sql, tables)
        agent.telemetry_last_query_s = time.time() - t0
        return data

    agent.add_handler("telemetry.query", query)
