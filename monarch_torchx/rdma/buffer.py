"""``RDMABuffer``: a picklable handle on another process's memory, read and written one-sided.

Monarch's API: the owner wraps memory (``RDMABuffer(tensor)``) and hands the buffer out in an
actor message; any holder calls ``read_into(dst)`` / ``write_from(src)`` and gets a Future. The
backend is picked per transfer: **cma** when the owner is on this host (one kernel copy, the
owner's Python not involved), else **ibverbs** when both sides have an RDMA device, else **tcp**
(the owner's data-plane threads serve it). ``MONARCH_TORCHX_RDMA=ibverbs|tcp|cma`` forces one.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..actor.future import Future
from . import cma, ibverbs
from .memory import LocalMemory, RDMAError, local_memory, wait_all
from .owner import DROP, IBV_CONNECT, READ, WRITE, owner_for

BACKENDS = ("ibverbs", "tcp", "cma")
INLINE_MAX = 4 << 20  # same-host copies up to this size run in the caller's thread
CMA_SPLIT = 4 << 20  # larger same-host copies run as parallel kernel copies
_state: dict[str | tuple[str, str], Any] = {}
_lock = threading.Lock()


def _forced() -> str | None:
    v = os.environ.get("MONARCH_TORCHX_RDMA", "").strip().lower()
    if v in ("", "auto"):
        return None
    if v not in BACKENDS:
        raise RDMAError(f"MONARCH_TORCHX_RDMA={v!r} is not a backend: use ibverbs, tcp or cma (or unset it)")
    return v


def is_ibverbs_available() -> bool:
    """Whether this host can move buffers with ibverbs (a device and pyverbs), as Monarch's."""
    return bool(ibverbs.available())


def is_rdma_available() -> bool:
    """Whether RDMABuffer works here: always, over tcp and cma where there is no ibverbs device."""
    return True


def get_rdma_backend() -> str:
    """The backend this process uses for buffers on other hosts: ``ibverbs`` or ``tcp``
    (``cma`` when forced; same-host transfers use cma automatically)."""
    forced = _forced()
    if forced == "ibverbs" and not ibverbs.available():
        raise RDMAError(f"MONARCH_TORCHX_RDMA=ibverbs, but {ibverbs.devices()[1]}; unset it to use tcp/cma")
    if forced:
        return forced
    return "ibverbs" if ibverbs.available() else "tcp"


def _executor(name: str = "executor") -> ThreadPoolExecutor:
    """Transfers run on "executor"; the parts of a split copy on "parts" (never nested in one pool)."""
    with _lock:
        ex = _state.get(name)
        if ex is None:
            ex = _state[name] = ThreadPoolExecutor(max_workers=32, thread_name_prefix=f"monarch-torchx-rdma-{name}")
        return ex


def _reset_after_fork() -> None:
    """A forked child starts clean: no parent threads to wait for, no shared sockets."""
    for key, value in list(_state.items()):
        if isinstance(key, tuple) and key[0] == "tcp":
            for socks in value._idle.values():
                for sock in socks:
                    sock.close()
    _state.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def _tcp(pool: str) -> Any:
    from ..actor import session
    from .tcp import TcpClient

    creds = session.hub_for(pool).creds
    with _lock:
        client = _state.get(("tcp", pool))
        if client is None or client.creds != creds:
            if client is not None:
                client.close()  # the pool was replaced: its owners are gone
            client = _state[("tcp", pool)] = TcpClient(creds)
        return client


def _current_pool(pool: str | None) -> str:
    from ..actor import session

    me = session.this_proc()
    pool = pool or (me.pool if me is not None else session.current_pool())
    if pool is None:
        raise RDMAError("RDMABuffer needs a pool: attach() to one first (or pass pool=)")
    return pool


@dataclass(frozen=True)
class _Handle:
    """Everything a holder needs to reach the memory (no secret: the pool's token stays home)."""

    pool: str
    host: str
    port: int
    identity: str
    slot: int
    generation: int
    size: int
    pid: int
    start_time: int | None
    host_key: str
    table_address: int
    address: int
    rkey: int | None
    owner: str
    readonly: bool

    @property
    def owner_addr(self) -> tuple[str, int, str]:
        return (self.host, self.port, self.identity)


