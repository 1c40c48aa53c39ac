"""The agent side of actor meshes: start proc processes from the warm fork server.

Loaded into every agent as module ``mesh``. The agent brokers spawning only: it starts the
procs (as replicas of app ``mesh-ID``, so their output, exit status and telemetry work like
any other process's) and reports where each one listens. Calls never pass through it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

from ..private import agent_temp_dir, node_temp_root, remove_empty_dirs
from ..seam import AgentHost, Operation
from ..specs import TERMINAL, LaunchSpec
from . import placement

SPAWN_TIMEOUT_S = float(os.environ.get("MONARCH_TORCHX_PROC_START_TIMEOUT_S", "120"))
BELL_ENV = "MONARCH_TORCHX_PROC_BELL"  # where a proc rings once it listens (a datagram socket)
CHECK_S = 0.1  # with the bell, how often a spawn still looks for a proc that died before listening
MAX_UNIX_PATH = 100  # a longer socket path does not fit sockaddr_un: no bell, only polling


def ring(bell: str, mesh_id: str, rank: int) -> None:
    """A proc's "I listen" to its agent: its mesh id and rank, one datagram, nothing waited for.
    The agent then reads that proc's address file, as it would have found it by polling."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.setblocking(False)  # a full queue (hundreds ringing at once) never holds the proc
            s.sendto(f"{mesh_id} {rank}".encode(), bell)
    except OSError:  # no bell, a full one, or the agent is gone: the agent finds the file anyway
        pass


def app_id(mesh_id: str) -> str:
    return f"mesh-{mesh_id}"


