"""The owner side: registered buffers, and the data-plane server other processes pull from.

Each process that creates an RDMABuffer runs one data-plane server (threads, blocking
sockets: copies run in the kernel with the GIL released, in parallel). It speaks a tiny binary
protocol after the pool's usual handshake (no pickle on the data plane at all)::

    request   op u8 | slot u32 | generation u32 | offset u64 | length u64     (25 bytes)
    READ  -> status u8 (0) + length bytes straight from the buffer's memory
    WRITE -> the client sends length bytes right after the request; received in place
    INFO / DROP / IBV_CONNECT (payload: u32 len + JSON)
    errors: status 1 + u32 len + a one-line message (a WRITE's bytes are drained first)

Buffers live in a table of generations: a slot is valid while its word equals the handle's
generation. The table's address is in every handle, so a same-host reader (cma) checks
validity with one 4-byte process_vm_readv and never involves this process's Python.
"""

from __future__ import annotations

import array
import collections
import json
import logging
import os
import socket
import struct
import threading
import time
import uuid
from typing import Any

from .. import net
from .memory import LocalMemory, RDMAError, collapse_to_huge_pages

log = logging.getLogger("monarch_torchx.rdma")

REQ = struct.Struct("!BIIQQ")
READ, WRITE, INFO, DROP, IBV_CONNECT = 1, 2, 3, 4, 5
SLOTS = 1 << 16
MAX_CONNS = 512
HUGE_MIN = 8 << 20  # buffers this large are moved to huge pages in the background
QUARANTINE_S = 10.0  # a dropped buffer's memory outlives its registration this long


def send_error(sock: socket.socket, msg: str) -> None:
    data = msg.encode()[:4096]
    sock.sendall(b"\x01" + struct.pack("!I", len(data)) + data)


def time_left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fills ``view``. With a deadline, it bounds the whole read (a trickle stops there), not each recv."""
    got = 0
    if deadline is not None:
        sock.settimeout(time_left(deadline))
    while got < view.nbytes:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed by peer")
        got += k
        if deadline is not None and got < view.nbytes:
            time_left(deadline)


def recv_status(sock: socket.socket) -> None:
    """Raises RDMAError with the owner's message when it answered with an error."""
    head = bytearray(1)
    recv_exact(sock, memoryview(head))
    if head[0] == 0:
        return
    n = bytearray(4)
    recv_exact(sock, memoryview(n))
    msg = bytearray(struct.unpack("!I", n)[0])
    recv_exact(sock, memoryview(msg))
    raise RDMAError(msg.decode("utf-8", "replace"))


def recv_json(sock: socket.socket) -> Any:
    n = bytearray(4)
    recv_exact(sock, memoryview(n))
    data = bytearray(struct.unpack("!I", n)[0])
    recv_exact(sock, memoryview(data))
    return json.loads(bytes(data))


def send_json(sock: socket.socket, obj: Any) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