class RDMABuffer:
    """A region of this process's memory that other processes of the pool may read and write."""

    def __init__(self, data: Any, *, pool: str | None = None, bind: str | None = None):
        """``bind``: where this process serves its buffers, when it is not a proc of the pool
        (an agent, a sync client): the address its peers reach it on."""
        from ..actor import context

        backend = get_rdma_backend()  # a forced backend that cannot work fails here, in one line
        mem = local_memory(data, "RDMABuffer")
        if mem.nbytes == 0:
            raise ValueError("Cannot create RDMABuffer with size 0.")
        pool = _current_pool(pool)
        own = owner_for(pool, bind)
        slot, gen = own.register(mem)
        rkey = None
        try:
            if backend == "ibverbs":
                v = ibverbs.verbs()
                own.ibv = v
                rkey, _ = v.register(slot, mem)
        except BaseException:
            own.drop(slot, gen)  # nothing registered half-way stays pinned
            raise
        who = context().actor_instance
        self._h = _Handle(
            pool,
            own.host,
            own.port,
            own.identity,
            slot,
            gen,
            mem.nbytes,
            os.getpid(),
            cma.start_time(os.getpid()),
            cma.host_key(),
            own.table_address,
            mem.address,
            rkey,
            f"{who.name}[{who.rank.rank}] pid {os.getpid()} on {socket.gethostname()}",
            mem.readonly,
        )
        self._dropped = False

    @classmethod
    def _from_handle(cls, h: _Handle) -> RDMABuffer:
        buf = cls.__new__(cls)
        buf._h = h
        buf._dropped = False
        return buf

    def __reduce__(self) -> Any:
        return RDMABuffer._from_handle, (self._h,)

    def __repr__(self) -> str:
        return f"RDMABuffer({self._h.size} bytes, owner {self._h.owner})"

    def size(self) -> int:
        return self._h.size

    @property
    def owner(self) -> str:
        return self._h.owner

    @property
    def backend(self) -> str:
        """The backend a transfer from this process to this buffer uses now."""
        return _choose(self._h)

    def read_into(self, dst: Any, *, offset: int = 0, timeout: float = 60) -> Future[None]:
        """Copies the buffer's bytes [offset, size) into ``dst`` (at least that large)."""
        return RDMAAction().read_remote(dst, self, offset=offset).submit(timeout=timeout)

    def write_from(self, src: Any, *, offset: int = 0, timeout: float = 60) -> Future[None]:
        """Copies all of ``src`` into the buffer at ``offset`` (it must fit)."""
        return RDMAAction().write_remote(self, src, offset=offset).submit(timeout=timeout)

    def drop(self) -> Future[None]:
        """Releases the memory: later reads and writes, from anywhere, fail with a clear error."""
        fut: Future[None] = Future()
        h = self._h
        self._dropped = True
        if h.pid == os.getpid():
            owner_for(h.pool).drop(h.slot, h.generation)
            fut.set_result(None)
            return fut

        def remote() -> None:
            _tcp(h.pool).request(h.owner_addr, DROP, h.slot, h.generation, 30.0)

        _run(fut, [remote])
        return fut


@dataclass
class _Op:
    buf: RDMABuffer
    local: LocalMemory
    offset: int
    write: bool


