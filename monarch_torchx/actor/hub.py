"""One process's connections to actor procs, read by whichever thread is waiting.

Controllers and actors talk to procs directly over the wire protocol (same handshake, same
frames as the agent). There is no reader thread: a thread that waits on a future takes the
reader role, pumps every connection until its future is done, then hands the role to the
next waiter. A round trip therefore costs two syscalls and no thread switch. When no caller
reads, an idle reader does, so a proc's death (its connection's end) is seen while the program
computes; a third thread runs the supervision handlers. In an actor proc the idle reader is the
proc's event loop: what the loop awaits (a multicast's answers from its subtree, an ``await``ed
call) is read and completed there, with no thread between.

Each message is a small plain-pickled header plus a payload pickled once (cloudpickle,
out-of-band buffers) and carried as the frame's buffers: a call to N procs pickles its
arguments once, and a proc forwarding a multicast passes the payload on without unpickling it.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import pickle
import queue
import resource
import select
import selectors
import socket
import threading
import time
import uuid
from typing import Any, Callable, NamedTuple, cast

from .. import net
from ..credentials import PoolCredentials
from . import messages, pickling
from .errors import ProcStopped, SupervisionError
from .future import Future

log = logging.getLogger("monarch_torchx.actor")

CONNECT_TIMEOUT_S = 10.0
IDLE_READ_S = 0.05  # no caller has read for this long: the idle reader reads
SEND_TIMEOUT_S = 120.0


class ProcAddr(NamedTuple):
    host: str
    port: int
    identity: str


def encode(header: messages.Message, payload: Any = None, packed: list[Any] | None = None) -> list[Any]:
    """Frame parts for ``header`` + ``payload`` (or an already packed payload: [body, *bufs])."""
    if packed is None:
        body, bufs = pickling.dumps(payload)
        packed = [pickle.PickleBuffer(body), *bufs]
    return net.frames.frame_parts(messages.dumps(header), packed)


def pack(payload: Any) -> list[Any]:
    body, bufs = pickling.dumps(payload)
    return [pickle.PickleBuffer(body), *bufs]


def unpack(bufs: list[bytearray]) -> Any:
    return pickling.loads(bufs[0], bufs[1:])


def send_parts(
    sock: socket.socket, parts: list[Any], timeout: float = SEND_TIMEOUT_S, io_lock: threading.Lock | None = None
) -> None:
    """Writes a whole frame on a non-blocking socket (gathered, nothing joined). ``io_lock``:
    held around each write (never while waiting), as OpenSSL takes one call at a time per socket."""
    views = [memoryview(p).cast("B") for p in parts]
    views = [v for v in views if v.nbytes]
    deadline = None
    lock = io_lock or contextlib.nullcontext()
    while views:
        try:
            with lock:
                sent = net.blocking.send_some(sock, views)
        except (BlockingIOError, InterruptedError):
            deadline = deadline or time.monotonic() + timeout
            left = deadline - time.monotonic()
            if left <= 0 or not _writable(sock, left):
                raise TimeoutError(f"peer did not take data for {timeout:.0f} s") from None
            continue
        net.blocking.consume(views, sent)


def _writable(sock: socket.socket, timeout: float) -> bool:
    """Whether ``sock`` takes data within ``timeout`` s (poll, not select: a controller of a big
    mesh holds more than select's 1,024 descriptors)."""
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    return bool(poller.poll(max(0.0, timeout) * 1000))


def raise_open_files_limit() -> None:
    """Lifts this process's soft limit on open files to the hard one: a controller keeps one
    socket per proc of its meshes (the soft limit is often 1,024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(soft, 1 << 16) if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):  # not allowed here: the soft limit stays
            pass


def _send_now(sock: socket.socket, parts: list[Any], io_lock: threading.Lock) -> list[memoryview]:
    """Sends what the socket takes without waiting; returns what is left."""
    views = [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]
    while views:
        try:
            with io_lock:
                sent = net.blocking.send_some(sock, views)
        except (BlockingIOError, InterruptedError):
            break
        net.blocking.consume(views, sent)
    return views


def _close_selected(sel: selectors.BaseSelector, sock: socket.socket) -> None:
    """Stops watching a socket (if it was watched) and closes it."""
    try:
        sel.unregister(sock)
    except (KeyError, ValueError):
        pass
    sock.close()


def _copy(parts: list[Any]) -> bytes:
    """The unsent rest of a frame, copied: the sender may change its tensors once send() returns."""
    return b"".join(bytes(memoryview(p).cast("B")) for p in parts)


class Conn:
    """One authenticated connection; requests go out, replies (or port messages) come in."""

    def __init__(self, hub: Hub, addr: ProcAddr, sock: socket.socket | None):
        self.hub = hub
        self.addr = addr
        self.sock = sock
        self.parser = net.FrameParser()
        self.send_lock = threading.Lock()
        self.io_lock = threading.Lock()  # one socket call at a time (a TLS socket is not full duplex)
        self.pending: dict[int, Future[Any]] = {}
        self.error: BaseException | None = None
        self.inbound = False  # a peer's connection to our inbox: it only brings port messages
        self.backlog: collections.deque[bytes] | None = None  # frames a proc's loop handed to a writer thread
        self.on_lost: Callable[[ProcAddr], None] | None = None  # we own the proc: told if this breaks

    @staticmethod
    def open(hub: Hub, addr: ProcAddr) -> socket.socket:
        sock = net.dial(addr.host, addr.port, hub.creds, addr.identity.encode(), CONNECT_TIMEOUT_S)
        sock.setblocking(False)
        return sock

    def write(self, parts: list[Any]) -> None:
        """One frame, no reply awaited (``net.FrameSink``)."""
        self.send(parts)

    def send(self, parts: list[Any], rid: int = 0, fut: Future[Any] | None = None) -> None:
        with self.send_lock:
            if self.error is not None:
                if fut is None:
                    raise self.error
                fut.set_exception(self.error)
                return
            if fut is not None:
                self.pending[rid] = fut  # before the send: the reply may be read at once
            failure: BaseException | None = None
            try:
                if self.backlog is not None:  # a writer thread is still sending earlier frames: queue behind
                    self.backlog.append(_copy(parts))
                elif self.hub.on_a_proc_loop():
                    assert self.sock is not None  # connected: a backlog is kept until it is
                    rest = _send_now(self.sock, parts, self.io_lock)  # a proc's event loop must never block on a peer
                    if rest:
                        self.backlog = collections.deque([_copy(rest)])
                        threading.Thread(target=self._write_backlog, daemon=True).start()
                else:
                    assert self.sock is not None  # connected: a backlog is kept until it is
                    send_parts(self.sock, parts, io_lock=self.io_lock)
            except (OSError, TimeoutError) as e:
                failure = e
        if failure is not None:
            self.hub.lost(self, failure)
            if fut is None:
                raise self.error or failure

    def _write_backlog(self) -> None:
        """Sends what the event loop could not, in order, then lets direct sends resume."""
        while True:
            with self.send_lock:
                if not self.backlog or self.error is not None:
                    self.backlog = None
                    return
                data = self.backlog[0]
            assert self.sock is not None  # the backlog is written once connected
            try:
                send_parts(self.sock, [data], io_lock=self.io_lock)
            except (OSError, TimeoutError) as e:
                with self.send_lock:
                    self.backlog = None
                self.hub.lost(self, e)
                return
            with self.send_lock:
                if self.backlog:
                    self.backlog.popleft()

    def on_readable(self) -> None:
        """Reads what is there (never blocks) and dispatches each whole frame."""
        assert self.sock is not None  # watched for reading once connected
        while True:
            view = self.parser.get_buffer()
            try:
                with self.io_lock:
                    n = net.blocking.recv_some(self.sock, view)
                    more = net.more_buffered(self.sock)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self.hub.lost(self, e)
                return
            if n == 0:
                self.hub.lost(self, None)
                return
            try:
                frames = self.parser.feed(n)
            except net.WireError as e:
                self.hub.lost(self, e)
                return
            for body, bufs in frames:
                self.hub.dispatch(self, body, bufs)
            if n < len(view) and not more:
                return


class Hub:
    """All of one process's proc connections for one pool (keyed by the pool's credentials)."""

    def __init__(self, creds: PoolCredentials, pool: str):
        raise_open_files_limit()
        self.creds = creds
        self.pool = pool
        self.sender = uuid.uuid4().hex[:16]
        self.sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._conns: dict[ProcAddr, Conn] = {}
        self._lock = threading.Lock()
        self._connecting: dict[ProcAddr, threading.Lock] = {}
        self.dead: dict[ProcAddr, BaseException] = {}
        self.explain: dict[ProcAddr, Callable[[], str]] = {}  # why a proc is gone (asks its agent)
        self._reading = False
        self._cond = threading.Condition()
        self.closing: dict[ProcAddr, BaseException] = {}  # procs being stopped on purpose
        # how a proc reaches actors of its own process (an actor proc's own; the controller's own proc)
        self.locals: dict[ProcAddr, LocalConn] = {}
        self.mesh_refs_sent: set = set()  # (proc, mesh id, procs): that proc has the mesh's procs (proc_mesh)
        self.refs_lock = threading.Lock()
        self._waiters = 0
        self._ids = itertools.count(1)
        self._seqs: dict[ProcAddr, itertools.count[int]] = {}
        self.ports: dict[str, Callable[[Any], None]] = {}  # port id -> deliver(value)
        self.actors_on: dict[ProcAddr, list[str]] = {}  # what a supervision report says ran on a proc
        self.listen_addr: ProcAddr | None = None
        self._losses: queue.SimpleQueue[tuple[ProcAddr, Callable[[ProcAddr], None]]] | None = None
        # the idle reader: reads when no caller has for IDLE_READ_S, so a supervision event
        # reaches its hook while the program waits on something else (as Monarch's runtime does)
        self._idle_reader = False
        self._idle_leads = False  # the idle reader holds the reader role
        self._want_lead = False  # a caller asked the idle reader to hand the role over
        self._last_caller = time.monotonic()
        # an actor proc's event loop, reading when no thread does (read_on_loop)
        self._loop: Any | None = None
        self._loop_watching = False  # its reader is registered (taken off while a thread reads)

    # ------------------------------------------------------------ connections

    def next_id(self) -> int:
        return next(self._ids)

    def next_seq(self, addr: ProcAddr) -> int:
        with self._lock:
            c = self._seqs.get(addr)
            if c is None:
                c = self._seqs[addr] = itertools.count()
            return next(c)

    def conn(self, addr: ProcAddr) -> Conn:
        c = self._conns.get(addr)
        if c is not None:
            return c
        with self._lock:
            gate = self._connecting.setdefault(addr, threading.Lock())
        with gate:
            c = self._conns.get(addr)
            if c is not None:
                return c
            if addr in self.dead:
                raise self.dead[addr]
            local = self.locals.get(addr)
            if local is not None:
                return local  # type: ignore[return-value]
            if self.on_a_proc_loop():
                # a proc's event loop must not wait for a peer's handshake: that peer may be
                # waiting for ours. Frames queue until a thread has connected.
                c = Conn(self, addr, None)
                c.backlog = collections.deque()
                self._conns[addr] = c
                threading.Thread(target=self._connect_later, args=(c,), daemon=True).start()
                return c
            try:
                sock = Conn.open(self, addr)
            except net.WireError as e:  # not remembered: a busy proc may answer the next time
                raise self._lost_error(addr, e) from None
            c = Conn(self, addr, sock)
            self._conns[addr] = c
            self.sel.register(sock, selectors.EVENT_READ, c)
            self._start_idle_reader()
            return c

    def on_a_proc_loop(self) -> bool:
        """Whether this thread runs a proc's event loop (which must never wait on a peer)."""
        return bool(self.locals) and any(local.on_loop_thread() for local in tuple(self.locals.values()))

    def _connect_later(self, c: Conn) -> None:
        try:
            sock = Conn.open(self, c.addr)
        except net.WireError as e:
            self.lost(c, e, remember=False)
            return
        with c.send_lock:
            broken = c.error is not None  # lost (let go, stopped) while connecting: nothing to read here
            if not broken:
                c.sock = sock
        if broken:
            sock.close()
            return
        self.sel.register(sock, selectors.EVENT_READ, c)
        self._start_idle_reader()
        self.wake()
        c._write_backlog()

    def pending_count(self, addr: ProcAddr) -> int:
        c = self._conns.get(addr)
        return len(c.pending) if c else 0

    def _lost_error(self, addr: ProcAddr, cause: BaseException | None) -> BaseException:
        explain = self.explain.get(addr)
        if explain is not None:
            try:
                return SupervisionError(explain())
            except Exception as e:  # the agent is gone too
                return SupervisionError(
                    f"proc {addr.identity} at {addr.host}:{addr.port} is lost and its host did not answer ({e})"
                )
        why = f": {cause}" if cause else " (connection closed)"
        return SupervisionError(f"proc {addr.identity} at {addr.host}:{addr.port} is lost{why}")

    def lost(self, conn: Conn, cause: BaseException | None, remember: bool = True) -> None:
        """A connection broke: fail what waits on it, and (unless told not to) remember why."""
        if conn.error is not None:
            return
        if conn.inbound:  # the inbox thread unregisters and closes it
            conn.error = net.PeerClosed("peer closed")
            return
        err = self.dead.get(conn.addr) or self.closing.get(conn.addr) or self._lost_error(conn.addr, cause)
        with conn.send_lock:
            if conn.error is not None:
                return
            conn.error = err
            pending, conn.pending = conn.pending, {}
            on_lost, conn.on_lost = conn.on_lost, None
        if remember:
            self.dead[conn.addr] = err
        with self._lock:
            if self._conns.get(conn.addr) is conn:
                del self._conns[conn.addr]
        if conn.sock is not None:
            _close_selected(self.sel, conn.sock)
        for fut in pending.values():
            fut.set_exception(err)
        if on_lost is not None:
            self._report_lost(conn.addr, on_lost)
        self.wake()

    def mark_dead(self, addr: ProcAddr, err: BaseException) -> None:
        self.dead.setdefault(addr, err)
        c = self._conns.get(addr)
        if c is not None:
            self.lost(c, err)

    # ------------------------------------------------------------ reading

    def dispatch(self, conn: Conn, body: Any, bufs: list[bytearray]) -> None:
        try:
            header = messages.decode(body, messages.TO_CALLER)
        except net.MalformedFrame as e:
            self.lost(conn, e)
            return
        if type(header) is messages.Answer:
            self._answer(conn, header, bufs)
        elif type(header) is messages.Fault:  # an actor we spawned failed with nobody to tell (a broadcast raised)
            self._fault(header.owner_actor, bufs)
        else:  # decode let only TO_CALLER's types through
            self.deliver_to_port(cast(messages.PortValue, header), bufs)
        if self._waiters:
            self.notify()

    def _answer(self, conn: Conn, header: messages.Answer, bufs: list[bytearray]) -> None:
        fut = conn.pending.pop(header.rid, None)
        if fut is None:
            return
        try:
            value = unpack(bufs)
        except Exception as e:
            fut.set_exception(RuntimeError(f"could not unpickle the answer from {conn.addr.identity}: {e}"))
            return
        if header.ok:
            fut.set_result(value)
        else:
            from .errors import remote_error

            fut.set_exception(remote_error(value))

    def deliver_to_port(self, header: messages.PortValue, bufs: list[bytearray]) -> None:
        """A port's value, to the receiver this process opened (dropped when it is closed)."""
        deliver = self.ports.get(header.port_id)
        if deliver is not None:
            try:
                deliver(unpack(bufs))
            except Exception as e:
                log.warning("dropped a message for port %s: %s", header.port_id, e)

    def _fault(self, owner_actor: str, bufs: list[bytearray]) -> None:
        """An actor this process spawned failed: to the spawning actor's ``__supervise__`` in a
        proc, to ``unhandled_fault_hook`` in a controller."""
        from . import session, supervision
        from .errors import MeshFailure

        try:
            failure = MeshFailure(**unpack(bufs))
        except Exception as e:
            log.warning("dropped a malformed supervision event: %s", e)
            return
        me = session.proc_hosting(owner_actor) if owner_actor else None
        if me is not None and me.on_child_lost is not None:
            me.on_child_lost(owner_actor, failure)
        else:
            supervision.dispatch(failure)

    def notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def wake(self) -> None:
        """Wakes the thread that holds the reader role (a future was completed elsewhere)."""
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass
        self.notify()

    def wait(self, done: Callable[[], bool], deadline: float | None) -> bool:
        """Blocks until ``done()``; the first waiter reads the sockets for everyone.

        Taking the reader role and going to sleep are decided under one lock, so a waiter can
        never miss the moment the role is handed back. A caller takes the role from the idle
        reader (it reads on the caller's thread: no hand-off per message while calls flow).
        """
        while not done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            with self._cond:
                if done():
                    return True
                self._last_caller = time.monotonic()
                lead = not self._reading
                if lead:
                    self._reading = True
                else:
                    if self._idle_leads and not self._want_lead:
                        self._want_lead = True
                        self.wake()
                    self._waiters += 1
                    try:
                        self._cond.wait(1.0 if left is None else min(left, 1.0))
                    finally:
                        self._waiters -= 1
            if lead:
                try:
                    self._pump(done, deadline)
                finally:
                    with self._cond:
                        self._reading = False
                        self._last_caller = time.monotonic()
                        self._loop_reads_again()
                        if self._waiters:  # (not the idle reader: its own timeout tells it when to read)
                            self._cond.notify_all()
        return True

    def read_on_loop(self, loop: Any) -> None:
        """Makes ``loop`` (an actor proc's, called on its thread) the reader whenever no thread
        is: it reads what is there, dispatches, and lets go at once. A thread that waits on a
        future still takes the role and reads for itself; the loop resumes when it lets go."""
        self._loop = loop
        self._loop_watching = True
        loop.add_reader(self.sel.fileno(), self._read_on_loop)

    def read_by_a_loop(self) -> bool:
        """Whether a proc's loop reads this hub's connections whenever no thread does: then an
        ``await`` on any loop of the proc (its own, an actor's) is woken by a callback, no thread."""
        return self._loop is not None

    def _read_on_loop(self) -> None:
        with self._cond:
            if self._reading:  # a thread reads: the loop stands aside until it lets go (no spinning)
                assert self._loop is not None  # read_on_loop set it before watching
                self._loop.remove_reader(self.sel.fileno())
                self._loop_watching = False
                return
            self._reading = True
        try:
            self._read_ready()
        finally:
            with self._cond:
                self._reading = False
                self._cond.notify_all()

    def _loop_reads_again(self) -> None:
        """Under ``_cond``, as a thread lets the role go: the loop watches again if it stood aside."""
        if self._loop is None or self._loop_watching:
            return
        self._loop_watching = True
        loop = self._loop  # set once (read_on_loop), never cleared

        def watch() -> None:
            loop.add_reader(self.sel.fileno(), self._read_on_loop)

        try:
            loop.call_soon_threadsafe(watch)
        except RuntimeError:  # the loop is closed: the proc is ending
            pass

    def _read_ready(self) -> None:
        """One pass over what is readable now, never waiting (the loop's turn as reader)."""
        for key, _ in self.sel.select(0):
            if key.data is None:
                self._drain_wake()
                continue
            try:
                key.data.on_readable()
            except Exception:  # noqa: BLE001 - one connection's failure must not stop the loop's reading
                log.exception("reading a proc connection on the event loop failed")

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _start_idle_reader(self) -> None:
        with self._lock:
            if self._idle_reader or self._loop is not None:  # a proc's loop is its idle reader
                return
            self._idle_reader = True
        threading.Thread(target=self._read_when_idle, name="monarch-torchx-idle-reader", daemon=True).start()

    def _read_when_idle(self) -> None:
        """Holds the reader role while no caller has wanted it for IDLE_READ_S."""
        while True:
            with self._cond:
                while True:
                    quiet = time.monotonic() - self._last_caller
                    if not self._reading and quiet >= IDLE_READ_S:
                        break
                    self._cond.wait(max(IDLE_READ_S - quiet, 0.01) if not self._reading else IDLE_READ_S)
                self._reading = self._idle_leads = True
            try:
                self._pump(lambda: self._want_lead, None, idle=True)
            except Exception:
                log.exception("the idle reader failed; callers still read for themselves")
            finally:
                with self._cond:
                    self._reading = self._idle_leads = self._want_lead = False
                    self._cond.notify_all()

    def _pump(self, done: Callable[[], bool], deadline: float | None, idle: bool = False) -> None:
        while not done():
            left = 1.0 if deadline is None else min(deadline - time.monotonic(), 1.0)
            if left <= 0:
                return
            for key, _ in self.sel.select(left):
                if key.data is None:
                    self._drain_wake()
                elif idle:
                    try:
                        key.data.on_readable()
                    except BaseException as e:  # noqa: BLE001 - the fault hook raised: nobody's get() to raise it from
                        from . import supervision

                        supervision.unhandled_off_caller(e)
                else:
                    key.data.on_readable()

    # ------------------------------------------------------------ ports (a controller's inbox)

    def local_address(self, toward: str | None = None) -> str:
        """The local address procs can reach us on: the one our connections to them leave from,
        or (none yet) the one the route to host ``toward`` leaves from (no packet is sent)."""
        for conn in list(self._conns.values()):
            if conn.sock is not None:
                try:
                    return conn.sock.getsockname()[0]
                except OSError:
                    continue
        if toward:
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                    probe.connect((toward, 9))  # a UDP connect only picks the route
                    return probe.getsockname()[0]
            except OSError:
                pass
        return "127.0.0.1"

    def listen(self, host: str) -> ProcAddr:
        """Lets procs send to ports of this process (authenticated like everything else).

        Served by a thread of its own, so a controller that is busy computing still takes
        port messages (and nobody who sends to it blocks on it).
        """
        with self._lock:
            if self.listen_addr is None:
                identity = f"{self.pool}/client/{self.sender}"
                inbox = Inbox(self, host, identity)
                self.listen_addr = ProcAddr(host, inbox.port, identity)
            return self.listen_addr

    # ------------------------------------------------------------ ownership

    def watch(self, addr: ProcAddr, on_lost: Callable[[ProcAddr], None]) -> None:
        """Becomes ``addr``'s owner over the connection calls use (one handshake per proc): the
        proc stops when that connection goes; ``on_lost`` runs if it breaks while owned."""
        c = self.conn(addr)
        c.send(encode(messages.Own()))
        with c.send_lock:
            broken = c.error is not None
            if not broken:
                c.on_lost = on_lost
        if broken:  # it broke between the send and now: lost() found nobody to tell
            self._report_lost(addr, on_lost)

    def ending_all(self) -> None:
        """Every proc this process owns in this pool is let go on purpose (the pool is stopping,
        or shutdown_context()): their connections close, so they stop as if it had exited."""
        gone = {
            addr: self.closing.setdefault(addr, ProcStopped(f"proc {addr.identity} ended: its pool was stopped"))
            for addr in list(self.explain)
        }  # (kept here: a stop() finishing meanwhile drops its closing entry)
        self.unwatch_all(list(gone))
        for addr, err in gone.items():
            self.mark_dead(addr, err)

    def unwatch_all(self, addrs: list[ProcAddr]) -> None:
        """These procs are being stopped on purpose: their connections' end is not a failure."""
        for a in addrs:
            c = self._conns.get(a)
            if c is not None:
                with c.send_lock:
                    c.on_lost = None

    def _report_lost(self, addr: ProcAddr, on_lost: Callable[[ProcAddr], None]) -> None:
        """Runs ``on_lost`` on one supervision thread, in the order the losses were seen: it asks
        the proc's agent why and may run user hooks, so never on the thread that reads."""
        with self._lock:
            if self._losses is None:
                self._losses = queue.SimpleQueue()
                threading.Thread(
                    target=_report_losses, args=(self._losses,), name="monarch-torchx-supervision", daemon=True
                ).start()
            self._losses.put((addr, on_lost))


