"""``breakpoint()`` in any process a pool started (a replica, a submitit task, an actor proc):
the process pauses in pdb and waits for ``monarch-torchx debug`` to attach, from anywhere.

The agent gives its processes ``PYTHONBREAKPOINT=monarch_torchx.debugger.set_trace`` (unless
the user set their own) and a private directory of its own on the node's temp disk
(``MONARCH_TORCHX_DEBUG_DIR``). A paused process writes there what it is and where it stopped
(``PAUSED.json``, 0600), and listens on a Unix socket beside it; whoever connects must prove it
holds the pool's secret (the pool's one handshake: ``net``), and only its agent does, on behalf of a
client that proved the same to it. After the handshake the socket carries pdb's own text both
ways, nothing is unpickled. One client at a time: a client that goes away leaves the process
paused for the next; ``continue`` (or ``quit``) ends the wait and removes the record.

Outside a pool (no ``MONARCH_TORCHX_DEBUG_DIR``) it is the standard ``pdb.set_trace``.

A run with ``-cfg post_mortem=True`` (``MONARCH_TORCHX_POST_MORTEM=1`` in its replicas' env) also
pauses a replica whose Python program ends in an uncaught exception, at the frame it came from,
before the process exits with its error: ``post_mortem``.
"""

from __future__ import annotations

import bdb
import json
import os
import pdb
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

DIR_ENV = "MONARCH_TORCHX_DEBUG_DIR"
POST_MORTEM_ENV = "MONARCH_TORCHX_POST_MORTEM"  # set by the run option: pause on an uncaught exception
IDENTITY = b"monarch-torchx-debug"
PROMPT = "(Pdb) "
REPLAY_MAX = 64 << 10  # what pdb wrote while nobody was attached, shown to the next one


@dataclass
class PausedProcess:
    """A process stopped at a breakpoint, as its record says and ``debug.list`` answers."""

    host: int
    pid: int
    app_id: str
    role: str
    replica: int
    file: str
    line: int
    function: str
    since: float
    attached: bool = False

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PausedProcess:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


@dataclass
class DebugEnded:
    """The last item of an attached stream: the process went on (``continue``) or is gone."""

    continued: bool


def socket_path(directory: str | Path, pid: int) -> str:
    return os.path.join(str(directory), f"{pid}.sock")


def record_path(directory: str | Path, pid: int) -> str:
    return os.path.join(str(directory), f"{pid}.json")


class _AttachedTerminal:
    """pdb's stdin and stdout: the attached client's connection, or a wait for one."""

    def __init__(self, listener: socket.socket, creds: Any):
        self.listener = listener
        self.creds = creds
        self.conn: socket.socket | None = None
        self.reader: Any = None
        self.pending = bytearray()  # written while nobody was attached
        self.where: Any = lambda: ""  # where the process stands, shown again to the next client

    def _attach(self) -> None:
        from .net import WireError, accept_handshake

        while self.conn is None:
            sock, _ = self.listener.accept()
            ctx = self.creds.server_context  # (the pool's one dialer speaks TLS where the pool does)
            if ctx is not None:
                sock = ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            try:
                sock.settimeout(10.0)
                sock = accept_handshake(sock, self.creds, IDENTITY)
                sock.settimeout(None)
            except (OSError, WireError):
                sock.close()
                continue
            self.conn, self.reader = sock, sock.makefile("rb")
            if self.pending:
                self._send(bytes(self.pending))
                self.pending.clear()

    def _detach(self) -> None:
        if self.conn is not None:
            self.reader.close()
            self.conn.close()
        self.conn = self.reader = None

    def _send(self, data: bytes) -> None:
        assert self.conn is not None
        try:
            self.conn.sendall(data)
        except OSError:
            self._detach()
            self.pending += data

    def readline(self) -> str:
        while True:
            self._attach()
            line = self.reader.readline()
            if line:
                return line.decode(errors="replace")
            self._detach()  # the client went: wait for the next, still paused
            self.pending += (self.where() + PROMPT).encode()

    def write(self, text: str) -> int:
        data = text.encode()
        if self.conn is None:
            self.pending += data
            del self.pending[:-REPLAY_MAX]
        else:
            self._send(data)
        return len(text)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._detach()
        self.listener.close()


