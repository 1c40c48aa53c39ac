"""The one wire protocol: framing, mutual HMAC authentication, request/reply/stream messages.

Every byte between a controller and an agent (and, later, between actor procs) goes through
this module, so there is exactly one place where untrusted bytes are parsed.

Connection setup (fixed-size raw bytes, nothing is unpickled before it succeeds)::

    server -> client   MAGIC + nonce_s(32)
    client -> server   MAGIC + nonce_c(32) + HMAC(key, b"c" + nonce_s + nonce_c)
    server -> client   HMAC(key, b"s" + nonce_c + nonce_s)

Both sides prove they hold the pool's secret, and both MACs cover the identity of the agent the
client means to reach (pool/index/incarnation), so a client never unpickles what a stranger on a
reused port sends, and a handshake relayed to another agent of the pool fails. Frames after the
handshake are not MAC'd or encrypted: on an untrusted network, TLS is still to come. After that, each frame is::

    u32 body_len | u16 nbufs | nbufs * u64 buf_len | body | buf_0 ... buf_n

where ``body`` is a pickle (protocol 5) and the buffers are its out-of-band ``PickleBuffer``s,
so large tensors are written from their own memory rather than copied into one bytes object.

Messages are plain dicts:
    request  {"id": n, "op": str, "args": dict}
    reply    {"id": n, "ok": True, "value": ...}  or  {"id": n, "ok": False, "error": str}
    stream   {"id": n, "item": ...} (zero or more, before the final reply)
    cancel   {"id": n, "cancel": True}
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import os
import pickle
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Dict, Iterator, List, Optional, Tuple

if TYPE_CHECKING:
    import asyncio

# asyncio is imported where it is used: the blocking client is on the torchx CLI's path, where
# importing asyncio would cost ~30 ms of every `torchx run`.

log = logging.getLogger(__name__)

MAGIC = b"MTX1"
NONCE = 32
MAC = 32
HANDSHAKE_TIMEOUT_S = 5.0
MAX_HANDSHAKES = 256  # unauthenticated connections an agent entertains at once (then the oldest goes)
MAX_BODY = 1 << 30  # one pickled message body
MAX_BUFS = 4096
MAX_BUF = 1 << 40
_HEAD = struct.Struct("!IH")
_BUFLEN = struct.Struct("!Q")


class WireError(ConnectionError):
    """The peer broke the protocol, failed authentication, or went away.

    Callers branch on the subclass, never on the message: none of them says the peer is dead
    (a busy or flooded host looks the same from one connection); that takes other evidence.
    """


class ConnectFailed(WireError):
    """No connection could be made (refused, unreachable, or connecting timed out).

    ``refused``: the peer's host answered that nothing listens on the port (a reset), which a
    flood or a network blip does not produce: evidence that the listener is gone.
    """

    def __init__(self, message: str, refused: bool = False):
        super().__init__(message)
        self.refused = refused


class HandshakeRefused(WireError):
    """The peer is not one of ours, or one side failed authentication."""


class PeerTimeout(WireError):
    """The peer did not answer within the timeout (busy, stalled, or gone)."""


class PeerClosed(WireError):
    """The connection ended in the middle of an exchange."""


class MalformedFrame(WireError):
    """A frame or message that does not follow the protocol."""


class RemoteError(RuntimeError):
    """The peer ran the request and it failed; the message is the peer's one-line reason.

    ``kind`` names the exception type the peer raised, so callers can branch on it.
    """

    def __init__(self, message: str, kind: str = ""):
        super().__init__(message)
        self.kind = kind


DROP_LOG_EVERY_S = 10.0


class HandshakeGate:
    """The connections of one server that are still in their handshake, at most ``limit``.

    When full, the *oldest* is dropped to admit the newest: a real client finishes its
    handshake within a round trip, so a flood of silent peers can hold slots only by opening
    connections faster than that, not by sitting on them. Drops are logged at most once per
    DROP_LOG_EVERY_S (with a count), so a flood cannot fill a log either. Thread-safe: the
    asyncio acceptor (``AuthenticatedConnection``) and the threaded ones (the actor inbox, the
    rdma data plane) share it; each admitted connection comes with how to evict it.
    """

    def __init__(self, limit: int = MAX_HANDSHAKES, name: str = ""):
        self.limit = limit
        self.name = name
        self.pending: Dict[Any, Callable[[], None]] = {}  # insertion order: oldest first
        self._lock = threading.Lock()
        self._drops: Dict[str, Tuple[float, int]] = {}  # reason -> (last logged, dropped since)

    def admit(self, conn: Any, evict: Callable[[], None]) -> None:
        with self._lock:
            evicted = []
            while len(self.pending) >= self.limit:
                oldest = next(iter(self.pending))
                evicted.append(self.pending.pop(oldest))
            self.pending[conn] = evict
        for fn in evicted:
            fn()

    def release(self, conn: Any) -> None:
        with self._lock:
            self.pending.pop(conn, None)

    def note_drop(self, peer: Any, why: str) -> None:
        """Logs a dropped connection: each reason at most once per DROP_LOG_EVERY_S, with a count."""
        with self._lock:
            key = why if why in self._drops or len(self._drops) < 32 else "other reasons"
            now = time.monotonic()
            last, since = self._drops.get(key, (-DROP_LOG_EVERY_S, 0))
            if now - last < DROP_LOG_EVERY_S:
                self._drops[key] = (last, since + 1)
                return
            self._drops[key] = (now, 0)
        more = f" ({since} more like it since the last report)" if since else ""
        log.warning("%sdropped connection from %s: %s%s", self.name, peer, why, more)


def shutdown_quietly(sock: socket.socket) -> None:
    """Ends a blocking read on ``sock`` from another thread (it returns at once)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