def _report_losses(losses: queue.SimpleQueue[tuple[ProcAddr, Callable[[ProcAddr], None]]]) -> None:
    while True:
        addr, on_lost = losses.get()
        try:
            on_lost(addr)
        except Exception:
            log.exception("supervision handler failed")


class LocalConn:
    """How a proc reaches actors of its own process: through its event loop, never a socket.

    The messages are still pickled and unpickled (actors share nothing), and the answer comes
    back the same way. From the loop's own thread only ``await`` can wait for it.
    """

    def __init__(
        self,
        hub: Hub,
        addr: ProcAddr,
        deliver: Callable[[Any, Any, list[bytearray]], None],
        loop: Any,
        loop_thread: int,
    ):
        self.hub = hub
        self.addr = addr
        self._deliver = deliver
        self._loop = loop
        self._loop_thread = loop_thread
        self.pending: dict[int, Future[Any]] = {}
        self.error: BaseException | None = None

    def on_loop_thread(self) -> bool:
        return threading.get_ident() == self._loop_thread

    def close(self, err: BaseException) -> None:
        """The proc stopped (the controller's own, which outlives it): what waits fails with ``err``."""
        self.error = err
        pending, self.pending = self.pending, {}
        for fut in pending.values():
            fut.set_exception(err)
        self.hub.wake()

    def write(self, parts: list[Any]) -> None:
        """One frame, no reply awaited (``net.FrameSink``)."""
        self.send(parts)

    def send(self, parts: list[Any], rid: int = 0, fut: Future[Any] | None = None) -> None:
        if self.error is not None:
            if fut is None:
                raise self.error
            fut.set_exception(self.error)
            return
        body = bytes(memoryview(parts[1]).cast("B"))
        bufs = [bytearray(memoryview(p).cast("B")) for p in parts[2:]]
        if fut is not None:
            fut.loop_thread = self._loop_thread  # only this proc's loop can answer it
            self.pending[rid] = fut
        if self.on_loop_thread():
            self._deliver(self, body, bufs)
        else:
            self._loop.call_soon_threadsafe(self._deliver, self, body, bufs)

    def reply(self, rid: int, ok: bool, value: Any) -> None:
        fut = self.pending.pop(rid, None)
        if fut is None:
            return
        try:
            body, bufs = pickling.dumps(value)
            value = pickling.loads(body, [bytearray(b.raw()) for b in bufs])
        except Exception as e:
            from .errors import error_payload

            ok, value = False, error_payload("actor", f"could not send the answer back: {type(e).__name__}: {e}")
        if ok:
            fut.set_result(value)
        else:
            from .errors import remote_error

            fut.set_exception(remote_error(value))
        self.hub.wake()