class PoolPdb(pdb.Pdb):
    """pdb over an attached client's connection; continuing (or quitting) ends the pause."""

    def __init__(self, terminal: _AttachedTerminal, directory: str):
        # (nosigint: a SIGINT after the pause ended must not bring pdb back on a closed socket)
        super().__init__(stdin=terminal, stdout=terminal, nosigint=True)  # type: ignore[arg-type]
        self.use_rawinput = False
        self.terminal = terminal
        self.directory = directory
        terminal.where = self._where

    def _where(self) -> str:
        """The current frame, as pdb shows it when it stops there."""
        if not getattr(self, "stack", None):
            return ""
        return "> " + self.format_stack_entry(self.stack[self.curindex], "\n-> ") + "\n"

    def _end_pause(self) -> None:
        for path in (record_path(self.directory, os.getpid()), socket_path(self.directory, os.getpid())):
            try:
                os.unlink(path)
            except OSError:
                pass
        self.terminal.close()

    def do_continue(self, arg: str) -> bool | None:
        # the pause ends here and nobody could attach to a later stop: breakpoints set in this
        # session go with it (a later `breakpoint()` pauses afresh)
        self.clear_all_breaks()
        done = super().do_continue(arg)
        self._end_pause()
        return done

    do_c = do_cont = do_continue

    def do_quit(self, arg: str) -> bool | None:
        self._end_pause()
        return super().do_quit(arg)

    do_q = do_exit = do_quit


def set_trace(*args: Any, **kwargs: Any) -> None:
    """What ``breakpoint()`` calls in a pool's processes (see the module's docstring)."""
    frame = sys._getframe(1)
    directory = os.environ.get(DIR_ENV)
    if not directory or not os.path.isdir(directory):
        pdb.Pdb().set_trace(frame)
        return
    session = _pause(directory, frame, "breakpoint")
    session.set_trace(frame)


def post_mortem_wanted() -> bool:
    """Whether the run asked to be paused on an uncaught exception (``-cfg post_mortem=True``)."""
    return os.environ.get(POST_MORTEM_ENV, "") not in ("", "0")


def post_mortem(tb: TracebackType) -> None:
    """Pauses this process in pdb at the frame an uncaught exception came from, as ``breakpoint()``
    does, for ``monarch-torchx debug``; returns once the client continues (or quits)."""
    directory = os.environ.get(DIR_ENV)
    if not directory or not os.path.isdir(directory):
        return  # (outside a pool: no one could attach, and a pdb on a replica's closed stdin only ends it)
    last = tb
    while last.tb_next is not None:
        last = last.tb_next
    session = _pause(directory, last.tb_frame, "uncaught exception", last.tb_lineno)
    session.reset()
    try:
        session.interaction(None, tb)
    except bdb.BdbQuit:
        pass
    session._end_pause()


def _pause(directory: str, frame: FrameType, why: str, line: int | None = None) -> PoolPdb:
    """Writes this process's record, listens for a client; the pdb that will talk to it."""
    from .credentials import PoolCredentials

    pid = os.getpid()
    creds = PoolCredentials.load(Path(os.environ["MONARCH_TORCHX_STATE_DIR"]))
    path = socket_path(directory, pid)
    if os.path.exists(path):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(old)
    listener.listen(4)
    record = PausedProcess(
        host=int(os.environ.get("MONARCH_TORCHX_HOST_INDEX", "0")),
        pid=pid,
        app_id="",  # (its agent says which replica it belongs to: the one whose session it is in)
        role="",
        replica=-1,
        file=frame.f_code.co_filename,
        line=frame.f_lineno if line is None else line,
        function=frame.f_code.co_name,
        since=time.time(),
    )
    fd = os.open(record_path(directory, pid), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(record), f)
    pool = os.environ.get("MONARCH_TORCHX_POOL", "POOL")
    print(
        f"monarch-torchx: paused at {record.where} ({why}); attach with "
        f"`monarch-torchx debug --pool {pool} --attach {record.host}:{pid}`",
        file=sys.stderr,
        flush=True,
    )
    return PoolPdb(_AttachedTerminal(listener, creds), directory)
