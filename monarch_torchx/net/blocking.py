"""The blocking transport: the one dialer (``dial``), the threaded acceptor, frame writes and
reads on a plain (or TLS) socket, and the request/reply ``Client`` every front end uses.

No asyncio here: this is on the torchx CLI's path (``net.aio`` holds the asyncio side)."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import socket
import ssl
import threading
from typing import Any, Callable, Iterator, TypeVar

from ..credentials import PoolCredentials
from .frames import (
    UNIX,
    ConnectFailed,
    FileRegion,
    FileRegionError,
    FrameParser,
    HandshakeRefused,
    PeerClosed,
    PeerTimeout,
    WireError,
    check_msg,
    decode,
    encode,
    remote_error,
)
from .handshake import HandshakeGate, accept_handshake, client_handshake, shutdown_quietly

log = logging.getLogger("monarch_torchx.wire")
_ClientT = TypeVar("_ClientT", bound="Client")


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
            self.gate.admit(sock, functools.partial(shutdown_quietly, sock))  # the oldest silent one goes when full
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

    def __enter__(self: _ClientT) -> _ClientT:
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
                raise remote_error(msg["error"], msg.get("kind", ""))
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
                    raise remote_error(msg["error"], msg.get("kind", ""))
                return
        finally:
            if not finished and rid is not None:
                try:
                    self._send({"id": rid, "cancel": True})
                except OSError:
                    pass
                self.close()  # the reply to the cancelled request would desync the next call
