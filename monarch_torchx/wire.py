"""The one wire protocol: framing, mutual HMAC authentication, request/reply/stream messages.

Every byte between a controller and an agent (and, later, between actor procs) goes through
this module, so there is exactly one place where untrusted bytes are parsed.

Connection setup (fixed-size raw bytes, nothing is unpickled before it succeeds)::

    server -> client   MAGIC + nonce_s(32)
    client -> server   MAGIC + nonce_c(32) + HMAC(key, b"c" + nonce_s + nonce_c)
    server -> client   HMAC(key, b"s" + nonce_c + nonce_s)

Both sides prove they hold the pool's secret, and both MACs cover the identity of the agent the
client means to reach (pool/index/incarnation), so a client never unpickles what a stranger on a
reused port sends, and a handshake relayed to another agent of the pool fails. A pool whose
traffic leaves the machine (SLURM, Kubernetes) runs all of this inside TLS 1.3, both sides
presenting the pool's certificate (``credentials.PoolCredentials``); a loopback pool sends
plaintext frames. Every connection is opened by ``dial`` and accepted by ``accept_handshake``
(threads) or ``wire_conn.AuthenticatedConnection`` (asyncio). After the handshake, each frame is::

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

import contextlib
import hashlib
import hmac
import itertools
import logging
import os
import pickle
import socket
import ssl
import struct
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterator

from .credentials import PoolCredentials

if TYPE_CHECKING:
    import asyncio

# asyncio is imported where it is used: the blocking client is on the torchx CLI's path, where
# importing asyncio would cost ~30 ms of every `torchx run`.

log = logging.getLogger(__name__)

MAGIC = b"MTX1"
UNIX = "unix:"  # a host of "unix:PATH" is a Unix socket on this machine (its port is 0)
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


class ProofRejected(PeerClosed):
    """The server closed the connection on our handshake answer: most often it holds another
    secret or is another agent, but a server shedding handshakes under a flood does the same,
    so a caller that must tell them apart asks again before concluding."""


class FileRegionError(Exception):
    """A file sent by region could not be read whole (gone, unreadable, or shorter than the
    region): the frame it belonged to cannot be finished, so the connection is closed. A local
    file's fault, not the peer's: not a ``WireError``, so nothing takes it for a lost host."""


class MalformedFrame(WireError):
    """A frame or message that does not follow the protocol."""


class RemoteError(RuntimeError):
    """The peer ran the request and it failed; the message is the peer's one-line reason.

    ``kind`` names the exception type the peer raised, so callers can branch on it.
    """

    def __init__(self, message: str, kind: str = ""):
        super().__init__(message)
        self.kind = kind


class UnknownOperation(RemoteError):
    """The peer serves no such operation (e.g. the module that provides it is not loaded there).

    A client sees it as a RemoteError whose ``kind`` is "UnknownOperation"."""

    def __init__(self, op: Any):
        super().__init__(f"unknown operation {op!r}", "UnknownOperation")


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
        self.pending: dict[Any, Callable[[], None]] = {}  # insertion order: oldest first
        self._lock = threading.Lock()
        self._drops: dict[str, tuple[float, int]] = {}  # reason -> (last logged, dropped since)

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
    """Ends a blocking read on ``sock`` from another thread (it returns at once). On a TLS socket
    it shuts the descriptor down under OpenSSL (the socket's own shutdown would drop its TLS
    state while the other thread is in it)."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


# ---------------------------------------------------------------- authentication (pure)