class Inbox:
    """A controller's authenticated listener for port messages, served by its own thread
    (connections are accepted by a ``net.ThreadedAcceptor``, then read here)."""

    def __init__(self, hub: Hub, host: str, identity: str):
        self.hub = hub
        self.sel = selectors.DefaultSelector()  # only the inbox thread touches it
        self._new: queue.SimpleQueue[tuple[socket.socket, Any]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        self.sel.register(self._wake_r, selectors.EVENT_READ, None)
        self.acceptor = net.ThreadedAcceptor(host, hub.creds, identity.encode(), self._add, name="inbox", backlog=64)
        self.port = self.acceptor.port
        threading.Thread(target=self._run, name="monarch-torchx-inbox", daemon=True).start()

    def _add(self, sock: socket.socket, peer: Any) -> None:
        """On an acceptor thread: hands the authenticated socket to the inbox thread."""
        self._new.put((sock, peer))
        os.write(self._wake_w, b"x")

    def _run(self) -> None:
        while True:
            for key, _ in self.sel.select():
                if key.data is None:
                    os.read(self._wake_r, 4096)
                    self._register_new()
                    continue
                self._read(key.data)

    def _register_new(self) -> None:
        while True:
            try:
                sock, peer = self._new.get_nowait()
            except queue.Empty:
                return
            sock.setblocking(False)
            conn = Conn(self.hub, ProcAddr(str(peer[0]), int(peer[1]), "inbound"), sock)
            conn.inbound = True
            self.sel.register(sock, selectors.EVENT_READ, conn)
            if net.more_buffered(sock):  # a TLS record may already wait inside the socket
                self._read(conn)

    def _read(self, conn: Conn) -> None:
        if conn.error is None:
            conn.on_readable()
        if conn.error is not None:
            assert conn.sock is not None  # an inbound connection has its socket from the start
            _close_selected(self.sel, conn.sock)
            self.acceptor.forget(conn.sock)
