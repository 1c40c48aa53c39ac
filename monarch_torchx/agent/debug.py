"""The processes paused at a ``breakpoint()`` on this host, and the one client attached to each
(``debugger.py`` is the paused side; ``pool_debug.py`` the client's).

``debug.list`` reads the records the paused processes left in this agent's debug directory
(a record whose process is gone is removed) and names the replica each belongs to (the one whose
session it is in: a torchrun worker's is its node's). ``debug.attach`` connects to a paused
process (the pool's handshake, over its Unix socket) and streams what pdb writes until the
process continues or ends; ``debug.input`` sends it a line. A second client is refused while
one is attached. A client that goes away leaves the process paused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator

from ..debugger import IDENTITY, DebugEnded, PausedProcess, record_path, socket_path
from ..net import WireError
from ..net.aio import Stream
from ..net.blocking import dial
from ..shell_messages import ShellOutput
from .procs import owner

if TYPE_CHECKING:
    from .server import Agent

log = logging.getLogger("monarch_torchx.agent")
READ_CHUNK = 64 << 10


class DebugSessions:
    """The ``debug.*`` operations (see the module's docstring)."""

    def __init__(self, agent: Agent, directory: Path):
        self.agent = agent
        self.dir = directory
        self.attached: dict[int, socket.socket] = {}

    def operations(self) -> dict[str, Any]:
        return {"debug.list": self.op_list, "debug.attach": self.op_attach, "debug.input": self.op_input}

    def env(self) -> dict[str, str]:
        """What this host's processes get so that ``breakpoint()`` pauses for ``debug``."""
        return {"PYTHONBREAKPOINT": "monarch_torchx.debugger.set_trace", "MONARCH_TORCHX_DEBUG_DIR": str(self.dir)}

    def paused(self) -> list[PausedProcess]:
        out = []
        for p in sorted(self.dir.glob("*.json")):
            try:
                rec = PausedProcess.from_json(json.loads(p.read_text()))
                os.kill(rec.pid, 0)
            except ProcessLookupError:
                with contextlib.suppress(OSError):
                    p.unlink()
                    os.unlink(socket_path(self.dir, int(p.stem)))
                continue
            except (OSError, ValueError, TypeError):
                continue
            out.append(self._named(rec))
        return out

    def _named(self, rec: PausedProcess) -> PausedProcess:
        """The record with its replica's app, role and index (its session's leader), and whether
        a client is attached."""
        try:
            leader = os.getsid(rec.pid)
        except OSError:
            leader = -1
        rep = next((r for r in self.agent.procs.replicas.values() if r.pid == leader), None)
        if rep is not None:
            app, role, k = owner(rep.spec).split("/")
            rec = replace(rec, app_id=app, role=role, replica=int(k))
        return replace(rec, host=self.agent.index, attached=rec.pid in self.attached)

    async def op_list(self, peer: Any) -> list[PausedProcess]:
        return self.paused()

    async def op_attach(self, peer: Any, pid: int) -> Stream:
        """Attaches to paused process ``pid``: the stream is what pdb writes (``ShellOutput``),
        then ``DebugEnded``."""
        pid = int(pid)
        if pid in self.attached:
            raise ValueError(f"process {pid} on host {self.agent.index} is already attached by another client")
        if not os.path.exists(record_path(self.dir, pid)):
            raise LookupError(f"no process {pid} is paused at a breakpoint on host {self.agent.index}")
        loop = asyncio.get_running_loop()
        try:
            sock = await loop.run_in_executor(
                None, dial, f"unix:{socket_path(self.dir, pid)}", 0, self.agent.creds, IDENTITY, 10.0
            )
        except WireError as e:
            raise LookupError(f"process {pid} on host {self.agent.index} cannot be attached: {e}") from None
        sock.settimeout(None)
        self.attached[pid] = sock
        return Stream(self._stream(pid, sock))

    async def _stream(self, pid: int, sock: socket.socket) -> AsyncIterator[Any]:
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    data = await loop.run_in_executor(None, sock.recv, READ_CHUNK)
                except OSError:
                    data = b""
                if not data:
                    break
                yield ShellOutput(data)
            # the paused side removes its record before it closes the connection when it is let
            # go (continue, quit); a record still there means it died paused (killed)
            yield DebugEnded(continued=not os.path.exists(record_path(self.dir, pid)))
        finally:
            self.attached.pop(pid, None)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # (wakes a recv still waiting on an executor thread)
            sock.close()

    async def op_input(self, peer: Any, pid: int, line: str) -> bool:
        sock = self.attached.get(int(pid))
        if sock is None:
            raise LookupError(f"process {pid} on host {self.agent.index} is not attached (it continued, or ended)")
        await asyncio.get_running_loop().run_in_executor(None, sock.sendall, line.encode())
        return True
