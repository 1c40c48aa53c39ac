"""How a batch's bytes get from one machine to the next: one interface, two ways.

``socket``: the bytes ride in the ``syncfs.put`` request itself, as one out-of-band buffer on the
pool's authenticated connection (never copied through pickle; the client writes it from its files,
``client.batch_parts``). ``rdma``: the request carries an
``RDMABuffer`` handle on the sender's memory, and the receiver pulls the bytes with the rdma
module's best backend for that pair: ibverbs between hosts with RDMA devices, cma on one host,
its TCP data plane otherwise. The sender chooses per sync and every hop of a chain forwards the
way it received. ``auto`` (the default) takes rdma only where it beats the socket, i.e. where
ibverbs is usable and the hosts can reach the client directly (no tunnel);
``MONARCH_TORCHX_SYNC_TRANSFER=socket|rdma`` forces one.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import threading
from typing import Any, Callable

from ..errors import MonarchError

MODES = ("auto", "socket", "rdma")
CHAIN_LENGTH = 16  # hosts fed as one chain; a bigger group is fed as two halves (downstream_groups)
log = logging.getLogger("monarch_torchx.syncfs")
ENV = "MONARCH_TORCHX_SYNC_TRANSFER"


def requested_mode() -> str:
    """What ``MONARCH_TORCHX_SYNC_TRANSFER`` asks for, checked (before any host is asked anything)."""
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise MonarchError(f"{ENV}={mode!r}: use auto, socket or rdma")
    return mode


def choose(local_address: str) -> str:
    """The way this sync sends; ``local_address``: where the hosts reach this machine ("" through a tunnel)."""
    mode = requested_mode()
    if mode == "rdma" and not local_address:
        raise MonarchError(
            f"{ENV}=rdma, but the hosts are reached through a tunnel and cannot pull from this machine; unset it"
        )
    if mode != "auto":
        return mode
    if not local_address or not _rdma_devices():
        return "socket"
    from ..rdma import get_rdma_backend

    try:
        return "rdma" if get_rdma_backend() == "ibverbs" else "socket"
    except Exception:  # a forced rdma backend that cannot work here: the socket still does
        return "socket"


def _rdma_devices() -> bool:
    """Whether the kernel lists an RDMA device (without importing pyverbs: a no-op sync must stay fast)."""
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


def outgoing(mode: str, pool: str, bind: str, data: Any) -> tuple[dict[str, Any], Callable[[], object]]:
    """The put arguments that carry ``data``, and what to call once the put returned."""
    if mode == "socket":
        return {"data": pickle.PickleBuffer(data)}, lambda: None
    from ..rdma import RDMABuffer, RDMAError

    try:
        buf = RDMABuffer(data, pool=pool, bind=bind)
    except RDMAError as e:  # e.g. this process already serves the pool's buffers on another address
        log.info("sending a batch by socket: %s", e)
        return {"data": pickle.PickleBuffer(data)}, lambda: None
    return {"rdma": buf}, lambda: buf.drop()


def incoming(pool: str, creds: Any, data: Any, rdma: Any, timeout: float = 120.0) -> tuple[Any, str]:
    """A received batch's bytes, pulled first when they came as an RDMABuffer; and how they came."""
    if rdma is None:
        if data is None:
            raise ValueError("a put needs data or rdma")
        return data, "socket"
    from ..actor import session
    from ..rdma import RDMABuffer, RDMAError

    if not isinstance(rdma, RDMABuffer):
        raise ValueError("rdma must be an RDMABuffer")
    session.hub_for(pool, creds)  # the pool's credentials, for the rdma data plane (an agent has no registry)
    local = bytearray(rdma.size())
    try:
        via = f"rdma/{rdma.backend}"
        rdma.read_into(local, timeout=timeout).get()
    except RDMAError as e:
        raise ValueError(f"pulling a batch over rdma failed: {e}") from None
    return local, via


class Pump:
    """Items sent to one peer over ``streams`` connections of its own, from a bounded queue: while
    the peer handles one item, the next ones are on the wire (the client feeding a host, a host
    forwarding down its chain). Threads start with the first item, connections with each thread's
    first send. The first failure is kept in ``error``; the items after it are dropped, so the
    producer never blocks on a dead peer."""

    def __init__(
        self, connect: Callable[[], Any], send: Callable[[Any, Any], None], depth: int, streams: int, name: str
    ):
        self.connect, self.send, self.streams, self.name = connect, send, streams, name
        self.queue: queue.Queue[Any] = queue.Queue(depth)
        self.error = ""
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def put(self, item: Any) -> None:
        if self.error:
            return
        if not self.threads:
            self.threads = [
                threading.Thread(target=self._run, name=f"{self.name}-{k}", daemon=True) for k in range(self.streams)
            ]
            for t in self.threads:
                t.start()
        self.queue.put(item)

    def _run(self) -> None:
        conn = None
        try:
            while True:
                item = self.queue.get()
                if item is None:
                    return
                if self.error:
                    continue  # drain
                try:
                    conn = conn or self.connect()
                    self.send(conn, item)
                except Exception as e:
                    self.abort(str(e) or type(e).__name__)
        finally:
            if conn is not None:
                conn.close()

    def abort(self, why: str) -> None:
        """Drops what is queued from now on; the first reason stays."""
        with self.lock:
            self.error = self.error or why

    def finish(self) -> str:
        """Waits until every queued item is sent (or dropped after a failure); the failure, or ""."""
        for _ in self.threads:
            self.queue.put(None)
        for t in self.threads:
            t.join()
        return self.error


def downstream_groups(hosts: list[Any], chain_length: int) -> list[list[Any]]:
    """How one sender (the client, or a host passing batches on) feeds the hosts below it: up
    to ``chain_length`` of them, as one chain; more, as two halves, each fed the same way by its
    first host. No machine sends a byte more than twice, however many hosts (the client no longer
    feeds one chain per ``chain_length`` hosts); a chain bounds how far one failure reaches, and
    the halving bounds the depth to about log2(N / chain_length) + chain_length hops."""
    if len(hosts) <= max(1, chain_length):
        return [list(hosts)] if hosts else []
    half = (len(hosts) + 1) // 2
    return [list(hosts[:half]), list(hosts[half:])]


def forwarding(via: str) -> str:
    """The way a host forwards what came to it ``via``."""
    return "rdma" if via.startswith("rdma") else "socket"
