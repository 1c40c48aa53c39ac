"""Frames of the one wire protocol: the codec, its limits, and the errors every transport raises.

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

import logging
import pickle
import struct
import threading
from dataclasses import dataclass
from typing import Any, Callable, Protocol

log = logging.getLogger("monarch_torchx.wire")

MAGIC = b"MTX1"
UNIX = "unix:"  # a host of "unix:PATH" is a Unix socket on this machine (its port is 0)
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

    ``kind`` names the exception type the peer raised (its wire form). ``remote_error`` rebuilds
    it as the ``RemoteError`` subclass of that name where this process has one, so a caller
    writes ``except RelayRefused:``; for any other type, ``raised(TypeError)`` says whether the
    peer raised one. Callers never compare the name themselves.
    """

    def __init__(self, message: str, kind: str = ""):
        super().__init__(message)
        self.kind = kind or type(self).__name__

    def raised(self, *types: type[BaseException]) -> bool:
        """Whether the peer's exception was one of ``types`` (or a subclass of ours, rebuilt here)."""
        return isinstance(self, types) or self.kind in {t.__name__ for t in types}


class UnknownOperation(RemoteError):
    """The peer serves no such operation (e.g. the module that provides it is not loaded there)."""

    def __init__(self, op: Any):
        super().__init__(f"unknown operation {op!r}")


def _subclass_named(cls: type[RemoteError], name: str) -> type[RemoteError] | None:
    for sub in cls.__subclasses__():
        if sub.__name__ == name:
            return sub
        found = _subclass_named(sub, name)
        if found is not None:
            return found
    return None


def remote_error(message: str, kind: str) -> RemoteError:
    """A peer's error as this process's type: the ``RemoteError`` subclass named ``kind`` (of the
    ones imported here), else a ``RemoteError`` that keeps ``kind``."""
    sub = _subclass_named(RemoteError, kind) if kind else None
    if sub is None:
        return RemoteError(message, kind)
    err = sub.__new__(sub)
    RemoteError.__init__(err, message, kind)
    return err


class FrameSink(Protocol):
    """The writing side of one connection, whatever drives its socket: an asyncio transport
    (``aio.ServerConnection``, the actor proc's ``ProcConnection``), or a controller's own I/O
    (``actor.hub.Conn``, ``LocalConn``). ``write`` queues one whole frame (``encode``'s parts), in
    order; it raises ConnectionError once the connection is gone."""

    def write(self, parts: list[Any]) -> None: ...


class AsyncFrameSink(FrameSink, Protocol):
    """A ``FrameSink`` on an event loop, whose writer waits (``drain``) while the peer is slower."""

    async def drain(self) -> None: ...


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
    pages where the kernel allows: far fewer page faults to fill (benchmarks/RESULTS.md,
    "numbers behind the code")."""
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