class RDMAAction:
    """A batch of reads and writes, submitted as one unit (they run concurrently)."""

    def __init__(self) -> None:
        self._ops: list[_Op] = []

    def read_remote(self, dst: Any, src: RDMABuffer, *, offset: int = 0) -> RDMAAction:
        self._ops.append(_check(src, local_memory(dst, "read_into dst"), offset, write=False))
        return self

    def write_remote(self, dst: RDMABuffer, src: Any, *, offset: int = 0) -> RDMAAction:
        self._ops.append(_check(dst, local_memory(src, "write_from src"), offset, write=True))
        return self

    def submit(self, *, timeout: float = 60) -> Future[None]:
        """Runs the batch; the timeout counts from now (waiting for a thread included)."""
        _check_overlaps(self._ops)
        fut: Future[None] = Future()
        deadline = time.monotonic() + timeout
        if len(self._ops) == 1 and self._ops[0].local.nbytes <= INLINE_MAX and _choose(self._ops[0].buf._h) == "cma":
            try:  # a small same-host copy: cheaper done now than handed to a thread
                _transfer(self._ops[0], deadline)
            except (RDMAError, ValueError) as e:
                fut.set_exception(e)
            else:
                fut.set_result(None)
            return fut
        _run(fut, [lambda op=op: _transfer(op, deadline) for op in self._ops])
        return fut


def _check_overlaps(ops: list[_Op]) -> None:
    """Like Monarch: a batch runs concurrently, so it may not both write and use the same bytes."""
    remote = [((op.buf._h.identity, op.buf._h.slot), op.offset, op.offset + op.local.nbytes, op.write) for op in ops]
    local = [(op.local.address, op.local.address + op.local.nbytes, not op.write) for op in ops]  # a read writes dst
    for i in range(len(ops)):
        for j in range(i + 1, len(ops)):
            a, b = remote[i], remote[j]
            if a[0] == b[0] and a[1] < b[2] and b[1] < a[2] and (a[3] or b[3]):
                raise ValueError(f"operations {i} and {j} of the batch write and use the same bytes of one buffer")
            la, lb = local[i], local[j]
            if la[0] < lb[1] and lb[0] < la[1] and (la[2] or lb[2]):
                raise ValueError(f"operations {i} and {j} of the batch write and use the same local memory")


def _check(buf: RDMABuffer, mem: LocalMemory, offset: int, write: bool) -> _Op:
    if buf._dropped:
        raise RDMAError("this RDMABuffer was dropped (drop() was called on it)")
    size = buf.size()
    if not 0 <= offset < size:
        raise ValueError(f"offset {offset} is outside the buffer ({size} bytes)")
    if write:
        if buf._h.readonly:
            raise RDMAError("the buffer's memory is read-only (it was made from bytes or a read-only view)")
        if mem.nbytes > size - offset:
            raise ValueError(f"src has {mem.nbytes} bytes but the buffer has {size - offset} from offset {offset}")
        return _Op(buf, mem, offset, True)
    n = size - offset
    if mem.nbytes < n:
        raise ValueError(f"dst has {mem.nbytes} bytes but the buffer has {n} to read (from offset {offset})")
    if mem.readonly:
        raise RDMAError("dst is read-only memory: read into a tensor, bytearray or writable view")
    return _Op(buf, LocalMemory(mem.view[:n], mem.address, False, mem.keepalive), offset, False)


def _run(fut: Future[None], jobs: list[Any]) -> None:
    ex = _executor()
    remaining = [len(jobs)]
    errors: list[BaseException] = []
    lock = threading.Lock()

    def one(job: Any) -> None:
        try:
            job()
        except BaseException as e:
            with lock:
                errors.append(e)
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            if errors:
                err = errors[0]
                fut.set_exception(err if isinstance(err, (RDMAError, ValueError)) else RDMAError(str(err)))
            else:
                fut.set_result(None)

    if not jobs:
        fut.set_result(None)
    for job in jobs:
        ex.submit(one, job)


# ---------------------------------------------------------------- choosing and running a backend


def _same_host(h: _Handle) -> bool:
    return h.host_key == cma.host_key() and h.host_key != ""


def _choose(h: _Handle) -> str:
    forced = _forced()
    if forced == "cma" and not _same_host(h):
        raise RDMAError(f"MONARCH_TORCHX_RDMA=cma, but the buffer's owner ({h.owner}) is on another host")
    if forced == "ibverbs" and h.rkey is None:
        raise RDMAError("MONARCH_TORCHX_RDMA=ibverbs, but the owner registered this buffer without ibverbs")
    if forced:
        return forced
    if _same_host(h) and h.start_time is not None and h.pid not in _state.setdefault("cma_refused", set()):
        return "cma"
    if h.rkey is not None and ibverbs.available():
        return "ibverbs"
    return "tcp"


