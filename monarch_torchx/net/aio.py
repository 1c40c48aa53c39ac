"""The asyncio transport: the accepting side of a connection as an ``asyncio.BufferedProtocol``
(``AuthenticatedConnection``: TLS where the pool uses it, the handshake under its gate, then whole
frames), ``serve`` to listen, and the request ``Server`` the agent runs its operations on.

It reads with ``frames.FrameParser``: a large body or buffer is received straight into its final
memory (one copy from the kernel) rather than through a ``StreamReader``'s buffers (measured in
benchmarks/RESULTS.md, "sync"). Apart from ``net.blocking`` so the blocking client never imports
asyncio.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, cast

from ..credentials import PoolCredentials
from . import handshake
from .frames import (
    UNIX,
    AsyncFrameSink,
    FrameParser,
    PeerClosed,
    RemoteError,
    UnknownOperation,
    WireError,
    big_buffer,
    check_msg,
    decode,
    encode,
)
from .handshake import ANSWER_LEN, HandshakeGate, server_check, server_hello

log = logging.getLogger("monarch_torchx.wire")
HANDSHAKE_BUF = 4 << 10  # the answer is 80 bytes; the client sends nothing more before the proof


async def serve(
    factory: Callable[[], AuthenticatedConnection],
    host: str,
    port: int,
    backlog: int = 256,
    sock: socket.socket | None = None,
) -> asyncio.base_events.Server:
    """Listens for a pool's connections on an asyncio loop; each is ``factory()``'s protocol,
    which does TLS (where the pool uses it) and the handshake itself, under its gate.
    ``sock``: an already bound socket to listen on instead (one a launcher opened for us)."""
    if sock is not None:
        return await asyncio.get_running_loop().create_server(factory, sock=sock, backlog=backlog)
    if host.startswith(UNIX):
        return await asyncio.get_running_loop().create_unix_server(factory, host[len(UNIX) :], backlog=backlog)
    return await asyncio.get_running_loop().create_server(factory, host, port, backlog=backlog)


def write_frame(transport: asyncio.Transport, parts: list[Any]) -> None:
    """Queues one frame on a transport: small frames joined (one write, one TLS record), large
    ones part by part, so a tensor's memory is not copied into a joined bytes object."""
    if sum(memoryview(p).nbytes for p in parts) < (256 << 10):
        transport.write(b"".join(parts))
    else:
        for p in parts:
            transport.write(memoryview(p).cast("B"))


