"""Transfers over the owner's data-plane sockets: several streams for large ones, received
straight into the destination (``recv_into`` on a view of it: no intermediate copy)."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import net
from .memory import RDMAError, wait_all
from .owner import REQ, WRITE, recv_exact, recv_json, recv_status, send_json, time_left

STREAM_MIN = 8 << 20  # a transfer this large is split over several connections
MAX_STREAMS = 4
MAX_IDLE = 8  # connections kept per owner between transfers
Owner = tuple[str, int, str]


class TcpClient:
    """Idle authenticated connections per owner, reused across transfers."""

    def __init__(self, creds: Any):
        self.creds = creds
        self._idle: dict[Owner, list[socket.socket]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="monarch-torchx-rdma-tcp")

    def close(self) -> None:
        with self._lock:
            socks = [s for idle in self._idle.values() for s in idle]
            self._idle.clear()
        for s in socks:
            s.close()
        self._pool.shutdown(wait=False)

    def _connect(self, owner: Owner, deadline: float) -> socket.socket:
        with self._lock:
            idle = self._idle.get(owner)
            if idle:
                return idle.pop()
        host, port, identity = owner
        try:
            return net.dial(host, port, self.creds, identity.encode(), min(time_left(deadline), 10.0))
        except net.ConnectFailed as e:
            raise RDMAError(f"cannot reach the buffer's owner ({e}): is it still running?") from None
        except net.PeerTimeout as e:
            raise RDMAError(f"the buffer's owner did not answer in time ({e})") from None
        except net.WireError as e:
            raise RDMAError(
                f"the buffer's owner at {host}:{port} closed or refused the connection "
                f"(too busy, gone, or another pool's): {e}"
            ) from None

    def _release(self, owner: Owner, sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(owner, [])
            if len(idle) < MAX_IDLE:
                idle.append(sock)
                return
        sock.close()

    def _call(self, owner: Owner, deadline: float, body: Any) -> Any:
        """Runs ``body(sock)`` on a connection; keeps the connection only when it is in step."""
        sock = self._connect(owner, deadline)
        try:
            result = body(sock)
        except TimeoutError:
            sock.close()
            raise RDMAError("the transfer timed out (the owner is busy, hung or unreachable)") from None
        except (ConnectionError, OSError) as e:
            sock.close()
            raise RDMAError(f"lost the buffer's owner mid-transfer ({e}): it has probably exited") from None
        except RDMAError:
            self._release(owner, sock)  # the owner answered with an error: still in step
            raise
        self._release(owner, sock)
        return result

    def _one(self, owner: Owner, op: int, slot: int, gen: int, offset: int, view: memoryview, deadline: float) -> None:
        def body(sock: socket.socket) -> None:
            sock.settimeout(time_left(deadline))
            sock.sendall(REQ.pack(op, slot, gen, offset, view.nbytes))
            if op == WRITE:
                sock.settimeout(time_left(deadline))
                sock.sendall(view)  # the timeout bounds the whole sendall
                sock.settimeout(time_left(deadline))
                recv_status(sock)
            else:
                sock.settimeout(time_left(deadline))
                recv_status(sock)
                recv_exact(sock, view, deadline)

        self._call(owner, deadline, body)

    def transfer(
        self, owner: Owner, op: int, slot: int, gen: int, offset: int, view: memoryview, deadline: float
    ) -> None:
        n = view.nbytes
        streams = 1 if n < STREAM_MIN else min(MAX_STREAMS, n // (STREAM_MIN // 2))
        if streams == 1:
            self._one(owner, op, slot, gen, offset, view, deadline)
            return
        step = -(-n // streams)
        wait_all(
            [
                self._pool.submit(self._one, owner, op, slot, gen, offset + i, view[i : i + step], deadline)
                for i in range(0, n, step)
            ]
        )

    def exchange(self, owner: Owner, op: int, slot: int, gen: int, payload: Any, timeout: float) -> Any:
        """A request with a JSON payload and a JSON answer (the ibverbs queue-pair exchange)."""
        deadline = time.monotonic() + timeout

        def body(sock: socket.socket) -> Any:
            sock.settimeout(time_left(deadline))
            sock.sendall(REQ.pack(op, slot, gen, 0, 0))
            send_json(sock, payload)
            recv_status(sock)
            return recv_json(sock)

        return self._call(owner, deadline, body)

    def request(self, owner: Owner, op: int, slot: int, gen: int, timeout: float) -> bytes:
        """A small control request (INFO, DROP); returns the bytes after the status."""
        deadline = time.monotonic() + timeout

        def body(sock: socket.socket) -> bytes:
            sock.settimeout(time_left(deadline))
            sock.sendall(REQ.pack(op, slot, gen, 0, 0))
            recv_status(sock)
            extra = bytearray(8 if op == 3 else 0)
            recv_exact(sock, memoryview(extra), deadline)
            return bytes(extra)

        return self._call(owner, deadline, body)