def _transfer(op: _Op, deadline: float) -> None:
    h = op.buf._h
    if time.monotonic() > deadline:
        raise RDMAError("the transfer timed out before it could start (too many transfers at once?)")
    backend = _choose(h)
    if backend == "cma":
        try:
            _transfer_cma(h, op)
            return
        except cma.CMAPermissionError:
            if _forced() == "cma":
                raise
            _state.setdefault("cma_refused", set()).add(h.pid)  # e.g. Yama ptrace_scope: tcp from now on
    if backend == "ibverbs":
        assert h.rkey is not None  # _choose picks ibverbs only for a buffer registered with it
        v = ibverbs.verbs()
        qp = v.qp_to(h.owner_addr, lambda info: _ibv_exchange(h, info))
        v.transfer(h.owner_addr, qp, h.rkey, h.address, op.local, op.offset, op.write, deadline)
        return
    _tcp(h.pool).transfer(
        h.owner_addr, WRITE if op.write else READ, h.slot, h.generation, op.offset, op.local.view, deadline
    )


def _ibv_exchange(h: _Handle, info: dict[str, Any]) -> dict[str, Any]:
    return _tcp(h.pool).exchange(h.owner_addr, IBV_CONNECT, h.slot, h.generation, info, 30.0)


def _owner_alive(h: _Handle) -> bool:
    """Same pid and start time as when the buffer was made (re-read at most every 0.5 s: a
    dead owner in between shows up as ESRCH on the next copy anyway)."""
    seen = _state.setdefault("alive", {})
    now = time.monotonic()
    if seen.get((h.pid, h.start_time), 0.0) > now:
        return True
    if cma.start_time(h.pid) != h.start_time:
        return False
    seen[(h.pid, h.start_time)] = now + 0.5
    return True


def _transfer_cma(h: _Handle, op: _Op) -> None:
    n = op.local.nbytes
    if h.pid == os.getpid():  # our own buffer: a memmove, against the memory our table holds
        own = owner_for(h.pool)
        if not own.owns(h.identity):
            raise RDMAError(f"the buffer's owner ({h.owner}) has exited")
        mem = own.lookup(h.slot, h.generation)  # held: it cannot be freed during the copy
        src, dst = (
            (op.local.address, mem.address + op.offset) if op.write else (mem.address + op.offset, op.local.address)
        )
        ctypes.memmove(dst, src, n)
        return
    try:
        _copy_cma(h, op, n)
    except cma.CMAPermissionError:
        raise
    except RDMAError:
        if cma.start_time(h.pid) != h.start_time:  # whatever the kernel said, the real cause
            raise RDMAError(f"the buffer's owner ({h.owner}) has exited") from None
        raise


def _copy_cma(h: _Handle, op: _Op, n: int) -> None:
    if not _owner_alive(h):
        raise RDMAError(f"the buffer's owner ({h.owner}) has exited")
    if cma.generation(h.pid, h.table_address, h.slot) != h.generation:
        raise RDMAError("the buffer was dropped by its owner (drop() was called)")
    if n < 2 * CMA_SPLIT:
        cma.transfer(h.pid, op.local.address, h.address + op.offset, n, op.write)
    else:  # the copies run in the kernel with the GIL released: use the cores
        parts = min(4, os.cpu_count() or 1, n // CMA_SPLIT)
        step = -(-n // parts)
        wait_all(
            [
                _executor("parts").submit(
                    cma.transfer, h.pid, op.local.address + i, h.address + op.offset + i, min(step, n - i), op.write
                )
                for i in range(0, n, step)
            ]
        )
    if cma.generation(h.pid, h.table_address, h.slot) != h.generation:
        raise RDMAError(
            "the buffer was dropped by its owner during the transfer; the destination may hold partial data"
        )
