"""The handshake of the one wire protocol: both sides prove they hold the pool's secret (mutual
HMAC over both nonces and the identity of the member dialled) before any frame is decoded, and a
gate bounds how many unauthenticated connections a server entertains.

The pure half (``server_hello``, ``client_answer``, ``server_check``, ``client_check``) is shared by
the blocking sockets here and by the asyncio acceptor (``net.aio``)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import ssl
import struct
import threading
import time
from typing import Any, Callable

from ..credentials import PoolCredentials
from .frames import (
    MAGIC,
    HandshakeRefused,
    PeerClosed,
    PeerTimeout,
    ProofRejected,
    WireError,
)

log = logging.getLogger("monarch_torchx.wire")

NONCE = 32
MAC = 32
# a connection's TLS and handshake, together, end within this (a trickling peer is cut off); read at
# each use, here and by ``aio``, so that it is one setting
HANDSHAKE_TIMEOUT_S = 5.0
MAX_HANDSHAKES = 256  # unauthenticated connections an agent entertains at once (then the oldest goes)

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
    if sock.family != socket.AF_UNIX:  # (a Unix socket has no Nagle to turn off: debugger.py)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