class AuthenticatedConnection(asyncio.BufferedProtocol):
    """The accepting side of one connection of the pool's protocol: the handshake (bounded in
    number and time; nothing is decoded before it succeeds), then whole frames to ``on_frame``.
    The agent's request server and each actor proc accept connections through it.

    ``gate`` (a HandshakeGate) bounds the handshakes in progress, shared by every connection of
    one server."""

    def __init__(
        self,
        gate: HandshakeGate,
        creds: PoolCredentials,
        identity: bytes,
        alloc: Callable[[int], Any] = big_buffer,
    ):
        self.gate, self.key, self.identity = gate, creds.key, identity
        self.tls = creds.server_context
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.authed = False
        self._hs = bytearray(HANDSHAKE_BUF)  # more than the answer: what follows it is kept, and a
        # peer that talks out of turn is closed with its bytes read (a clean EOF, not a reset)
        self._hs_len = 0
        self._nonce = b""
        self._counted = False  # in the gate's pending handshakes
        self._dropped = False
        self._timer: asyncio.TimerHandle | None = None
        self.parser = FrameParser(alloc=alloc)

    # ------------------------------------------------------------ what subclasses add

    def on_authenticated(self) -> None:
        pass

    def on_frame(self, body: Any, bufs: list[Any]) -> None:
        raise NotImplementedError

    def on_lost(self) -> None:
        pass

    # ------------------------------------------------------------ handshake

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream server's connections are Transports
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        # a flood of unauthenticated peers is bounded in memory and time
        self.gate.admit(self, lambda: self.drop("evicted by newer connections while silent in its handshake"))
        self._counted = True
        loop = asyncio.get_running_loop()
        # one deadline for TLS and the handshake: the gate counts this connection from its accept,
        # so silent peers are evicted whether they stall in TLS or after it
        self._timer = loop.call_later(handshake.HANDSHAKE_TIMEOUT_S, self._handshake_timeout)
        if self.tls is None:
            self._greet()
            return
        self.transport.pause_reading()  # no raw byte reaches this protocol: TLS takes the transport over
        loop.create_task(self._start_tls(loop, self.transport))

    async def _start_tls(self, loop: asyncio.AbstractEventLoop, raw: asyncio.Transport) -> None:
        assert self.tls is not None  # started only when the server has a TLS context
        try:
            tls = await loop.start_tls(
                raw, self, self.tls, server_side=True, ssl_handshake_timeout=handshake.HANDSHAKE_TIMEOUT_S
            )
        except (ssl.SSLError, OSError, ConnectionError, asyncio.TimeoutError) as e:
            if not self._dropped:
                self.drop(f"TLS refused ({getattr(e, 'reason', None) or e or type(e).__name__})")
            return
        if tls is None and not self._dropped:
            self.drop("TLS ended before it began")
        if self._dropped or tls is None:
            return
        self.transport = tls
        self._greet()

    def _greet(self) -> None:
        assert self.transport is not None
        self._nonce, hello = server_hello()
        self.transport.write(hello)

    def drop(self, why: str) -> None:
        """Closes this connection, saying why (rate-limited by the gate)."""
        if self._dropped:
            return
        self._dropped = True
        self.gate.note_drop(self.peer, why)
        self._release_slot()
        if self.transport is not None:
            self.transport.close()

    def _handshake_timeout(self) -> None:
        if not self.authed and self.transport is not None:
            self.drop("handshake timed out")

    def _release_slot(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._counted:
            self._counted = False
            self.gate.release(self)

    # ------------------------------------------------------------ reading

    def get_buffer(self, sizehint: int) -> memoryview:
        if not self.authed:
            return memoryview(self._hs)[self._hs_len :]
        return self.parser.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        assert self.transport is not None
        if not self.authed:
            self._hs_len += nbytes
            if not self._nonce:  # bytes before our greeting (TLS delivered them early): out of turn
                self.drop("spoke before the handshake began")
                return
            if self._hs_len < ANSWER_LEN:
                return
            self._release_slot()
            try:
                proof = server_check(self.key, self._nonce, bytes(self._hs[:ANSWER_LEN]), self.identity)
            except WireError as e:
                self.drop(str(e))
                return
            self.transport.write(proof)
            self.authed = True
            self.on_authenticated()
            early = memoryview(self._hs)[ANSWER_LEN : self._hs_len]  # sent right after the answer
            self._hs = bytearray()
            while early.nbytes and self.transport is not None and not self.transport.is_closing():
                into = self.parser.get_buffer()
                n = min(into.nbytes, early.nbytes)
                into[:n] = early[:n]
                early = early[n:]
                self._frames(n)
            return
        self._frames(nbytes)

    def _frames(self, nbytes: int) -> None:
        assert self.transport is not None
        try:
            for body, bufs in self.parser.feed(nbytes):
                self.on_frame(body, bufs)
        except WireError as e:
            self.drop(str(e))
        except MemoryError:  # an authenticated peer declared a buffer larger than this host can hold
            self.drop("a frame larger than this host's free memory")

    def eof_received(self) -> bool | None:
        if not self.authed and self._hs_len == 0:
            # connected and closed without a byte: a TCP readiness probe (Kubernetes) or a port check
            log.debug("connection from %s closed before the handshake", self.peer)
        elif not self.authed:
            self.gate.note_drop(self.peer, "closed during the handshake")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._release_slot()
        authed, self.transport = self.authed, None
        if authed:
            self.on_lost()


class ServerConnection(AuthenticatedConnection):
    """One peer of a ``Server``: requests dispatched as tasks, replies written back."""

    def __init__(self, server: Server):
        # handlers get bytearrays (not maps), as they may pickle them again
        super().__init__(server.gate, server.creds, server.identity, alloc=bytearray)
        self.server = server
        self.tasks: dict[int, asyncio.Task] = {}
        self._paused = False
        self._drained: asyncio.Future | None = None

    def on_authenticated(self) -> None:
        self.server.connections += 1
        self.server.accepted += 1

    def on_frame(self, body: Any, bufs: list[Any]) -> None:
        self._dispatch(check_msg(decode(body, bufs)))

    def _dispatch(self, msg: dict) -> None:
        rid = msg["id"]
        if msg.get("cancel"):
            task = self.tasks.pop(rid, None)
            if task:
                task.cancel()
            return
        self.server.on_activity(str(msg.get("op")))
        task = asyncio.get_running_loop().create_task(
            self.server.run_request(self, Peer(self.peer), rid, msg.get("op"), msg.get("args") or {})
        )
        self.tasks[rid] = task
        task.add_done_callback(lambda _t: self.tasks.pop(rid, None))

    def on_lost(self) -> None:
        self.server.connections -= 1
        for t in list(self.tasks.values()):
            t.cancel()
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(ConnectionError("connection lost"))

    # ------------------------------------------------------------ writing

    def write(self, parts: list[Any]) -> None:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionError("connection closed")
        write_frame(self.transport, parts)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    async def drain(self) -> None:
        """Waits while the peer is slower than we write (the transport's buffer is full)."""
        if self.transport is None:
            raise ConnectionError("connection closed")
        if self._paused:
            if self._drained is None:
                self._drained = asyncio.get_running_loop().create_future()
            await self._drained


async def read_frame(reader: asyncio.StreamReader, parser: FrameParser) -> Any:
    """The next message from a stream (the fork server's pipe), through ``parser`` (one per stream)."""
    while True:
        frames = parser.pending
        if frames:
            return decode(*frames.pop(0))
        data = await reader.read(parser.get_buffer().nbytes)
        if not data:
            raise PeerClosed("connection closed by peer")
        into = parser.get_buffer()
        while data:  # the buffer offered may be smaller than what was read (a segment boundary)
            n = min(into.nbytes, len(data))
            into[:n] = data[:n]
            data = data[n:]
            frames.extend(parser.feed(n))
            into = parser.get_buffer()


Handler = Callable[..., Any]


class Stream:
    """Marks a handler result as a stream: the async iterator's items are sent one by one."""

    def __init__(self, items: AsyncIterator[Any]):
        self.items = items


@dataclass
class Peer:
    """What a handler may know about who is calling."""

    addr: str


class Server:
    """Authenticated request server. Handlers are ``async def op(peer, **args)``.

    A handler returns a value, raises (the peer gets a one-line error), or returns a
    ``Stream``. Unknown ops, bad arguments and malformed frames are answered or dropped
    with a logged reason; nothing is unpickled before the peer authenticates.
    """

    def __init__(
        self,
        creds: PoolCredentials,
        handlers: dict[str, Handler],
        on_activity: Callable[[str], None] | None = None,
        identity: bytes = b"",
    ):
        self.creds = creds
        self.identity = identity
        self._handlers = handlers
        self.on_activity = on_activity or (lambda _op: None)
        self._server: asyncio.base_events.Server | None = None
        self.connections = 0  # authenticated ones open now
        self.accepted = 0  # authenticated ones ever (what a client's operation cost this server)
        self.gate = HandshakeGate()  # the ones in their handshake

    async def start(self, host: str, port: int = 0, sock: socket.socket | None = None) -> int:
        self._server = await serve(lambda: ServerConnection(self), host, port, sock=sock)
        name = self._server.sockets[0].getsockname()
        return 0 if isinstance(name, str) else name[1]

    async def close(self) -> None:
        if self._server:
            self._server.close()

    async def run_request(self, conn: AsyncFrameSink, peer: Peer, rid: int, op: Any, args: dict) -> None:
        """Runs one request's handler and writes its reply (or its stream, then the reply) to ``conn``."""
        handler = self._handlers.get(op) if isinstance(op, str) else None
        try:
            if handler is None:
                raise UnknownOperation(op)
            if not isinstance(args, dict):
                raise RemoteError("arguments must be a dict")
            result = handler(peer, **args)
            if asyncio.iscoroutine(result):
                result = await result
            if isinstance(result, Stream):
                try:
                    async for item in result.items:
                        conn.write(encode({"id": rid, "item": item}))
                        await conn.drain()
                finally:
                    aclose = getattr(result.items, "aclose", None)
                    if aclose:
                        await aclose()  # runs the producer's cleanup now, not at garbage collection
                result = None
            reply = {"id": rid, "ok": True, "value": result}
        except asyncio.CancelledError:
            reply = {"id": rid, "ok": False, "error": "cancelled"}
        except TypeError as e:
            reply = {"id": rid, "ok": False, "error": f"bad arguments for {op!r}: {e}", "kind": "TypeError"}
        except Exception as e:
            if not isinstance(e, (RemoteError, ValueError, LookupError, OSError)):
                log.exception("handler %s failed", op)
            kind = e.kind if isinstance(e, RemoteError) else type(e).__name__  # (a peer's error passed on keeps its)
            reply = {"id": rid, "ok": False, "error": str(e) or type(e).__name__, "kind": kind}
        try:
            try:
                parts = encode(reply)
            except Exception as e:  # a value that cannot be pickled: the caller still gets an answer
                parts = encode(
                    {
                        "id": rid,
                        "ok": False,
                        "error": f"the result of {op!r} cannot be sent: {e}",
                        "kind": type(e).__name__,
                    }
                )
            conn.write(parts)
            await conn.drain()
        except (ConnectionError, OSError, RuntimeError):
            pass
