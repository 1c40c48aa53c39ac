"""Transfers over the owner's data-plane sockets: several streams for large ones, received
straight into the destination (``recv_into`` on a view of it: no intermediate copy)."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Tuple

from .. import wire
from .memory import RDMAError
from .owner import REQ, WRITE, recv_exact, recv_json, recv_status, send_json

STREAM_MIN = 8 << 20  # a transfer this large is split over several connections
MAX_STREAMS = 4


class TcpClient:
    """Idle authenticated connections per owner, reused across transfers."""

    def __init__(self, key: bytes):
        self.key = key
        self._idle: Dict[Tuple[str, int, str], List[socket.socket]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="monarch-torchx-rdma-tcp")

    def _connect(self, owner: Tuple[str, int, str], timeout: float) -> socket.socket:
        with self._lock:
            idle = self._idle.get(owner)
            if idle:
                return idle.pop()
        host, port, identity = owner
        try:
            sock = socket.create_connection((host, port), timeout=min(timeout, 10.0))
        except OSError as e:
            raise RDMAError(f"cannot reach the buffer's owner at {host}:{port} ({e.strerror or e}): "
                            f"is it still running?") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            wire.client_handshake(sock, self.key, identity.encode(), f"{host}:{port}")
        except wire.WireError as e:
            raise RDMAError(f"the buffer's owner refused us: {e}") from None
        return sock

    def _release(self, owner: Tuple[str, int, str], sock: socket.socket) -> None:
        with self._lock:
            self._idle.setdefault(owner, []).append(sock)

    def _one(self, owner: Tuple[str, int, str], op: int, slot: int, gen: int, offset: int,
             view: memoryview, deadline: float) -> None:
        sock = self._connect(owner, deadline - time.monotonic())
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.sendall(REQ.pack(op, slot, gen, offset, view.nbytes))
            if op == WRITE:
                sock.sendall(view)
                recv_status(sock)
            else:
                recv_status(sock)
                recv_exact(sock, view)
        except socket.timeout:
            sock.close()
            raise RDMAError("the transfer timed out (the owner is busy, hung or unreachable)") from None
        except (ConnectionError, OSError) as e:
            sock.close()
            raise RDMAError(f"lost the buffer's owner mid-transfer ({e}): it has probably exited") from None
        except RDMAError:
            self._release(owner, sock)  # an answered error leaves the connection in step
            raise
        self._release(owner, sock)

    def transfer(self, owner: Tuple[str, int, str], op: int, slot: int, gen: int, offset: int,
                 view: memoryview, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        n = view.nbytes
        streams = 1 if n < STREAM_MIN else min(MAX_STREAMS, n // (STREAM_MIN // 2))
        if streams == 1:
            self._one(owner, op, slot, gen, offset, view, deadline)
            return
        step = -(-n // streams)
        futs = [self._pool.submit(self._one, owner, op, slot, gen, offset + i, view[i:i + step], deadline)
                for i in range(0, n, step)]
        errors = []
        for f in futs:
            try:
                f.result()
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def exchange(self, owner: Tuple[str, int, str], op: int, slot: int, gen: int, payload: Any,
                 timeout: float) -> Any:
        """A request with a JSON payload and a JSON answer (the ibverbs queue-pair exchange)."""
        sock = self._connect(owner, timeout)
        try:
            sock.settimeout(timeout)
            sock.sendall(REQ.pack(op, slot, gen, 0, 0))
            send_json(sock, payload)
            recv_status(sock)
            answer = recv_json(sock)
        except (ConnectionError, OSError) as e:
            sock.close()
            raise RDMAError(f"lost the buffer's owner ({e}): it has probably exited") from None
        self._release(owner, sock)
        return answer

    def request(self, owner: Tuple[str, int, str], op: int, slot: int, gen: int, timeout: float) -> bytes:
        """A small control request (INFO, DROP); returns the bytes after the status."""
        sock = self._connect(owner, timeout)
        try:
            sock.settimeout(timeout)
            sock.sendall(REQ.pack(op, slot, gen, 0, 0))
            recv_status(sock)
            extra = bytearray(8) if op == 3 else bytearray(0)
            recv_exact(sock, memoryview(extra))
        except (ConnectionError, OSError) as e:
            sock.close()
            raise RDMAError(f"lost the buffer's owner ({e}): it has probably exited") from None
        self._release(owner, sock)
        return bytes(extra)
