"""Interactive shells on this host (``monarch-torchx shell``): a program on a pseudo-terminal of
its own, its screen streamed to the client and the client's keys written to it, over the pool's
authenticated connections (nothing listens for it on its own).

``shell.open`` starts the program and streams its output (``shell_messages``) until it ends;
``shell.input`` and ``shell.resize`` (on another connection: the stream holds the first) write
keys and set the window size. The program is started by the agent's one launcher, from the plain
fork server, with the terminal as stdin, stdout and stderr; a small shim makes it the session's
controlling terminal, so Ctrl-C, job control and resizes reach the foreground program as on a
terminal of one's own. A client that goes away (its connection closed) ends the shell: SIGHUP to
its process group, as a terminal hanging up, then SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import socket
import struct
import sys
import termios
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator

from ..net.aio import Stream
from ..shell_messages import ShellExited, ShellOpened, ShellOutput

if TYPE_CHECKING:
    from .server import Agent

log = logging.getLogger("monarch_torchx.agent")

# run by the agent's Python in the new session: the terminal on fd 0 becomes its controlling
# terminal, the signals Python ignores are given back their defaults, then the program replaces it
CTTY_SHIM = (
    "import fcntl, os, signal, sys, termios\n"
    "fcntl.ioctl(0, termios.TIOCSCTTY, 0)\n"
    "for s in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT): signal.signal(s, signal.SIG_DFL)\n"
    "try:\n"
    "    os.execvp(sys.argv[1], sys.argv[1:])\n"
    "except OSError as e:\n"
    "    print(f'{sys.argv[1]}: {e.strerror}', file=sys.stderr); os._exit(127)\n"
)
READ_CHUNK = 64 << 10
HANGUP_GRACE_S = 2.0
DRAIN_AFTER_EXIT_S = 0.5  # output still in the terminal when the program ended (its children may hold it)


@dataclass
class _Session:
    id: str
    master: int
    pid: int = 0
    exited: asyncio.Future[int] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    output: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


def _set_size(fd: int, cols: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", max(1, rows), max(1, cols), 0, 0))


class ShellSessions:
    """The ``shell.*`` operations and the sessions they started (see the module's docstring)."""

    def __init__(self, agent: Agent):
        self.agent = agent
        self.sessions: dict[str, _Session] = {}
        self._by_pid: dict[int, _Session] = {}

    def operations(self) -> dict[str, Any]:
        return {"shell.open": self.op_open, "shell.input": self.op_input, "shell.resize": self.op_resize}

    async def op_open(
        self, peer: Any, argv: list[str] | None = None, cols: int = 80, rows: int = 24, term: str = "xterm-256color"
    ) -> Stream:
        """Starts ``argv`` (default: the user's login shell, else /bin/sh) on a terminal of its
        own; the stream is ``ShellOpened``, its output, ``ShellExited``."""
        if self.agent.stopping.is_set():
            raise ValueError(f"agent {self.agent.index} is shutting down ({self.agent.stop_reason})")
        env = self.agent.procs.base_env
        if not argv:
            argv = [env.get("SHELL") or os.environ.get("SHELL") or "/bin/sh", "-i"]
        if not all(isinstance(a, str) for a in argv):
            raise ValueError("argv must be a list of strings")
        env.update(TERM=term, MONARCH_TORCHX_SHELL="1", COLUMNS=str(cols), LINES=str(rows))
        master, slave = os.openpty()
        try:
            os.set_blocking(master, False)
            _set_size(slave, cols, rows)
            session = _Session(uuid.uuid4().hex, master)
            cwd = env.get("HOME") if env.get("HOME") and os.path.isdir(env["HOME"]) else None
            session.pid = await self.agent.launcher.spawn(
                [sys.executable, "-c", CTTY_SHIM, *argv], env, cwd, slave, slave, stdin_fd=slave
            )
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)  # (the program holds its own: the terminal ends when it and its children do)
        self.sessions[session.id] = session
        self._by_pid[session.pid] = session
        early = self.agent.procs.take_early_exit(session.pid)
        if early is not None:
            self.on_exit(session.pid, early)
        asyncio.get_running_loop().add_reader(master, self._readable, session)
        log.info("shell %s: pid %d started (%s)", session.id[:8], session.pid, argv[0])
        return Stream(self._stream(session))

    def _readable(self, session: _Session) -> None:
        try:
            data = os.read(session.master, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:  # EIO: every holder of the terminal has closed it
            data = b""
        if not data:
            asyncio.get_running_loop().remove_reader(session.master)
            session.output.put_nowait(None)
            return
        session.output.put_nowait(data)

    async def _stream(self, session: _Session) -> AsyncIterator[Any]:
        try:
            yield ShellOpened(session.id, session.pid, socket.gethostname())
            while True:
                if session.exited.done():
                    try:  # what is still in the terminal, then the end (a child may hold it open)
                        data = await asyncio.wait_for(session.output.get(), DRAIN_AFTER_EXIT_S)
                    except asyncio.TimeoutError:
                        break
                else:
                    getter = asyncio.ensure_future(session.output.get())
                    either: list[asyncio.Future[Any]] = [getter, session.exited]
                    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
                    if not getter.done():
                        getter.cancel()
                        continue
                    data = getter.result()
                if data is None:
                    await session.exited
                    break
                yield ShellOutput(data)
            yield ShellExited(_exit_code(session.exited.result()))
        finally:
            await self._end(session)

    async def _end(self, session: _Session) -> None:
        """The session is over (its program ended, or its client went): the program's process
        group is hung up on, then killed; the terminal is closed."""
        self.sessions.pop(session.id, None)
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(session.master)
        if not session.exited.done():
            with contextlib.suppress(OSError):
                os.killpg(session.pid, signal.SIGHUP)
            try:
                await asyncio.wait_for(asyncio.shield(session.exited), HANGUP_GRACE_S)
            except asyncio.TimeoutError:
                with contextlib.suppress(OSError):
                    os.killpg(session.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.close(session.master)
        log.info("shell %s ended", session.id[:8])

    def _session(self, session: str) -> _Session:
        s = self.sessions.get(session)
        if s is None:
            raise LookupError(f"no shell session {session[:8]!r} on host {self.agent.index} (it ended)")
        return s

    async def op_input(self, peer: Any, session: str, data: bytes) -> int:
        """Writes ``data`` (keys, pasted text) to the session's terminal; returns how much."""
        s = self._session(session)
        view = memoryview(bytes(data))
        while view:
            try:
                n = os.write(s.master, view)
            except BlockingIOError:  # the program is not reading: wait, as a terminal would
                await asyncio.sleep(0.01)
                self._session(session)
                continue
            view = view[n:]
        return len(data)

    async def op_resize(self, peer: Any, session: str, cols: int, rows: int) -> bool:
        """The client's window changed: the terminal's size (its foreground program gets SIGWINCH)."""
        _set_size(self._session(session).master, int(cols), int(rows))
        return True

    def on_exit(self, pid: int, code: int) -> bool:
        """A launched process ended: True if it was a session's program."""
        s = self._by_pid.pop(pid, None)
        if s is None:
            return False
        if not s.exited.done():
            s.exited.set_result(code)
        return True

    def stop(self) -> None:
        """The agent stops: every session's program is killed (its clients see the stream end)."""
        for s in list(self.sessions.values()):
            with contextlib.suppress(OSError):
                os.killpg(s.pid, signal.SIGKILL)