class MeshModule:
    """The ``mesh`` module, plugged into its agent (``AgentModule``): ``mesh.spawn``, and the
    procs' rendezvous directory removed at stop."""

    def __init__(self, agent: AgentHost):
        self.agent = agent
        self.root = node_temp_root()
        self.rendezvous = str(agent_temp_dir("procs", agent.pool, agent.index))  # where procs say they listen
        self._bell: socket.socket | None = None
        self._bell_loop: asyncio.AbstractEventLoop | None = None
        # mesh id -> its spawn's wake-up and the ranks that rang since it last looked
        self._waiting: dict[str, tuple[asyncio.Event, set[int]]] = {}

    def operations(self) -> dict[str, Operation]:
        return {"mesh.spawn": (self.op_spawn, None)}

    def background_tasks(self) -> list[Any]:
        return []

    def warm_imports(self) -> list[str]:
        """An actor proc's runtime, whole (every lazily loaded name of ``monarch_torchx.actor``):
        a proc forked from a warm server starts with it imported."""
        return ["monarch_torchx.actor.proc", "monarch_torchx.actor:load_all"]

    def stop(self) -> None:
        if self._bell is not None:
            if self._bell_loop is not None and not self._bell_loop.is_closed():
                self._bell_loop.remove_reader(self._bell.fileno())
            self._bell.close()
        shutil.rmtree(self.rendezvous, ignore_errors=True)
        remove_empty_dirs(Path(self.rendezvous).parent, self.root)

    def _bell_path(self) -> str | None:
        """The socket procs ring once they listen (made at the first spawn), so a spawn wakes as
        each proc is ready instead of polling for its file while hundreds of procs start."""
        path = os.path.join(self.rendezvous, "bell")
        if self._bell is not None:
            return path
        if len(path) > MAX_UNIX_PATH:
            return None
        bell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        loop = asyncio.get_running_loop()
        try:
            bell.bind(path)  # in the agent's private directory: only its own user can ring
            os.chmod(path, 0o600)
            bell.setblocking(False)
            loop.add_reader(bell.fileno(), self._rung)
        except OSError:
            bell.close()
            return None
        self._bell, self._bell_loop = bell, loop
        return path

    def _rung(self) -> None:
        assert self._bell is not None
        while True:
            try:
                data = self._bell.recv(256)
            except OSError:  # nothing more waiting (BlockingIOError), or the bell is closed
                return
            mesh_id, _, rank = data.decode("ascii", "replace").partition(" ")
            waiting = self._waiting.get(mesh_id)
            if waiting is not None and rank.isdigit():  # anything else (a spawn that gave up) is dropped
                waiting[1].add(int(rank))
                waiting[0].set()

    async def op_spawn(
        self,
        peer: Any,
        mesh_id: str,
        ranks: list[int],
        env: dict[str, str] | None = None,
        binds: list[dict[str, str]] | None = None,
        python: str | None = None,
        gpus: int = 0,
    ) -> list[dict[str, Any]]:
        """Starts one proc per rank; returns their addresses once every one listens. ``gpus``:
        how many GPUs each proc holds, its own (the host's admission hands them out, disjoint from
        every replica's; none free: CapacityRefused, and none of the procs starts). ``binds``:
        each proc's CPU and NUMA placement (``spawn_procs(proc_bind=...)``), which it applies
        to itself as it starts. ``python``: the interpreter to exec instead of forking a warm
        proc (``HostMesh.with_python_executable``)."""
        if self.agent.stopping.is_set():
            raise ValueError(f"agent {self.agent.index} is shutting down ({self.agent.stop_reason})")
        if not mesh_id.replace("-", "").isalnum():
            raise ValueError(f"bad mesh id {mesh_id!r}")
        if binds is not None:
            binds = placement.check(binds, len(ranks))
        exe = sys.executable
        if python is not None:
            exe = shutil.which(python) or ""
            if not exe or not os.access(exe, os.X_OK):
                raise ValueError(f"with_python_executable({python!r}): no such executable on host {self.agent.index}")
        advertise = self.agent.tcp_advertise
        bell = self._bell_path()
        rung = self._waiting[mesh_id] = (asyncio.Event(), set())
        try:
            # (a host without GPUs: "gpus" is only the dim's name, as in Monarch on CPU hosts)
            gpus = int(gpus) if self.agent.procs.gpus_here else 0
            return await self._start(mesh_id, ranks, env, binds, exe, advertise, bell, rung, gpus)
        finally:
            self._waiting.pop(mesh_id, None)

    async def _start(
        self,
        mesh_id: str,
        ranks: list[int],
        env: dict[str, str] | None,
        binds: list[dict[str, str]] | None,
        exe: str,
        advertise: str,
        bell: str | None,
        rung: tuple[asyncio.Event, set[int]],
        gpus: int = 0,
    ) -> list[dict[str, Any]]:
        files = {}
        for i, rank in enumerate(ranks):
            path = os.path.join(self.rendezvous, f"{mesh_id}.{rank}.json")
            files[rank] = path
            proc_env = dict(env or {})
            if binds is not None:
                proc_env[placement.ENV] = json.dumps(binds[i])
            proc_env.update(
                {
                    "MONARCH_TORCHX_STATE_DIR": str(self.agent.state_dir),
                    "MONARCH_TORCHX_MESH_ID": mesh_id,
                    "MONARCH_TORCHX_PROC_RANK": str(rank),
                    "MONARCH_TORCHX_PROC_BIND": self.agent.tcp_bind,
                    "MONARCH_TORCHX_PROC_ADVERTISE": advertise,
                    "MONARCH_TORCHX_PROC_ADDR_FILE": path,
                    **({BELL_ENV: bell} if bell else {}),
                }
            )
            try:
                await self.agent.procs.launch(
                    LaunchSpec(
                        app_id=app_id(mesh_id),
                        role="proc",
                        replica_id=rank,
                        argv=[exe, "-m", "monarch_torchx.actor"],
                        env=proc_env,
                        resources={"gpus": gpus} if gpus else None,
                    )
                )
            except Exception:  # (e.g. no GPU free for this one): the procs started for this mesh go too
                await self.agent.procs.kill(self.agent.procs.select(app_id(mesh_id)), grace=1.0, record=False)
                raise
        out = []
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        delay = 0.001
        pending = dict(files)
        found: dict[int, dict[str, Any]] = {}
        look = list(pending)  # every proc at first; then those that rang (all, now and then, without a bell)
        looked_at_all = time.monotonic()
        while pending:
            for rank in look:
                addr_file = pending.get(rank)
                if addr_file is None:
                    continue
                try:
                    with open(addr_file) as f:
                        found[rank] = json.load(f)
                    os.unlink(addr_file)
                    del pending[rank]
                    continue
                except (FileNotFoundError, ValueError):
                    pass
                rep = self.agent.procs.replicas.get((app_id(mesh_id), "proc", rank))
                if rep is not None and rep.state in TERMINAL:
                    await self.agent.procs.kill(self.agent.procs.select(app_id(mesh_id)), grace=1.0)
                    tail = _stderr_tail(rep)
                    raise RuntimeError(
                        f"proc {rank} on host {self.agent.index} {rep.msg or 'exited'} before it listened"
                        + (f": {tail}" if tail else "")
                    )
            if not pending:
                break
            if time.monotonic() > deadline:
                await self.agent.procs.kill(self.agent.procs.select(app_id(mesh_id)), grace=1.0)
                raise RuntimeError(
                    f"procs {sorted(pending)} on host {self.agent.index} did not start within {SPAWN_TIMEOUT_S:.0f} s"
                )
            if bell is None:
                await asyncio.sleep(delay)
                delay = min(delay * 1.5, 0.02)
                look = list(pending)
                continue
            woken, ready = rung
            if not ready:
                try:
                    await asyncio.wait_for(woken.wait(), CHECK_S)
                except asyncio.TimeoutError:
                    pass
            woken.clear()
            look = sorted(ready)
            ready.clear()
            if time.monotonic() - looked_at_all >= CHECK_S:  # every proc, now and then: one may have died
                look, looked_at_all = list(pending), time.monotonic()
        for rank in ranks:
            info = found[rank]
            out.append(
                {
                    "rank": rank,
                    "host": info["host"],
                    "port": info["port"],
                    "pid": info["pid"],
                    "host_index": self.agent.index,
                    "hostname": os.uname().nodename,
                }
            )
        return out


def setup(agent: AgentHost) -> None:
    agent.install(MeshModule(agent))


def _stderr_tail(rep: Any, lines: int = 3) -> str:
    """The last lines a replica wrote to stderr (from its newest segment that holds any)."""
    written = [seg for seg in rep.log.streams["stderr"].segments if seg.size]
    if not written:
        return ""
    try:
        with open(written[-1].path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 4096))
            data = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    return " | ".join(line.partition(" ")[2] for line in data[-lines:] if line.strip())