def _mac(key: bytes, tag: bytes, identity: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(key, tag + struct.pack("!H", len(identity)) + identity + a + b, hashlib.sha256).digest()


def server_hello() -> tuple[bytes, bytes]:
    nonce = os.urandom(NONCE)
    return nonce, MAGIC + nonce


def client_answer(key: bytes, hello: bytes, identity: bytes = b"") -> tuple[bytes, bytes, bytes]:
    """Returns (answer to send, nonce_s, nonce_c).

    ``identity`` names the server the client means to reach (pool/host/incarnation): both MACs
    cover it, so a handshake relayed to another agent of the same pool fails.
    """
    if len(hello) != len(MAGIC) + NONCE or not hello.startswith(MAGIC):
        raise HandshakeRefused("peer is not a monarch-torchx agent (bad greeting)")
    nonce_s = hello[len(MAGIC) :]
    nonce_c = os.urandom(NONCE)
    return MAGIC + nonce_c + _mac(key, b"c", identity, nonce_s, nonce_c), nonce_s, nonce_c


def server_check(key: bytes, nonce_s: bytes, answer: bytes, identity: bytes = b"") -> bytes:
    """Verifies the client's answer; returns the server's proof to send back."""
    if len(answer) != len(MAGIC) + NONCE + MAC or not answer.startswith(MAGIC):
        raise HandshakeRefused("malformed handshake")
    nonce_c = answer[len(MAGIC) : len(MAGIC) + NONCE]
    if not hmac.compare_digest(answer[-MAC:], _mac(key, b"c", identity, nonce_s, nonce_c)):
        raise HandshakeRefused("authentication failed (wrong pool token, or meant for another agent)")
    return _mac(key, b"s", identity, nonce_c, nonce_s)


def client_check(key: bytes, nonce_s: bytes, nonce_c: bytes, proof: bytes, identity: bytes = b"") -> None:
    if not hmac.compare_digest(proof, _mac(key, b"s", identity, nonce_c, nonce_s)):
        raise HandshakeRefused("agent failed authentication (wrong pool token?)")


ANSWER_LEN = len(MAGIC) + NONCE + MAC
HELLO_LEN = len(MAGIC) + NONCE


# ---------------------------------------------------------------- framing (pure)


def encode(msg: Any, gathered: bool = False) -> list[Any]:
    """Returns the frame as a list of byte-like parts (header, body, out-of-band buffers), not
    joined. ``gathered``: the message may hold ``Gathered`` buffers, whose parts (``FileRegion``s
    among them) only ``send_msg`` can write; anywhere else one is refused."""
    bufs: list[pickle.PickleBuffer] = []
    _gathering.on = gathered
    try:
        body = pickle.dumps(msg, protocol=5, buffer_callback=bufs.append)
    finally:
        _gathering.on = False
    return frame_parts(body, bufs)


def frame_parts(body: bytes, bufs: list[Any]) -> list[Any]:
    """The frame for an already pickled body and its out-of-band buffers (PickleBuffers or bytes-like), not joined.
    A ``Gathered`` buffer is one buffer on the wire, written from its parts."""
    raws: list[Any] = []
    lens: list[int] = []
    for b in bufs:
        raw = b.raw() if isinstance(b, pickle.PickleBuffer) else memoryview(b)
        if isinstance(raw.obj, _GatheredToken):
            lens.append(raw.obj.total)
            raws += raw.obj.parts
        else:
            lens.append(raw.nbytes)
            raws.append(raw)
    head = _HEAD.pack(len(body), len(lens)) + b"".join(_BUFLEN.pack(n) for n in lens)
    return [head, body, *raws]


@dataclass(frozen=True)
class FileRegion:
    """``size`` bytes of the file at ``path`` from ``offset``: a part of a ``Gathered`` buffer. A
    plain socket sends it with sendfile, straight from the page cache, so the bytes are never
    copied through this process (a sync's client sends whole trees this way)."""

    path: str
    offset: int
    size: int


class _GatheredToken(bytearray):
    """Stands in for a ``Gathered`` buffer while its message is pickled; ``frame_parts`` writes
    its parts in its place."""

    def __init__(self, parts: list[Any], total: int):
        super().__init__()
        self.parts, self.total = parts, total


_gathering = threading.local()  # set by encode(gathered=True) while it pickles: where a Gathered may be


class Gathered:
    """Parts that travel as one out-of-band buffer and are never joined by the sender: the
    receiver gets a memoryview of the one buffer they arrived in, end to end. A part is
    bytes-like or a ``FileRegion``. Only the blocking transport (``send_msg``, so ``Client``)
    sends one, and only ``encode`` pickles one."""

    def __init__(self, parts: list[Any]):
        self.parts = [p if isinstance(p, FileRegion) else memoryview(p).cast("B") for p in parts]
        self.nbytes = sum(p.size if isinstance(p, FileRegion) else p.nbytes for p in self.parts)

    def __reduce_ex__(self, protocol: Any) -> Any:
        if protocol < 5 or not getattr(_gathering, "on", False):  # elsewhere its bytes would be lost or misframed
            raise pickle.PicklingError("a Gathered buffer is sent only by the blocking transport (wire.send_msg)")
        # a builtin, so that an agent of any version loads it: a memoryview of the one buffer it arrived in
        return memoryview, (pickle.PickleBuffer(_GatheredToken(self.parts, self.nbytes)),)


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

    The chunk starts small and grows (to ``max_chunk``) only when one read fills most of it, or
    a segment needs it: most connections carry small frames one or a few at a time, and a
    controller of a thousand procs, or an agent answering a stream of short requests, would
    otherwise zero and hold the full chunk for each.
    """

    BIG = 64 * 1024  # segments at least this large are received in place

    def __init__(self, chunk: int = 16 * 1024, alloc: Callable[[int], Any] = big_buffer, max_chunk: int = 256 * 1024):
        """``alloc(n)``: the memory a large segment is received into (``big_buffer``: huge-page
        maps for tensors; ``bytearray`` where handlers expect ordinary picklable bytes)."""
        self._alloc = alloc
        self._buf = bytearray(chunk)
        self._max_chunk = max(chunk, max_chunk)
        self._start = 0
        self._end = 0
        self._big: Any | None = None
        self._bigpos = 0
        self._stage = 0  # 0: head, 1: buffer lengths, 2: body, 3: buffers
        self._body_len = 0
        self._lens: list[int] = []
        self._body: Any = b""
        self._bufs: list[bytearray] = []
        self.pending: list[tuple[Any, list[bytearray]]] = []  # for pulling readers: parsed, not yet taken

    def get_buffer(self) -> memoryview:
        if self._big is not None:
            return memoryview(self._big)[self._bigpos :]
        if self._end == len(self._buf):
            self._compact()
        return memoryview(self._buf)[self._end :]

    def wanted(self) -> int:
        """Bytes still missing from the part being read: reading no more than this never reads
        past the end of a frame (for streams where something else follows a frame: fds)."""
        if self._big is not None:
            return len(self._big) - self._bigpos
        return max(1, self._need() - (self._end - self._start))

    def feed(self, n: int) -> list[tuple[Any, list[bytearray]]]:
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
        # a read of half the chunk or more that filled it: a busy stream, worth a larger chunk
        busy = self._big is None and self._end == len(self._buf) and 2 * n >= len(self._buf)
        while True:
            need = self._need()
            avail = self._end - self._start
            if avail >= need:
                seg = self._buf[self._start : self._start + need]
                self._start += need
                frames += self._segment(seg)
                continue
            if need >= self.BIG:
                self._big = self._alloc(need)
                self._big[:avail] = self._buf[self._start : self._end]
                self._bigpos = avail
                self._start = self._end = 0
            elif need > len(self._buf):  # a segment under BIG, larger than the chunk so far
                self._grow(max(need, min(4 * len(self._buf), self._max_chunk)))
            elif busy and len(self._buf) < self._max_chunk:
                self._grow(min(4 * len(self._buf), self._max_chunk))
            elif avail == 0:  # everything parsed: the next read starts at the chunk's start
                self._start = self._end = 0
            elif need > len(self._buf) - self._start:
                self._compact()
            return frames

    def _whole_frames(self, frames: list[tuple[Any, list[bytearray]]]) -> None:
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
            body = buf[pos : pos + body_len]
            pos += body_len
            bufs = []
            for n in lens:
                bufs.append(buf[pos : pos + n])
                pos += n
            frames.append((body, bufs))
            start = pos
        self._start = start

    def _compact(self) -> None:
        rest = self._end - self._start
        self._buf[:rest] = self._buf[self._start : self._end]
        self._start, self._end = 0, rest

    def _grow(self, size: int) -> None:
        """A new, larger chunk with the unparsed bytes at its start (not resized in place: the
        caller may still hold a view of the old one from ``get_buffer``)."""
        rest = self._end - self._start
        new = bytearray(max(size, rest))
        new[:rest] = self._buf[self._start : self._end]
        self._buf, self._start, self._end = new, 0, rest

    def _need(self) -> int:
        if self._stage == 0:
            return _HEAD.size
        if self._stage == 1:
            return 8 * len(self._lens)
        if self._stage == 2:
            return self._body_len
        return self._lens[len(self._bufs)]

    def _segment(self, seg: bytearray) -> list[tuple[Any, list[bytearray]]]:
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


def decode(body: bytes, bufs: list[bytearray]) -> Any:
    try:
        return pickle.loads(body, buffers=bufs)
    except Exception as e:  # a frame from an authenticated peer that does not unpickle
        raise MalformedFrame(f"malformed message: {e}") from None


def check_msg(msg: Any) -> dict:
    if not isinstance(msg, dict) or not isinstance(msg.get("id"), int):
        raise MalformedFrame("malformed message: not a request/reply dict")
    return msg


# ---------------------------------------------------------------- asyncio transport


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
        from .wire_conn import ServerConnection, serve

        self._server = await serve(lambda: ServerConnection(self), host, port, sock=sock)
        name = self._server.sockets[0].getsockname()
        return 0 if isinstance(name, str) else name[1]

    async def close(self) -> None:
        if self._server:
            self._server.close()

    async def run_request(self, conn: Any, peer: Peer, rid: int, op: Any, args: dict) -> None:
        """Runs one request's handler and writes its reply (or its stream, then the reply) to ``conn``."""
        import asyncio

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
            reply = {"id": rid, "ok": False, "error": str(e) or type(e).__name__, "kind": type(e).__name__}
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
        try:
            proof = bytes(_recv_into(sock, MAC))
        except PeerClosed:
            raise ProofRejected("the peer closed the connection on our handshake answer") from None
        client_check(key, ns, nc, proof, identity)
    except (OSError, WireError) as e:
        sock.close()
        if isinstance(e, socket.timeout):
            raise PeerTimeout(f"peer at {address} did not answer the handshake") from None
        if isinstance(e, WireError):
            raise type(e)(f"{address}: {e}") from None
        raise PeerClosed(f"{address}: {e.strerror or e}") from None


def _self_connected(sock: socket.socket) -> bool:
    """Linux may give a connection to a local port nobody listens on that same port as its own
    source port: the socket then talks to itself (TCP simultaneous open) and keeps the port
    bound, so the agent meant to listen there (a worker reopening its port) cannot."""
    try:
        return sock.getsockname() == sock.getpeername()
    except OSError:
        return False


def dial(
    host: str, port: int, creds: PoolCredentials, identity: bytes, timeout: float, sock: socket.socket | None = None
) -> socket.socket:
    """The one way to open a connection to a member of a pool: connect, TLS where the pool uses
    it, then the handshake. Returns a blocking socket (``timeout`` set) ready for frames.

    ``sock``: an already connected stream to use instead (a tunnel: Kubernetes port-forward).
    Raises ConnectFailed, HandshakeRefused, PeerTimeout or PeerClosed, never a bare OSError.
    """
    address = host if host.startswith(UNIX) else f"{host}:{port}"
    if sock is None:
        try:
            if host.startswith(UNIX):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(timeout)
                try:
                    sock.connect(host[len(UNIX) :])
                except OSError:
                    sock.close()
                    raise
            else:
                sock = socket.create_connection((host, port), timeout=timeout)
                if _self_connected(sock):
                    sock.close()  # at once: it holds the very port the peer is about to listen on
                    raise ConnectionRefusedError(111, "nothing listens there (the connection met itself)")
        except OSError as e:
            raise ConnectFailed(
                f"cannot reach {address}: {e.strerror or e}",
                refused=isinstance(e, (ConnectionRefusedError, FileNotFoundError)),
            ) from None
    sock.settimeout(timeout)
    with contextlib.suppress(OSError):  # (a tunnel may not be TCP)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        ctx = creds.client_context
    except (OSError, ssl.SSLError) as e:  # tls.pem missing or damaged
        sock.close()
        raise HandshakeRefused(f"cannot use the pool's certificate {creds.tls_file}: {e}") from None
    if ctx is not None:
        try:
            sock = ctx.wrap_socket(sock)
        except ssl.SSLEOFError:
            sock.close()
            raise PeerClosed(
                f"{address}: the peer closed the connection during TLS (busy, or not one of ours)"
            ) from None
        except ssl.SSLError as e:
            sock.close()
            raise HandshakeRefused(f"{address}: TLS refused ({e.reason or e}): not this pool's certificate") from None
        except TimeoutError:
            sock.close()
            raise PeerTimeout(f"peer at {address} did not answer the TLS handshake") from None
        except OSError as e:
            sock.close()
            raise PeerClosed(f"{address}: {e.strerror or e}") from None
    client_handshake(sock, creds.key, identity, address)
    return sock


def accept_handshake(sock: socket.socket, creds: PoolCredentials, identity: bytes) -> socket.socket:
    """The server side of ``dial`` on an accepted blocking socket: TLS where the pool uses it
    (``sock`` comes wrapped for it, server side, its handshake not done: the caller's gate and
    this timer then hold the socket in use), then the handshake, within HANDSHAKE_TIMEOUT_S in
    all (a trickling peer is cut off). Closes the socket on failure."""
    timer = threading.Timer(HANDSHAKE_TIMEOUT_S, lambda: shutdown_quietly(sock))
    timer.start()
    try:
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            if isinstance(sock, ssl.SSLSocket):
                sock.do_handshake()
        except ssl.SSLError as e:
            raise HandshakeRefused(f"TLS refused ({e.reason or e})") from None
        nonce_s, hello = server_hello()
        sock.sendall(hello)
        sock.sendall(server_check(creds.key, nonce_s, bytes(_recv_into(sock, ANSWER_LEN)), identity))
    except BaseException:
        sock.close()
        raise
    finally:
        timer.cancel()
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class ThreadedAcceptor:
    """A listening socket served by threads: the acceptor of processes that serve from threads
    (a controller's inbox, the rdma data plane; the asyncio one is ``wire_conn``).

    Each connection's TLS and handshake run on a thread of their own under a HandshakeGate;
    an authenticated socket is handed to ``on_connection(sock, peer)`` on that thread (which
    may serve it there, or pass it on). ``max_conns`` bounds connections open at once.
    """

    def __init__(
        self,
        bind: str,
        creds: PoolCredentials,
        identity: bytes,
        on_connection: Callable[[socket.socket, Any], None],
        name: str,
        backlog: int = 128,
        max_conns: int = 1 << 30,
    ):
        self.creds, self.identity, self.on_connection = creds, identity, on_connection
        self.max_conns = max_conns
        self.gate = HandshakeGate(name=f"{name}: ")
        self.socks: set = set()  # open accepted sockets (a forked child closes its copies)
        self._lock = threading.Lock()
        self.lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.lsock.bind((bind, 0))
        self.lsock.listen(backlog)
        self.port = self.lsock.getsockname()[1]
        threading.Thread(target=self._accept_loop, name=f"monarch-torchx-{name}", daemon=True).start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.lsock.close()

    def close_copies(self) -> None:
        """In a forked child: closes the inherited copies of the parent's sockets."""
        for sock in [self.lsock, *self.socks]:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept_loop(self) -> None:
        ctx = self.creds.server_context
        while True:
            try:
                raw, peer = self.lsock.accept()
            except OSError:
                return
            with self._lock:
                if len(self.socks) >= self.max_conns:
                    self.gate.note_drop(peer, f"{len(self.socks)} connections already")
                    raw.close()
                    continue
            # wrapped here (no I/O yet), so the gate, the timer and forget() all hold the socket in use
            sock = ctx.wrap_socket(raw, server_side=True, do_handshake_on_connect=False) if ctx else raw
            with self._lock:
                self.socks.add(sock)
            self.gate.admit(sock, lambda s=sock: shutdown_quietly(s))  # the oldest silent one goes when full
            try:
                threading.Thread(target=self._serve, args=(sock, peer), daemon=True).start()
            except RuntimeError as e:  # no thread to spare (a flood): this one goes, the acceptor stays
                self.gate.release(sock)
                self.gate.note_drop(peer, f"no thread for its handshake ({e})")
                sock.close()
                self.forget(sock)

    def _serve(self, sock: socket.socket, peer: Any) -> None:
        try:
            try:
                sock = accept_handshake(sock, self.creds, self.identity)
            except (OSError, WireError) as e:
                self.gate.note_drop(peer, str(e) or "handshake timed out")
                self.forget(sock)
                return
            finally:
                self.gate.release(sock)
            self.on_connection(sock, peer)
        except Exception:
            log.exception("%sconnection from %s failed", self.gate.name, peer)
            sock.close()
            self.forget(sock)

    def forget(self, sock: socket.socket) -> None:
        """A connection handed to on_connection has ended (closed by whoever served it)."""
        with self._lock:
            self.socks.discard(sock)


IOV_MAX = 512  # parts per sendmsg call, well under the kernel's 1024
TLS_WRITE = 256 << 10  # a TLS write takes one contiguous buffer: small parts are joined up to this


def consume(views: list[memoryview], sent: int) -> None:
    """Drops what a send wrote from ``views``; a partly sent part continues where it stopped."""
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


def send_some(sock: socket.socket, views: list[memoryview]) -> int:
    """One gathered write of the front of ``views``; returns what was sent (see ``consume``).

    Plain sockets gather with sendmsg (nothing copied). TLS sockets take one buffer per write:
    small parts are joined (one record, not one per part), large ones sent in slices. A TLS
    write that would block raises BlockingIOError like a plain one; retried with the same
    views, it presents the same bytes, as OpenSSL requires.
    """
    if not isinstance(sock, ssl.SSLSocket):
        return sock.sendmsg(views[:IOV_MAX])
    if views[0].nbytes >= TLS_WRITE or len(views) == 1:
        data: Any = views[0][: TLS_WRITE * 16]
    else:
        k, total = 0, 0
        while k < len(views) and total + views[k].nbytes <= TLS_WRITE:
            total += views[k].nbytes
            k += 1
        data = b"".join(views[: max(k, 1)])
    try:
        return sock.send(data)
    except (ssl.SSLWantWriteError, ssl.SSLWantReadError):
        raise BlockingIOError("TLS write would block") from None


def recv_some(sock: socket.socket, view: memoryview) -> int:
    """A non-blocking read (0: the peer closed). Raises BlockingIOError when nothing is there,
    for TLS too (where a partial record is not yet data)."""
    try:
        return sock.recv_into(view)
    except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
        raise BlockingIOError("no whole TLS record yet") from None


def more_buffered(sock: socket.socket) -> bool:
    """Whether decrypted bytes wait inside a TLS socket: select() cannot see them."""
    return isinstance(sock, ssl.SSLSocket) and sock.pending() > 0


def send_msg(sock: socket.socket, msg: Any) -> None:
    """Blocking write of one frame: the parts are gathered, not joined (see ``send_some``); a
    ``FileRegion`` goes by ``send_region``."""
    parts = [p if isinstance(p, FileRegion) else memoryview(p).cast("B") for p in encode(msg, gathered=True)]
    views: list[Any] = []
    for p in parts:
        if not isinstance(p, FileRegion):
            if p.nbytes:
                views.append(p)
            continue
        while views:
            consume(views, send_some(sock, views))
        send_region(sock, p)
    while views:
        consume(views, send_some(sock, views))


def send_region(sock: socket.socket, region: FileRegion) -> None:
    """Blocking write of a file's bytes (a blocking socket, or one with a timeout). A plain
    socket gets them by sendfile (the kernel hands the page-cache pages to the socket); TLS
    encrypts from memory, so they are read in slices into one buffer. A file that is gone,
    unreadable or shorter than the region raises ``FileRegionError`` (the frame cannot be
    finished)."""
    sent = 0
    try:
        f = open(region.path, "rb")
    except OSError as e:
        raise FileRegionError(f"{region.path}: {e.strerror or e}") from None
    with f:
        if not isinstance(sock, ssl.SSLSocket):
            sent = sock.sendfile(f, region.offset, region.size) if region.size else 0
        else:
            slice_ = memoryview(bytearray(min(TLS_WRITE * 16, region.size)))
            while sent < region.size:
                try:
                    n = os.preadv(f.fileno(), [slice_[: region.size - sent]], region.offset + sent)
                except OSError as e:
                    raise FileRegionError(f"reading {region.path}: {e.strerror or e}") from None
                if not n:
                    break
                views = [slice_[:n]]
                while views:
                    consume(views, send_some(sock, views))
                sent += n
    if sent < region.size:
        raise FileRegionError(
            f"{region.path} ended {region.size - sent} byte(s) before the part being sent (it shrank meanwhile)"
        )


class FrameReader:
    """Blocking reads of whole messages from one socket, through a ``FrameParser``.

    ``exact``: never read past the end of a message (the fork server's channel, where file
    descriptors follow), at the cost of a few more reads per message."""

    def __init__(self, sock: socket.socket, exact: bool = False):
        self.sock = sock
        self.exact = exact
        self.parser = FrameParser()

    def recv(self) -> Any:
        frames = self.parser.pending
        while not frames:
            into = self.parser.get_buffer()
            n = self.sock.recv_into(into[: self.parser.wanted()] if self.exact else into)
            if n == 0:
                raise PeerClosed("connection closed by peer")
            frames.extend(self.parser.feed(n))
        return decode(*frames.pop(0))


class Client:
    """Blocking client for one agent; what the torchx CLI and user scripts use.

    Not thread-safe: one request in flight at a time (streams included). Open one per thread.
    """

    def __init__(
        self,
        host: str,
        port: int,
        creds: PoolCredentials,
        timeout: float = 10.0,
        identity: bytes = b"",
        sock: socket.socket | None = None,
    ):
        """``sock``: an already connected stream (a tunnel, e.g. Kubernetes port-forward) to use
        instead of connecting to host:port; TLS and the handshake are the same."""
        self.address = f"{host}:{port}"
        self._sock = dial(host, port, creds, identity, timeout, sock=sock)
        self._frames = FrameReader(self._sock)
        self._ids = itertools.count(1)

    def close(self) -> None:
        self._sock.close()

    def abort(self) -> None:
        """From another thread: ends the request in flight here (its read raises PeerClosed)."""
        shutdown_quietly(self._sock)

    @property
    def local_address(self) -> str:
        """The address this connection leaves from ("" through a tunnel): where the peer can reach us."""
        try:
            name = self._sock.getsockname()
        except OSError:
            return ""
        return name[0] if isinstance(name, tuple) and self._sock.family in (socket.AF_INET, socket.AF_INET6) else ""

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def settimeout(self, timeout: float | None) -> None:
        self._sock.settimeout(timeout)

    def _send(self, msg: dict) -> None:
        send_msg(self._sock, msg)

    def _recv(self) -> dict:
        return check_msg(self._frames.recv())

    def _exchange(self, op: str, args: dict) -> Iterator[dict]:
        rid = next(self._ids)
        try:
            try:
                self._send({"id": rid, "op": op, "args": args})
            except BaseException as e:
                if not isinstance(e, OSError):  # (those are answered below)
                    self.close()  # a frame cut short (a file region's fault, an interrupt): out of step
                raise
            while True:
                msg = self._recv()
                if msg["id"] == rid:
                    yield msg
                    if "item" not in msg:
                        return
        except TimeoutError:
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