# ---------------------------------------------------------------- authentication (pure)


def _mac(key: bytes, tag: bytes, identity: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(key, tag + struct.pack("!H", len(identity)) + identity + a + b, hashlib.sha256).digest()


def server_hello() -> Tuple[bytes, bytes]:
    nonce = os.urandom(NONCE)
    return nonce, MAGIC + nonce


def client_answer(key: bytes, hello: bytes, identity: bytes = b"") -> Tuple[bytes, bytes, bytes]:
    """Returns (answer to send, nonce_s, nonce_c).

    ``identity`` names the server the client means to reach (pool/host/incarnation): both MACs
    cover it, so a handshake relayed to another agent of the same pool fails.
    """
    if len(hello) != len(MAGIC) + NONCE or not hello.startswith(MAGIC):
        raise HandshakeRefused("peer is not a monarch-torchx agent (bad greeting)")
    nonce_s = hello[len(MAGIC):]
    nonce_c = os.urandom(NONCE)
    return MAGIC + nonce_c + _mac(key, b"c", identity, nonce_s, nonce_c), nonce_s, nonce_c


def server_check(key: bytes, nonce_s: bytes, answer: bytes, identity: bytes = b"") -> bytes:
    """Verifies the client's answer; returns the server's proof to send back."""
    if len(answer) != len(MAGIC) + NONCE + MAC or not answer.startswith(MAGIC):
        raise HandshakeRefused("malformed handshake")
    nonce_c = answer[len(MAGIC):len(MAGIC) + NONCE]
    if not hmac.compare_digest(answer[-MAC:], _mac(key, b"c", identity, nonce_s, nonce_c)):
        raise HandshakeRefused("authentication failed (wrong pool token, or meant for another agent)")
    return _mac(key, b"s", identity, nonce_c, nonce_s)


def client_check(key: bytes, nonce_s: bytes, nonce_c: bytes, proof: bytes, identity: bytes = b"") -> None:
    if not hmac.compare_digest(proof, _mac(key, b"s", identity, nonce_c, nonce_s)):
        raise HandshakeRefused("agent failed authentication (wrong pool token?)")


ANSWER_LEN = len(MAGIC) + NONCE + MAC
HELLO_LEN = len(MAGIC) + NONCE


# ---------------------------------------------------------------- framing (pure)


def encode(msg: Any) -> List[Any]:
    """Returns the frame as a list of byte-like parts (header, body, out-of-band buffers)."""
    bufs: List[pickle.PickleBuffer] = []
    body = pickle.dumps(msg, protocol=5, buffer_callback=bufs.append)
    return frame_parts(body, bufs)


def frame_parts(body: bytes, bufs: List[Any]) -> List[Any]:
    """The frame for an already pickled body and its out-of-band buffers (PickleBuffers or bytes-like), not joined."""
    raws = [b.raw() if isinstance(b, pickle.PickleBuffer) else memoryview(b) for b in bufs]
    head = _HEAD.pack(len(body), len(raws)) + b"".join(_BUFLEN.pack(r.nbytes) for r in raws)
    return [head, body, *raws]


HUGE = 2 << 20


def big_buffer(n: int) -> Any:
    """A writable buffer for ``n`` received bytes. Large ones are anonymous maps backed by huge
    pages where the kernel allows: filling 64 MiB of fresh bytearray costs ~50 ms of page faults
    here, a huge-page map ~13 ms (a plain copy into warm memory: ~7 ms)."""
    if n < HUGE:
        return bytearray(n)
    import mmap

    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass
    return m


class FrameParser:
    """Incremental frame reader for non-blocking sockets and asyncio ``BufferedProtocol``s.

    Small frames are parsed out of one reusable chunk; a large body or buffer gets its own
    bytearray and the socket is read straight into it (``get_buffer`` hands out a view of it),
    so a 64 MiB tensor crosses from the kernel into its final memory in one copy.
    """

    BIG = 64 * 1024  # segments at least this large are received in place

    def __init__(self, chunk: int = 256 * 1024, alloc: Callable[[int], Any] = big_buffer):
        """``alloc(n)``: the memory a large segment is received into (``big_buffer``: huge-page
        maps for tensors; ``bytearray`` where handlers expect ordinary picklable bytes)."""
        self._alloc = alloc
        self._buf = bytearray(chunk)
        self._start = 0
        self._end = 0
        self._big: Optional[Any] = None
        self._bigpos = 0
        self._stage = 0  # 0: head, 1: buffer lengths, 2: body, 3: buffers
        self._body_len = 0
        self._lens: List[int] = []
        self._body: Any = b""
        self._bufs: List[bytearray] = []

    def get_buffer(self) -> memoryview:
        if self._big is not None:
            return memoryview(self._big)[self._bigpos:]
        if self._end == len(self._buf):
            self._compact()
        return memoryview(self._buf)[self._end:]

    def feed(self, n: int) -> List[Tuple[Any, List[bytearray]]]:
        """Accounts for ``n`` bytes written into the last ``get_buffer``; returns complete frames."""
        if self._big is not None:
            self._bigpos += n
            if self._bigpos < len(self._big):
                return []
            seg, self._big = self._big, None
            frames = self._segment(seg)
        else:
            self._end += n
            frames = []
            if self._stage == 0:
                self._whole_frames(frames)
        while True:
            need = self._need()
            avail = self._end - self._start
            if avail >= need:
                seg = self._buf[self._start:self._start + need]
                self._start += need
                frames += self._segment(seg)
                continue
            if need >= self.BIG:
                self._big = self._alloc(need)
                self._big[:avail] = self._buf[self._start:self._end]
                self._bigpos = avail
                self._start = self._end = 0
            elif need > len(self._buf) - self._start:
                self._compact()
            return frames

    def _whole_frames(self, frames: List[Tuple[Any, List[bytearray]]]) -> None:
        """Fast path: small frames that arrived whole are cut out in one step each."""
        buf, start, end = self._buf, self._start, self._end
        while end - start >= _HEAD.size:
            body_len, nbufs = _HEAD.unpack_from(buf, start)
            _check_head(body_len, nbufs)
            pos = start + _HEAD.size
            if end - pos < 8 * nbufs:
                break
            lens = [_BUFLEN.unpack_from(buf, pos + 8 * i)[0] for i in range(nbufs)]
            pos += 8 * nbufs
            if pos + body_len + sum(lens) > end:
                break
            if any(n > MAX_BUF for n in lens):
                raise MalformedFrame("malformed frame (buffer too large)")
            body = buf[pos:pos + body_len]
            pos += body_len
            bufs = []
            for n in lens:
                bufs.append(buf[pos:pos + n])
                pos += n
            frames.append((body, bufs))
            start = pos
        self._start = start

    def _compact(self) -> None:
        rest = self._end - self._start
        self._buf[:rest] = self._buf[self._start:self._end]
        self._start, self._end = 0, rest

    def _need(self) -> int:
        if self._stage == 0:
            return _HEAD.size
        if self._stage == 1:
            return 8 * len(self._lens)
        if self._stage == 2:
            return self._body_len
        return self._lens[len(self._bufs)]

    def _segment(self, seg: bytearray) -> List[Tuple[Any, List[bytearray]]]:
        if self._stage == 0:
            self._body_len, nbufs = _HEAD.unpack(seg)
            _check_head(self._body_len, nbufs)
            self._lens = [0] * nbufs
            self._stage = 1 if nbufs else 2
            return []
        if self._stage == 1:
            self._lens = [_BUFLEN.unpack_from(seg, 8 * i)[0] for i in range(len(self._lens))]
            if any(n > MAX_BUF for n in self._lens):
                raise MalformedFrame("malformed frame (buffer too large)")
            self._stage = 2
            return []
        if self._stage == 2:
            self._body = seg
        else:
            self._bufs.append(seg)
        if len(self._bufs) < len(self._lens):
            self._stage = 3
            return []
        frame = (self._body, self._bufs)
        self._stage, self._body, self._bufs, self._lens = 0, b"", [], []
        return [frame]


def _check_head(body_len: int, nbufs: int) -> None:
    if body_len > MAX_BODY or nbufs > MAX_BUFS:
        raise MalformedFrame(f"malformed frame (body {body_len} bytes, {nbufs} buffers)")


def decode(body: bytes, bufs: List[bytearray]) -> Any:
    try:
        return pickle.loads(body, buffers=bufs)
    except Exception as e:  # a frame from an authenticated peer that does not unpickle
        raise MalformedFrame(f"malformed message: {e}") from None


def check_msg(msg: Any) -> dict:
    if not isinstance(msg, dict) or not isinstance(msg.get("id"), int):
        raise MalformedFrame("malformed message: not a request/reply dict")
    return msg


# ---------------------------------------------------------------- asyncio transport


async def read_frame(reader: asyncio.StreamReader) -> Any:
    head = await reader.readexactly(_HEAD.size)
    body_len, nbufs = _HEAD.unpack(head)
    _check_head(body_len, nbufs)
    lens = [_BUFLEN.unpack(await reader.readexactly(8))[0] for _ in range(nbufs)]
    if any(n > MAX_BUF for n in lens):
        raise MalformedFrame("malformed frame (buffer too large)")
    body = await reader.readexactly(body_len)
    bufs = [bytearray(await reader.readexactly(n)) if n else bytearray() for n in lens]
    return decode(body, bufs)


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

    def __init__(self, key: bytes, handlers: Dict[str, Handler], on_activity: Optional[Callable[[str], None]] = None,
                 identity: bytes = b""):
        self.key = key
        self.identity = identity
        self._handlers = handlers
        self.on_activity = on_activity or (lambda _op: None)
        self._server: Optional[asyncio.base_events.Server] = None
        self.connections = 0  # authenticated ones
        self.gate = HandshakeGate()  # the ones in their handshake

    async def start(self, host: str, port: int = 0) -> int:
        import asyncio

        from .wire_conn import ServerConnection

        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: ServerConnection(self), host, port)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server:
            self._server.close()

    async def run_request(self, conn: Any, peer: Peer, rid: int, op: Any, args: dict) -> None:
        """Runs one request's handler and writes its reply (or its stream, then the reply) to ``conn``."""
        import asyncio

        handler = self._handlers.get(op) if isinstance(op, str) else None
        try:
            if handler is None:
                raise RemoteError(f"unknown operation {op!r}")
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
            reply = {"id": rid, "ok": False, "error": f"bad arguments for {op!r}: {e}"}
        except Exception as e:
            if not isinstance(e, (RemoteError, ValueError, LookupError, OSError)):
                log.exception("handler %s failed", op)
            reply = {"id": rid, "ok": False, "error": str(e) or type(e).__name__, "kind": type(e).__name__}
        try:
            conn.write(encode(reply))
            await conn.drain()
        except (ConnectionError, OSError, RuntimeError):
            pass