class Owner:
    """This process's registered buffers and its data-plane server for one pool."""

    def __init__(self, pool: str, creds: Any, bind: str, advertise: str):
        self.pool = pool
        self.creds = creds
        self.generations = array.array("I", [0]) * SLOTS  # fixed size: its address never moves
        self.table_address = self.generations.buffer_info()[0]
        self._buffers: dict[int, tuple[int, LocalMemory]] = {}
        self._free = list(range(SLOTS - 1, 0, -1))
        self._next_gen = 1
        self._lock = threading.Lock()
        self.identity = f"{pool}/rdma/{os.getpid()}/{uuid.uuid4().hex[:8]}"
        self.host = advertise
        self._huge: dict[int, threading.Event] = {}
        self._quarantine: collections.deque[tuple[float, LocalMemory]] = collections.deque()
        self.ibv: Any = None  # the ibverbs side, when that backend is in use
        self.acceptor = net.ThreadedAcceptor(
            bind, creds, self.identity.encode(), self._serve, name="rdma", max_conns=MAX_CONNS
        )
        self.port = self.acceptor.port

    # ------------------------------------------------------------ the table

    def register(self, mem: LocalMemory) -> tuple[int, int]:
        with self._lock:
            if not self._free:
                raise RDMAError(f"this process already owns {SLOTS - 1} RDMA buffers: drop() some")
            slot = self._free.pop()
            gen = self._next_gen
            self._next_gen = self._next_gen % 0xFFFFFFFF + 1
            self._buffers[slot] = (gen, mem)
            self.generations[slot] = gen
            done = self._huge[slot] = threading.Event()
        if mem.nbytes >= HUGE_MIN and not mem.readonly:

            def collapse() -> None:  # in the background: transfers meanwhile just run at 4 KiB-page speed
                collapse_to_huge_pages(mem.address, mem.nbytes)
                done.set()

            threading.Thread(target=collapse, name="monarch-torchx-rdma-hugepages", daemon=True).start()
        else:
            done.set()
        return slot, gen

    def wait_huge_pages(self, slot: int, timeout: float) -> bool:
        """For benchmarks: wait until a buffer's memory was moved to huge pages (or that was skipped)."""
        ev = self._huge.get(slot)
        return ev.wait(timeout) if ev is not None else True

    def owns(self, identity: str) -> bool:
        return identity == self.identity

    def lookup(self, slot: int, gen: int) -> LocalMemory:
        entry = self._buffers.get(slot)
        if entry is None or entry[0] != gen:
            raise RDMAError("the buffer was dropped by its owner (drop() was called)")
        return entry[1]

    def drop(self, slot: int, gen: int) -> None:
        """Refuses new transfers at once; keeps the memory alive a little longer, so a same-host
        copy that passed its check just before cannot land in memory the allocator reused."""
        with self._lock:
            entry = self._buffers.get(slot)
            if entry is None or entry[0] != gen:
                return
            self.generations[slot] = 0
            del self._buffers[slot]
            self._huge.pop(slot, None)
            if self.ibv is not None:
                self.ibv.deregister(slot)  # before the slot can be handed out again
            self._free.insert(0, slot)  # reused last
            now = time.monotonic()
            self._quarantine.append((now + QUARANTINE_S, entry[1]))
            while self._quarantine and self._quarantine[0][0] < now:
                self._quarantine.popleft()

    # ------------------------------------------------------------ the server

    def _serve(self, sock: socket.socket, peer: Any) -> None:
        """Serves one authenticated connection's requests, one at a time, until it closes."""
        try:
            req = bytearray(REQ.size)
            while True:
                try:
                    recv_exact(sock, memoryview(req))
                except ConnectionError:
                    return
                self._request(sock, *REQ.unpack(req))
        except (OSError, net.WireError, ConnectionError) as e:
            log.debug("rdma connection from %s ended: %s", peer, e)
        finally:
            sock.close()
            self.acceptor.forget(sock)

    def _request(self, sock: socket.socket, op: int, slot: int, gen: int, offset: int, length: int) -> None:
        try:
            mem = self.lookup(slot, gen)
            if op in (READ, WRITE) and offset + length > mem.nbytes:
                raise RDMAError(f"bytes {offset}..{offset + length} are outside the buffer ({mem.nbytes} bytes)")
            if op == WRITE and mem.readonly:
                raise RDMAError("the buffer's memory is read-only (it was made from bytes or a read-only view)")
        except RDMAError as e:
            if op == WRITE:
                _drain(sock, length)
            elif op == IBV_CONNECT:
                recv_json(sock)
            send_error(sock, str(e))
            return
        if op == READ:
            sock.sendall(b"\x00")
            sock.sendall(mem.view[offset : offset + length])
        elif op == WRITE:
            recv_exact(sock, mem.view[offset : offset + length])
            sock.sendall(b"\x00")
        elif op == INFO:
            sock.sendall(b"\x00" + struct.pack("!Q", mem.nbytes))
        elif op == DROP:
            self.drop(slot, gen)
            sock.sendall(b"\x00")
        elif op == IBV_CONNECT:
            peer_info = recv_json(sock)
            try:
                if self.ibv is None:
                    raise RDMAError("the owner does not use ibverbs")
                mine = self.ibv.accept_peer(peer_info)
            except Exception as e:
                send_error(sock, f"ibverbs connect failed at the owner: {e}")
                return
            sock.sendall(b"\x00")
            send_json(sock, mine)
        else:
            send_error(sock, f"unknown rdma operation {op}")


def _drain(sock: socket.socket, n: int) -> None:
    scratch = bytearray(min(n, 1 << 20) or 1)
    while n:
        k = sock.recv_into(scratch, min(n, len(scratch)))
        if k == 0:
            raise ConnectionError("connection closed by peer")
        n -= k


_owners: dict[str, Owner] = {}
_owners_lock = threading.Lock()


def owner_for(pool: str, bind: str | None = None) -> Owner:
    """This process's owner for ``pool`` (started on first use; ``bind``: the address its data
    plane listens on, for a process that is not a proc, e.g. an agent or a sync client)."""
    with _owners_lock:
        own = _owners.get(pool)
        if own is not None and bind and own.host != bind:
            raise RDMAError(f"this process already serves pool {pool!r}'s buffers on {own.host}, not {bind}")
        if own is None and bind:
            from ..actor import session

            own = _owners[pool] = Owner(pool, session.hub_for(pool).creds, bind, bind)
        if own is None:
            from ..actor import session

            hub = session.hub_for(pool)
            me = session.this_proc()
            if me is not None and me.pool == pool:
                bind = os.environ.get("MONARCH_TORCHX_PROC_BIND", "127.0.0.1")
                advertise = os.environ.get("MONARCH_TORCHX_PROC_ADVERTISE", bind)
            else:
                bind = advertise = hub.local_address()
            own = _owners[pool] = Owner(pool, hub.creds, bind, advertise)
        return own


def forget_after_fork() -> None:
    """A forked child serves nothing of its parent's: close its copies of the parent's sockets."""
    for own in _owners.values():
        own.acceptor.close_copies()
    _owners.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=forget_after_fork)