# ---------------------------------------------------------------- blocking transport


def _recv_into(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise PeerClosed("connection closed by peer")
        got += k
    return buf


def client_handshake(sock: socket.socket, key: bytes, identity: bytes, address: str) -> None:
    """The client side of the handshake on a connected blocking socket; closes it on failure."""
    try:
        answer, ns, nc = client_answer(key, bytes(_recv_into(sock, HELLO_LEN)), identity)
        sock.sendall(answer)
        client_check(key, ns, nc, bytes(_recv_into(sock, MAC)), identity)
    except (OSError, WireError) as e:
        sock.close()
        if isinstance(e, socket.timeout):
            raise PeerTimeout(f"peer at {address} did not answer the handshake") from None
        if isinstance(e, WireError):
            raise type(e)(f"{address}: {e}") from None
        raise PeerClosed(f"{address}: {e.strerror or e}") from None


def server_handshake_blocking(sock: socket.socket, key: bytes, identity: bytes) -> None:
    """The server side of the handshake on an accepted blocking socket (with a timeout set)."""
    nonce_s, hello = server_hello()
    sock.sendall(hello)
    sock.sendall(server_check(key, nonce_s, bytes(_recv_into(sock, ANSWER_LEN)), identity))


IOV_MAX = 512  # parts per sendmsg call, well under the kernel's 1024


def consume(views: List[memoryview], sent: int) -> None:
    """Drops what a sendmsg wrote from ``views``; a partly sent part continues where it stopped."""
    while sent:
        n = views[0].nbytes
        if sent >= n:
            sent -= n
            views.pop(0)
        else:
            views[0] = views[0][sent:]
            sent = 0
    while views and views[0].nbytes == 0:
        views.pop(0)


def send_msg(sock: socket.socket, msg: Any) -> None:
    """Blocking write of one frame: sendmsg gathers the parts, so buffers are not joined or copied."""
    parts = [memoryview(p).cast("B") for p in encode(msg)]
    while parts:
        consume(parts, sock.sendmsg(parts[:IOV_MAX]))


def recv_msg(sock: socket.socket) -> Any:
    """Blocking read of one frame."""
    body_len, nbufs = _HEAD.unpack(_recv_into(sock, _HEAD.size))
    _check_head(body_len, nbufs)
    lens = [_BUFLEN.unpack(_recv_into(sock, 8))[0] for _ in range(nbufs)]
    if any(n > MAX_BUF for n in lens):
        raise MalformedFrame("malformed frame (buffer too large)")
    body = bytes(_recv_into(sock, body_len))
    return decode(body, [_recv_into(sock, n) for n in lens])


class Client:
    """Blocking client for one agent; what the torchx CLI and user scripts use.

    Not thread-safe: one request in flight at a time (streams included). Open one per thread.
    """

    def __init__(self, host: str, port: int, key: bytes, timeout: float = 10.0, identity: bytes = b"",
                 sock: Optional[socket.socket] = None):
        """``sock``: an already connected stream (a tunnel, e.g. Kubernetes port-forward) to use
        instead of connecting to host:port; the handshake is the same."""
        self.address = f"{host}:{port}"
        if sock is not None:
            self._sock = sock
            self._sock.settimeout(timeout)
        else:
            try:
                self._sock = socket.create_connection((host, port), timeout=timeout)
            except OSError as e:
                raise ConnectFailed(f"cannot reach agent at {self.address}: {e.strerror or e}",
                                    refused=isinstance(e, ConnectionRefusedError)) from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._ids = itertools.count(1)
        client_handshake(self._sock, key, identity, self.address)

    def close(self) -> None:
        self._sock.close()

    @property
    def local_address(self) -> str:
        """The address this connection leaves from ("" through a tunnel): where the peer can reach us."""
        try:
            name = self._sock.getsockname()
        except OSError:
            return ""
        return name[0] if isinstance(name, tuple) and self._sock.family in (socket.AF_INET, socket.AF_INET6) else ""

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def settimeout(self, timeout: Optional[float]) -> None:
        self._sock.settimeout(timeout)

    def _send(self, msg: dict) -> None:
        send_msg(self._sock, msg)

    def _recv(self) -> dict:
        return check_msg(recv_msg(self._sock))

    def _exchange(self, op: str, args: dict) -> Iterator[dict]:
        rid = next(self._ids)
        try:
            self._send({"id": rid, "op": op, "args": args})
            while True:
                msg = self._recv()
                if msg["id"] == rid:
                    yield msg
                    if "item" not in msg:
                        return
        except socket.timeout:
            self.close()  # mid-frame: the stream can no longer be trusted to be in step
            raise PeerTimeout(f"agent at {self.address} timed out on {op!r}") from None
        except (OSError, WireError) as e:
            self.close()
            if isinstance(e, WireError):
                raise
            raise PeerClosed(f"lost the connection to the agent at {self.address}: {e.strerror or e}") from None

    def call(self, op: str, **args: Any) -> Any:
        for msg in self._exchange(op, args):
            if "item" in msg:
                continue
            if not msg["ok"]:
                raise RemoteError(msg["error"], msg.get("kind", ""))
            return msg["value"]

    def stream(self, op: str, **args: Any) -> Iterator[Any]:
        """Yields each streamed item; closing the iterator early cancels the request."""
        gen = self._exchange(op, args)
        rid = None
        finished = False
        try:
            for msg in gen:
                rid = msg["id"]
                if "item" in msg:
                    yield msg["item"]
                    continue
                finished = True
                if not msg["ok"]:
                    raise RemoteError(msg["error"], msg.get("kind", ""))
                return
        finally:
            if not finished and rid is not None:
                try:
                    self._send({"id": rid, "cancel": True})
                except OSError:
                    pass
                self.close()  # the reply to the cancelled request would desync the next call
