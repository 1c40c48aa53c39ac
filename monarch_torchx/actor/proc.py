"""An actor proc: ``python -m monarch_torchx.actor``, started by a host agent's fork server.

It listens on its own authenticated port (callers reach it directly; the agent only brokers
the spawn), hosts any number of actors, runs each actor's messages one at a time in arrival
order, forwards multicasts down its subtree, and stops when its owner goes away.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import json
import logging
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import traceback
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .. import net
from ..credentials import PoolCredentials
from ..net.aio import AuthenticatedConnection, serve, write_frame
from . import messages, placement, session
from .actor import ActorInstance, Context, CreatorInstance, Endpoint, current_context, endpoints_of
from .errors import ActorFailure, FailureKind, MeshFailure, ProcStopped, error_payload, point_text
from .future import Future, _waiters
from .host import BELL_ENV, ring
from .hub import LocalConn, ProcAddr, encode, unpack
from .shape import Extent, Point

log = logging.getLogger("monarch_torchx.actor")

OWNER_WAIT_S = float(os.environ.get("MONARCH_TORCHX_OWNER_WAIT_S", "60"))
GAP_S = 5.0  # an out-of-order message waits this long for the ones before it (a dead forwarder)
SPAWN_WAIT_S = 30.0  # a call that arrives before its actor's spawn waits this long for it
CONSTRUCTOR_WAIT_AT_STOP_S = 5.0  # a stopping proc waits this long for constructors still running
DIRECT_WRITE_MAX = 64 << 10  # an actor's thread writes answers smaller than this to the socket itself
MAX_ENDED = 10000  # why actors are not here (failed constructors, stopped), remembered for their callers
Reply = Callable[[bool, Any], None]


class _ActorRunner:
    """What runs an actor's code off the proc's loop (``ActorThread``, ``ActorLoop``): ``run_then``
    hands it a job; ``run`` is the same as an asyncio future of the proc's loop."""

    _proc_loop: asyncio.AbstractEventLoop

    def run(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """``fn(*args)`` there, as an asyncio future of the proc's loop (called on that loop)."""
        done = self._proc_loop.create_future()
        self.run_then(fn, args, lambda ok, value: _settle(done, ok, value))
        return done

    def run_then(
        self, fn: Callable[..., Any], args: tuple, then: Callable[[bool, Any], None], on_loop: bool = True
    ) -> None:
        raise NotImplementedError

    def _job(self, fn: Callable[..., Any], args: tuple, then: Callable[[bool, Any], None], on_loop: bool) -> bool:
        """Runs one job on the runner's thread; False once the proc's loop has closed (it is ending)."""
        try:
            ok, value = True, fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the proc's loop, which decides
            ok, value = False, e
        try:
            if on_loop:
                self._proc_loop.call_soon_threadsafe(then, ok, value)
            else:
                then(ok, value)
        except Exception:  # noqa: BLE001 - never the runner's end while the proc goes on: calls wait on it
            if self._proc_loop.is_closed():
                return False
            log.exception("answering a call of this actor failed")
        return True


class ActorThread(_ActorRunner):
    """Runs one actor's synchronous code (its sync endpoints, a sync ``__cleanup__``), one call at
    a time, off the proc's event loop, as Monarch runs sync endpoints: they may block (``.get()``
    on any future, a call to an actor of this same proc, a long computation) while the loop goes
    on answering handshakes, other actors and this actor's own replies. A daemon thread: a hung
    endpoint never holds the proc's exit."""

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop):
        self._proc_loop = loop
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=f"actor-{name}", daemon=True).start()

    def run_then(
        self, fn: Callable[..., Any], args: tuple, then: Callable[[bool, Any], None], on_loop: bool = True
    ) -> None:
        """``fn(*args)`` here, then ``then(ok, result or exception)`` on the loop: one loop wake-up
        and no asyncio future. ``on_loop=False``: ``then`` runs here, right after, and wakes the
        loop only for what needs it (the path of every sync endpoint call)."""
        self._jobs.put((fn, args, then, on_loop))

    def close(self) -> None:
        self._jobs.put(None)

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None or not self._job(*job):
                return


class ActorLoop(_ActorRunner):
    """Runs an actor that has ``async`` endpoints on an asyncio loop of its own, on a thread of its
    own, as Monarch does: its constructor, its endpoints (the sync ones of a class that mixes them,
    inline) and the tasks they start share that thread. A constructor or endpoint that blocks then
    holds only this actor, never the proc's loop and the other actors; ``__init__`` may use the
    running loop; and thread-local state set in ``__init__`` (``torch.cuda.set_device``) is its
    endpoints'. Same interface as ``ActorThread``; ``run``/``run_then`` jobs run as loop callbacks."""

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop):
        self._proc_loop = loop
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=f"actor-{name}", daemon=True)
        self._thread.start()

    def run_then(
        self, fn: Callable[..., Any], args: tuple, then: Callable[[bool, Any], None], on_loop: bool = True
    ) -> None:
        """As ``ActorThread.run_then``: ``then`` on the proc's loop, or (``on_loop=False``) here."""
        try:
            self.loop.call_soon_threadsafe(self._job, fn, args, then, on_loop)
        except RuntimeError:  # closed: the actor stopped, and nothing is let in after that
            log.warning("a job for a stopped actor was dropped")

    def start(self, coro: Any) -> None:
        """Runs a coroutine here, as a task of this loop (from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self._task, coro)
        except RuntimeError:
            coro.close()

    def _task(self, coro: Any) -> None:
        self.loop.create_task(coro).add_done_callback(_log_failure)

    def close(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:  # closed already
            pass

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:  # what its endpoints left running ends with it (cancelled, a bounded while)
            left = asyncio.all_tasks(self.loop)
            for task in left:
                task.cancel()
            if left:
                self.loop.run_until_complete(asyncio.wait(left, timeout=1.0))
            self.loop.close()


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("an actor's task failed", exc_info=task.exception())


def _settle(done: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if done.cancelled():
        return
    if ok:
        done.set_result(value)
    else:
        done.set_exception(value)


@dataclass
class ActorSlot:
    actor_id: str
    name: str
    cls_name: str
    instance: Any
    ctx: Context
    endpoints: dict[str, Endpoint]
    queue: collections.deque[tuple[Endpoint, tuple, dict, Reply, Context]] = field(default_factory=collections.deque)
    # busy: a call of it runs or waits. busy, on_thread and appends to queue change under lock;
    # _drain pops the queue without it, as it never runs while on_thread > 0
    busy: bool = False
    on_thread: int = 0  # sync calls handed straight to its thread, not yet done
    lock: threading.Lock = field(default_factory=threading.Lock)
    failed: str | None = None
    failed_kind: str = "supervision"  # the error kind later calls get: "aborted" after abort()
    owner: tuple[Any, str] | None = None  # (connection of the process that spawned it, its actor id or "")
    tasks: set = field(default_factory=set)  # its concurrent endpoints in flight (cancelled when it stops)
    qualname: str = ""  # module.Class, as a supervision report names the actor
    thread: ActorThread | ActorLoop | None = None  # runs its code, off the proc's loop (made at spawn)

    def own_loop(self) -> ActorLoop | None:
        """Its own loop, for an actor with async endpoints (where they, and its calls' queue, run)."""
        return self.thread if isinstance(self.thread, ActorLoop) else None

    def refusal(self) -> ActorFailure:
        """What a call to this failed actor is answered with."""
        return error_payload(self.failed_kind, self.failed or "the actor has failed")


class ResponsePort:
    """The port an ``explicit_response_port`` endpoint answers through: the first ``send`` or
    ``exception`` answers the call; what the method returns is ignored (an exception it raises
    still answers the call, if nothing did before)."""

    def __init__(self, reply: Reply, error: Callable[[BaseException], Any], escaped: Callable[[Any], Any]):
        self._reply, self._error, self._escaped = reply, error, escaped
        self.answered = False

    def send(self, value: Any) -> None:
        self._answer(True, value)

    def exception(self, exc: BaseException) -> None:
        self._answer(False, self._error(exc))

    def _answer(self, ok: bool, value: Any) -> None:
        if self.answered:
            raise RuntimeError("this call was answered already (a response port takes one answer)")
        self.answered = True
        self._reply(ok, value)

    def returned(self, ok: bool, value: Any) -> None:
        """The method ended. One that raised instead of answering has failed its actor, as in
        Monarch (the caller gets SupervisionError); one that answered first keeps it."""
        if not ok and not self.answered:
            self._answer(False, self._escaped(value))

    def __reduce__(self) -> Any:
        raise TypeError("a response port answers its call from the actor that got it: it cannot be sent on")


def _takes_an_argument(fn: Callable[..., Any]) -> bool:
    import inspect

    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0].kind in (
        params[0].POSITIONAL_ONLY,
        params[0].POSITIONAL_OR_KEYWORD,
        params[0].VAR_POSITIONAL,
    )


class CallerReply:
    """The reply of a call: an Answer to the connection it came on (for a multicast's leaf,
    ``rank``: its subtree's answer list, of one). Written from an actor's thread as well as from
    the loop (``ProcConnection.write``)."""

    def __init__(self, conn: ProcConnection, rid: int, rank: int | None = None):
        self.conn, self.rid, self.rank = conn, rid, rank

    def __call__(self, ok: bool, value: Any) -> None:
        if self.rank is None:
            self.conn.reply(self.rid, ok, value)
        else:
            self.conn.reply(self.rid, True, [(self.rank, ok, value)])


class BroadcastReport:
    """The reply of a call nobody waits for (a broadcast). A failure fails the actor, as in
    Monarch; a success needs nothing done, so an actor's thread does not wake the loop for it.
    Called on the loop or on the actor's thread (as ``_fatal`` is)."""

    def __init__(self, server: ProcServer, actor_id: str, endpoint: str):
        self.server, self.actor_id, self.endpoint = server, actor_id, endpoint

    def __call__(self, ok: bool, value: Any) -> None:
        if not ok:
            print(
                f"broadcast to {self.actor_id}.{self.endpoint} failed: {value.message}\n{value.traceback}",
                file=sys.stderr,
            )
            if value.kind == FailureKind.ACTOR:
                self.server._actor_failed(self.actor_id, value.message)


class ProcConnection(AuthenticatedConnection):
    """One authenticated peer of this proc (a controller, another actor, a forwarding proc)."""

    def __init__(self, server: ProcServer):
        super().__init__(server.gate, server.creds, server.identity.encode())
        self.server = server
        server.conns.add(self)
        # an actor's thread writes its answers itself (see write); these keep frames whole and in order
        self._write_lock = threading.Lock()
        self._queued: list[list[Any]] = []  # frames a thread left for the loop to write, in order
        self._fd = -1  # the plain TCP socket's descriptor (-1: TLS, or not connected)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        sock = transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None and self.tls is None else -1
        super().connection_made(transport)

    def on_frame(self, body: Any, bufs: list[Any]) -> None:
        self.server.on_frame(self, body, bufs)

    def connection_lost(self, exc: Exception | None) -> None:
        with self._write_lock:  # asyncio closes the socket right after: its number may be reused
            self._fd = -1
            self._queued.clear()
        self.server.conns.discard(self)
        super().connection_lost(exc)

    def on_lost(self) -> None:
        if self.server.owner is self:
            self.server.begin_stop("its owner disconnected")

    def write(self, parts: list[Any]) -> None:
        """Writes one frame. From an actor's thread (a sync endpoint's answer), a small frame
        goes straight to the socket when nothing waits ahead of it, so the loop is not woken
        for it; anything else waits for the loop, behind what came before."""
        if threading.get_ident() != self.server.loop_thread:
            self._write_off_loop(parts)
            return
        with self._write_lock:
            self._write_queued()
            if self.transport is not None and not self.transport.is_closing():
                write_frame(self.transport, parts)

    def _write_off_loop(self, parts: list[Any]) -> None:
        with self._write_lock:
            t = self.transport
            if t is None or t.is_closing():
                return
            if (
                not self._queued
                and self._fd >= 0
                and t.get_write_buffer_size() == 0
                and sum(memoryview(p).nbytes for p in parts) < DIRECT_WRITE_MAX
            ):
                data = b"".join(parts)
                try:
                    sent = os.write(self._fd, data)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError:  # the connection broke: the loop sees it end
                    return
                if sent == len(data):
                    return
                parts = [memoryview(data)[sent:]]
            self._queued.append(parts)
            first = len(self._queued) == 1
        if first:
            try:
                self.server.loop.call_soon_threadsafe(self._write_later)  # type: ignore[union-attr]
            except RuntimeError:  # the loop is closed: the proc is ending
                pass

    def _write_later(self) -> None:
        with self._write_lock:
            self._write_queued()

    def _write_queued(self) -> None:
        """(Under the write lock, on the loop.)"""
        queued, self._queued = self._queued, []
        if self.transport is not None and not self.transport.is_closing():
            for parts in queued:
                write_frame(self.transport, parts)

    def reply(self, rid: int, ok: bool, value: Any) -> None:
        try:
            parts = encode(messages.Answer(rid, ok), value)
        except Exception as e:
            parts = encode(
                messages.Answer(rid, False),
                error_payload(
                    "actor", f"could not send the answer back: {type(e).__name__}: {e}", "", type(e).__name__
                ),
            )
        self.write(parts)


@dataclass
class ProcSettings:
    """Who a proc is and where it listens: from its environment (a proc its agent started), or
    given (the controller's own proc, in the controller's process)."""

    pool: str
    creds: PoolCredentials
    mesh_id: str
    rank: int
    host_index: int = 0
    bind: str = "127.0.0.1"
    advertise: str = ""
    addr_file: str = ""  # where it says it listens, for its agent (none for the controller's)
    paths: tuple[str, ...] = ()  # the controller's script dir and cwd, put on sys.path
    in_client: bool = False

    @staticmethod
    def from_env(env: dict[str, str]) -> ProcSettings:
        bind = env.get("MONARCH_TORCHX_PROC_BIND", "127.0.0.1")
        return ProcSettings(
            env["MONARCH_TORCHX_POOL"],
            PoolCredentials.load(Path(env["MONARCH_TORCHX_STATE_DIR"])),
            env["MONARCH_TORCHX_MESH_ID"],
            int(env["MONARCH_TORCHX_PROC_RANK"]),
            int(env.get("MONARCH_TORCHX_HOST_INDEX", "0")),
            bind,
            env.get("MONARCH_TORCHX_PROC_ADVERTISE", bind),
            env["MONARCH_TORCHX_PROC_ADDR_FILE"],
            tuple(p for p in env.get("MONARCH_TORCHX_PROC_PATH", "").split(os.pathsep) if p),
        )


class ProcServer:
    def __init__(self, settings: ProcSettings):
        self.settings = settings
        self.pool = settings.pool
        self.creds = settings.creds
        self.host_index = settings.host_index
        self.mesh_id = settings.mesh_id
        self.rank = settings.rank
        self.identity = f"{self.pool}/proc/{self.mesh_id}/{self.rank}"
        self.actors: dict[str, ActorSlot] = {}
        self.expected: dict[str, int] = {}
        self.held: dict[str, dict[int, Callable[[], None]]] = {}
        # spawn returns at once (Monarch's semantics), so a call can reach this proc before the
        # spawn it relies on, from another sender: it waits here for the actor, a bounded while
        self.awaiting: dict[str, list[Callable[[], None]]] = {}
        self.ended: dict[str, str] = {}  # actor id -> why it is not here (failed __init__, stopped)
        self.constructing: set = set()  # actor ids whose constructor is running (their calls wait)
        self.stopping: set = set()  # actor ids a stop arrived for: calls sent after it are refused
        self.booting: list[Callable[[], None]] | None = None  # spawns held while a bootstrap runs
        self.owner: ProcConnection | None = None
        self.gate = net.HandshakeGate()
        self.stop_reason = ""
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread: int | None = None
        self.stopped: asyncio.Event | None = None
        self.me: session.ProcIdentity | None = None
        self.mesh_refs: dict[tuple[str, int], Any] = {}  # (mesh id, procs): its ProcRefs (packed until asked for)
        self.conns: set = set()  # accepted connections (closed when the controller's own proc stops)
        self._handlers: dict[type, Callable[[ProcConnection, Any, list[bytearray]], None]] = {
            messages.Call: self._on_call,
            messages.Cast: self.cast,
            messages.Spawn: self._on_spawn,
            messages.CallPort: self._on_call_port,
            messages.StopActor: self._on_stop_actor,
            messages.Own: self._on_own,
            messages.Stop: self._on_stop,
            messages.PortValue: self._on_port_value,
        }
        for p in reversed(settings.paths):
            if os.path.isdir(p) and p not in sys.path:
                sys.path.insert(0, p)  # the controller's script dir and cwd, where they exist here
        cwd = os.environ.get("MONARCH_TORCHX_PROC_CWD", "")
        if cwd and os.path.isdir(cwd):  # started in its agent's directory; works in the controller's
            os.chdir(cwd)

    # ------------------------------------------------------------ lifecycle

    async def run(self, on_ready: Callable[[ProcAddr], None] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.loop_thread = threading.get_ident()
        self.stopped = asyncio.Event()
        cfg = self.settings
        server = await serve(lambda: ProcConnection(self), cfg.bind, 0)
        port = server.sockets[0].getsockname()[1]
        addr = ProcAddr(cfg.advertise or cfg.bind, port, self.identity)
        self.me = session.ProcIdentity(
            self.pool,
            self.creds,
            self.host_index,
            self.mesh_id,
            self.rank,
            addr,
            on_child_lost=self.child_lost,
            loop_thread=self.loop_thread,
            on_abort=self.abort_actor,
            in_client=cfg.in_client,
            hosts=lambda actor_id: actor_id in self.actors,
        )
        if not cfg.in_client:
            session.set_proc(self.me)  # before its hub: a proc's hub takes this proc's credentials
        hub = session.hub_for(self.pool, self.creds)
        if not cfg.in_client:  # (the controller's process reads its connections as a controller does)
            hub.read_on_loop(self.loop)
        local = hub.locals[addr] = LocalConn(hub, addr, self.on_frame, self.loop, self.loop_thread)
        if cfg.in_client:  # the controller's process is not this proc's: no signals, no owner to wait for
            if on_ready is not None:
                on_ready(addr)
        else:
            hub.listen_addr = addr  # ports of this proc are served by its own server
            tmp = cfg.addr_file + ".tmp"
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                json.dump({"host": addr.host, "port": port, "pid": os.getpid()}, f)
            os.replace(tmp, cfg.addr_file)
            bell = os.environ.get(BELL_ENV)
            if bell:
                ring(bell, self.mesh_id, self.rank)
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.loop.add_signal_handler(sig, self.begin_stop, f"got {signal.Signals(sig).name}")
            self.loop.call_later(OWNER_WAIT_S, self._check_owner)
        try:
            await self.stopped.wait()
        finally:
            hub.locals.pop(addr, None)
            server.close()
            if cfg.in_client:  # the process goes on: what was in flight to this proc fails now, not never
                gone = ProcStopped(f"the controller's own proc ({self.mesh_id}) was stopped: {self.stop_reason}")
                local.close(gone)
                hub.mark_dead(addr, gone)
                for conn in list(self.conns):
                    if conn.transport is not None:
                        conn.transport.close()

    def _check_owner(self) -> None:
        if self.owner is None and not self.stop_reason:
            self.begin_stop(f"no owner connected within {OWNER_WAIT_S:.0f} s")

    def begin_stop(self, reason: str, then: Callable[[], None] | None = None) -> None:
        if self.stop_reason:
            return
        self.stop_reason = reason
        assert self.loop is not None
        self.loop.create_task(self._shutdown(then))

    async def _shutdown(self, then: Callable[[], None] | None) -> None:
        assert self.loop is not None
        deadline = self.loop.time() + CONSTRUCTOR_WAIT_AT_STOP_S
        while self.constructing and self.loop.time() < deadline:  # their __cleanup__ runs too
            await asyncio.sleep(0.005)
        for slot in list(self.actors.values()):
            await self._cleanup(slot)
        if then is not None:
            then()
        assert self.stopped is not None
        self.stopped.set()

    async def _cleanup(self, slot: ActorSlot) -> None:
        own = slot.own_loop()
        try:
            if own is not None and not slot.tasks and getattr(slot.instance, "__cleanup__", None) is None:
                pass  # nothing to run there: an endpoint still running never holds the stop
            elif own is None:
                await self._clean_up(slot)
            else:  # where its endpoints ran: its concurrent ones are tasks of that loop
                await asyncio.wait_for(
                    asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._clean_up(slot), own.loop)), 35
                )
        except (asyncio.TimeoutError, RuntimeError) as e:  # its loop is held, or closed
            print(f"{slot.name}.__cleanup__ did not run to its end: {type(e).__name__} {e}", file=sys.stderr)
        finally:
            if slot.thread is not None:
                # (a proc stopping keeps its slots while the others clean up: their calls are refused)
                slot.failed = slot.failed or f"actor {slot.name} on proc {self.rank} was stopped"
                slot.thread.close()

    async def _clean_up(self, slot: ActorSlot) -> None:
        """On the loop that ran the actor's async endpoints."""
        for task in list(slot.tasks):  # concurrent endpoints still running end first, as in Monarch
            task.cancel()
        if slot.tasks:
            await asyncio.gather(*slot.tasks, return_exceptions=True)
        cleanup = getattr(slot.instance, "__cleanup__", None)
        if cleanup is None:
            return
        # Monarch's signature is __cleanup__(self, exc): the exception that stopped the actor
        # (None here: a stop or the owner's end is not an actor's failure); ours took none
        args = (None,) if _takes_an_argument(cleanup) else ()
        try:
            if asyncio.iscoroutinefunction(cleanup):
                token = current_context.set(slot.ctx)
                try:
                    await asyncio.wait_for(cleanup(*args), 30)
                finally:
                    current_context.reset(token)
            else:
                if slot.own_loop() is not None:  # here, as its sync endpoints
                    res = self._in_context(slot, cleanup, args)
                else:  # on the actor's thread, as its sync endpoints: it may block on calls
                    res = await asyncio.wait_for(
                        self._actor_thread(slot).run(self._in_context, slot, cleanup, args), 30
                    )
                if asyncio.iscoroutine(res):
                    await asyncio.wait_for(res, 30)
        except Exception:
            print(f"{slot.name}.__cleanup__ failed:\n{traceback.format_exc()}", file=sys.stderr)

    def _begin_actor_stop(self, reply: Reply, actor_id: str) -> None:
        assert self.loop is not None
        if actor_id in self.constructing:
            held = self.awaiting.pop(actor_id, [])  # calls sent before the stop: they run first
            self.stopping.add(actor_id)
            self.loop.create_task(self._stop_constructing(reply, actor_id, held))
            return
        if actor_id not in self.actors and actor_id not in self.ended:  # its spawn is not here yet
            self._await_actor(actor_id, lambda: self._begin_actor_stop(reply, actor_id))
            return
        assert self.loop is not None
        if actor_id in self.actors:
            self.stopping.add(actor_id)
        self.loop.create_task(self._stop_actor(reply, actor_id))

    async def _stop_constructing(self, reply: Reply, actor_id: str, held: list[Callable[[], None]]) -> None:
        """A stop that arrives while the constructor runs waits for it a bounded while, so a
        constructed actor is stopped as any other (its ``__cleanup__`` runs); one whose constructor
        has not returned by then is gone now, and dropped if it ever returns."""
        assert self.loop is not None
        deadline = self.loop.time() + CONSTRUCTOR_WAIT_AT_STOP_S
        while actor_id in self.constructing and self.loop.time() < deadline:
            await asyncio.sleep(0.005)
        if actor_id in self.constructing:
            self.constructing.discard(actor_id)
            self.stopping.discard(actor_id)
            self._ended(actor_id, f"actor {actor_id} on proc {self.rank} was stopped (during its constructor)")
            for retry in held:  # answered as for a stopped actor
                retry()
            reply(True, None)
            return
        self.stopping.discard(actor_id)  # (on this loop, at once: the calls from before the stop get in)
        for retry in held:
            retry()
        self.stopping.add(actor_id)
        await self._stop_actor(reply, actor_id)

    async def _stop_actor(self, reply: Reply, actor_id: str) -> None:
        """ActorMesh.stop(): the calls already queued run, then __cleanup__; the actor is gone
        (later calls are refused) and the proc, with its other actors, goes on."""
        slot = self.actors.get(actor_id)
        if slot is not None:
            while slot.busy or slot.queue:
                await asyncio.sleep(0.005)
            self.actors.pop(actor_id, None)
            self._ended(actor_id, f"actor {slot.name} ({actor_id}) on proc {self.rank} was stopped")
            self.stopping.discard(actor_id)
            await self._cleanup(slot)
            await self._stop_owned(actor_id)
        self.stopping.discard(actor_id)
        reply(True, None)

    async def _stop_owned(self, actor_id: str) -> None:
        """As in Monarch, stopping an actor stops what it spawned: its actor meshes (wherever
        they run), then its proc meshes."""
        owned = self.me.owned.pop(actor_id, []) if self.me is not None else []
        if not owned:
            return
        from .mesh import ProcMesh

        def stop_all() -> None:
            for m in sorted(owned, key=lambda m: isinstance(m, ProcMesh)):  # actors first
                try:
                    m.stop().get(timeout=30)
                except Exception as e:  # already gone: nothing more to stop
                    log.info("stopping what actor %s owned: %s", actor_id, e)

        assert self.loop is not None
        await self.loop.run_in_executor(_waiters(), stop_all)

    # ------------------------------------------------------------ messages

    def on_frame(self, conn: ProcConnection, body: Any, bufs: list[bytearray]) -> None:
        header = messages.decode(body, messages.TO_PROC)
        self._handlers[type(header)](conn, header, bufs)

    def _on_call(self, conn: ProcConnection, m: messages.Call, bufs: list[bytearray]) -> None:
        self.ordered(
            m.sender,
            m.seq,
            lambda: self.call(
                self._replier(conn, m.rid, m.actor_id, m.endpoint), m.actor_id, m.endpoint, bufs, m.point
            ),
        )

    def _on_spawn(self, conn: ProcConnection, m: messages.Spawn, bufs: list[bytearray]) -> None:
        if m.links:  # this proc's part of the mesh's multicast tree: connected while the actors start
            hub = session.hub_for(self.pool)
            for link in m.links:
                try:
                    hub.conn(ProcAddr(*link))  # (on this loop: it connects from a thread, never waits)
                except Exception as e:  # a multicast that needs it says so; nothing to do here
                    log.info("could not connect to proc %s ahead of a multicast: %s", link[2], e)
        point = Point(m.coords, Extent(m.labels, m.sizes))
        self.ordered(
            m.sender,
            m.seq,
            lambda: self.spawn(conn, m.rid, m.actor_id, m.name, point, bufs, m.owner, m.creator, m.mesh),
        )

    def _on_call_port(self, conn: ProcConnection, m: messages.CallPort, bufs: list[bytearray]) -> None:
        self.ordered(m.sender, m.seq, lambda: self.call(self._port_replier(m.port), m.actor_id, m.endpoint, bufs))

    def _on_stop_actor(self, conn: ProcConnection, m: messages.StopActor, bufs: list[bytearray]) -> None:
        self.ordered(
            m.sender, m.seq, lambda: self._begin_actor_stop(self._replier(conn, m.rid, m.actor_id, "stop"), m.actor_id)
        )

    def _on_own(self, conn: ProcConnection, m: messages.Own, bufs: list[bytearray]) -> None:
        self.owner = conn

    def _on_stop(self, conn: ProcConnection, m: messages.Stop, bufs: list[bytearray]) -> None:
        self.begin_stop("stopped by its owner", lambda: conn.reply(m.rid, True, None))

    def _on_port_value(self, conn: ProcConnection, m: messages.PortValue, bufs: list[bytearray]) -> None:
        session.hub_for(self.pool).deliver_to_port(m, bufs)

    def ordered(self, sender: str | None, seq: int | None, fn: Callable[[], None]) -> None:
        """Runs each sender's messages in the order it sent them (multicasts take other paths)."""
        if sender is None or seq is None:
            fn()
            return
        exp = self.expected.get(sender, 0)
        if seq < exp:
            fn()
            return
        if seq > exp:
            self.held.setdefault(sender, {})[seq] = fn
            assert self.loop is not None
            self.loop.call_later(GAP_S, self._skip_gap, sender, exp)
            return
        fn()
        self._advance(sender, exp + 1)

    def _advance(self, sender: str, exp: int) -> None:
        held = self.held.get(sender)
        while held and exp in held:
            held.pop(exp)()
            exp += 1
        self.expected[sender] = exp
        if held is not None and not held:
            del self.held[sender]

    def _skip_gap(self, sender: str, exp: int) -> None:
        held = self.held.get(sender)
        if self.expected.get(sender, 0) == exp and held:
            log.warning(
                "messages %d..%d from %s never arrived (a forwarding proc died?); going on", exp, min(held) - 1, sender
            )
            self._advance(sender, min(held))
            if self.held.get(sender):  # a later gap gets its own grace period
                assert self.loop is not None
                self.loop.call_later(GAP_S, self._skip_gap, sender, self.expected[sender])

    def _replier(self, conn: ProcConnection | None, rid: int, actor_id: str, ep: str) -> Reply:
        if rid and isinstance(conn, ProcConnection):
            return CallerReply(conn, rid)
        if rid and conn is not None:
            return lambda ok, value: conn.reply(rid, ok, value)
        return BroadcastReport(self, actor_id, ep)

    def _escaped_port(self, slot: ActorSlot, err: Any) -> Any:
        self._actor_failed(slot.actor_id, f"{err.message} (instead of answering through its response port)")
        return error_payload("supervision", slot.failed or err.message)

    def _port_replier(self, port: Any) -> Reply:
        from .channel import _PortError

        def answer(ok: bool, value: Any) -> None:
            try:
                port.send(value if ok else _PortError(value))
            except Exception as e:  # the port's owner is gone
                log.warning("could not answer to port %s: %s", getattr(port, "port_id", port), e)

        return answer

    def abort_actor(self, actor_id: str, reason: str) -> None:
        """``context().actor_instance.abort(reason)``: the actor fails now, a supervision event
        for its owner. From any thread (the actor's own, mostly): its calls already waiting on
        that thread are refused from here on."""
        self._actor_failed(actor_id, reason, aborted=True)

    def _actor_failed(self, actor_id: str, why: str, leaf: MeshFailure | None = None, aborted: bool = False) -> None:
        """As in Monarch, an actor whose endpoint raised with no caller to tell has failed: later
        calls are refused, and its owner (the process that spawned it) gets a supervision event:
        about this actor, or (``leaf``) the unhandled event of one of its own meshes, passed up."""
        slot = self.actors.get(actor_id)
        if slot is None:
            return
        with slot.lock:  # (from the loop or the actor's thread: the owner hears of it once)
            if slot.failed:
                return
            if aborted:
                slot.failed_kind = "aborted"
            slot.failed = (
                why
                if leaf is not None or aborted
                else f"{why}: the actor has failed (an endpoint called by broadcast raised)"
            )
        if slot.owner is not None:
            self._tell_owner(
                slot.owner[0], slot.owner[1], dataclasses.asdict(leaf) if leaf else self._failure(slot, why)
            )

    def _failure(self, slot: ActorSlot, why: str) -> dict[str, Any]:
        return {
            "mesh": slot.ctx.actor_instance.mesh_id,
            "rank": slot.ctx.actor_instance.rank.rank,
            "host": self.host_index,
            "hostname": socket.gethostname(),
            "reason": why,
            "mesh_name": slot.name,
            "actor": slot.actor_id,
            "actor_class": slot.qualname,
            "point": point_text(slot.ctx.actor_instance.rank),
        }

    def _tell_owner(self, conn: Any, owner_actor: str, failure: dict[str, Any]) -> None:
        try:
            parts = encode(messages.Fault(owner_actor), failure)
            if isinstance(conn, ProcConnection):
                conn.write(parts)
            else:  # spawned from this same proc (this_proc()): no socket between them
                payload = [bytearray(memoryview(x).cast("B")) for x in parts[2:]]
                if self.settings.in_client:  # the controller's hook must not run (or raise) on this loop
                    threading.Thread(
                        target=_fault_off_loop,
                        args=(session.hub_for(self.pool), owner_actor, payload),
                        daemon=True,
                        name="monarch-torchx-fault",
                    ).start()
                else:
                    session.hub_for(self.pool)._fault(owner_actor, payload)
        except Exception as e:  # the owner is gone: nobody to tell
            log.warning("could not report the failure of %s to its owner: %s", failure.get("actor"), e)

    def call(
        self, reply: Reply, actor_id: str, ep_name: str, bufs: list[bytearray], point: messages.MessagePoint = None
    ) -> None:
        if actor_id in self.stopping:  # sent after ActorMesh.stop(): refused, as once it is stopped
            reply(False, error_payload("supervision", f"actor {actor_id} on proc {self.rank} was stopped"))
            return
        slot = self.actors.get(actor_id)
        if slot is None:
            if actor_id in self.ended:
                reply(False, error_payload("supervision", self.ended[actor_id]))
            else:
                self._await_actor(actor_id, lambda: self.call(reply, actor_id, ep_name, bufs, point))
            return
        if slot.failed:
            reply(False, slot.refusal())
            return
        ep = slot.endpoints.get(ep_name)
        if ep is None:
            reply(False, error_payload("usage", f"{slot.cls_name} has no endpoint {ep_name!r}"))
            return
        try:
            args, kwargs = unpack(bufs)
        except Exception as e:
            reply(
                False,
                error_payload(
                    "actor",
                    f"could not unpickle the arguments of {slot.cls_name}.{ep_name} "
                    f"on proc {self.rank}: {type(e).__name__}: {e}",
                    traceback.format_exc(),
                    type(e).__name__,
                ),
            )
            return
        ctx = slot.ctx
        if point is not None:  # sent to a slice of its mesh: its message_rank is its point there
            ctx = Context(slot.ctx.actor_instance, Point(point[2], Extent(point[0], point[1])))
        self.submit(slot, ep, args, kwargs, reply, ctx)

    def submit(
        self, slot: ActorSlot, ep: Endpoint, args: tuple, kwargs: dict, reply: Reply, ctx: Context | None = None
    ) -> None:
        ctx = ctx or slot.ctx
        if ep.explicit_response_port:  # a sync endpoint answers from its actor's thread
            port = ResponsePort(
                self._on_loop(reply), lambda e: self._error(slot, ep.name, e), lambda err: self._escaped_port(slot, err)
            )
            args = (port, *args)
            reply = port.returned
        if ep.concurrent:
            own = slot.own_loop()
            if own is not None:
                try:
                    own.loop.call_soon_threadsafe(self._start_concurrent, slot, ep, args, kwargs, reply, ctx)
                except RuntimeError:  # its loop closed: the actor was stopped
                    reply(False, error_payload("supervision", f"actor {slot.name} on proc {self.rank} was stopped"))
            else:
                self._start_concurrent(slot, ep, args, kwargs, reply, ctx)
            return
        with slot.lock:
            # the common case, straight to the actor's thread, which runs its calls in order: when
            # nothing runs, or only such calls do and none waits here behind them
            direct = not ep.is_async and (not slot.busy or (slot.on_thread > 0 and not slot.queue))
            if direct:
                slot.on_thread += 1
            else:
                slot.queue.append((ep, args, kwargs, reply, ctx))
            start = not slot.busy and not direct
            slot.busy = True
        if direct:
            self._actor_thread(slot).run_then(
                self._run_sync,
                (slot, ep, args, kwargs, ctx),
                functools.partial(self._sync_ran, slot, reply),
                on_loop=False,
            )
        elif start:
            self._start_drain(slot)

    def _start_concurrent(
        self, slot: ActorSlot, ep: Endpoint, args: tuple, kwargs: dict, reply: Reply, ctx: Context
    ) -> None:
        """On the loop that runs the actor's async endpoints."""
        task = asyncio.get_running_loop().create_task(self._run_concurrent(slot, ep, args, kwargs, reply, ctx))
        slot.tasks.add(task)
        task.add_done_callback(slot.tasks.discard)
        task.add_done_callback(_log_failure)

    def _start_drain(self, slot: ActorSlot) -> None:
        """From any thread: the actor's waiting calls run, in order, on its own loop if it has
        one, else on the proc's (their sync endpoints handed to its thread)."""
        own = slot.own_loop()
        assert self.loop is not None
        if own is not None:
            own.start(self._drain(slot))
        elif threading.get_ident() == self.loop_thread:
            self.loop.create_task(self._drain(slot))
        else:
            self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._drain(slot)))  # type: ignore[union-attr]

    @staticmethod
    def _answer(slot: ActorSlot, reply: Reply, res: tuple[bool, Any]) -> None:
        """Answers a call that ran; if the actor failed while it ran, Monarch's call fails too."""
        reply(*((False, slot.refusal()) if slot.failed and res[0] else res))

    def _answer_off_loop(self, slot: ActorSlot, reply: Reply, res: tuple[bool, Any]) -> None:
        """``_answer`` from wherever the actor's code ran: a caller's answer and a broadcast's
        report are written from this thread (neither wakes the proc's loop); the rest (a port's
        answer, a multicast subtree's) go through the proc's loop."""
        self._reply_here(reply, *((False, slot.refusal()) if slot.failed and res[0] else res))

    def _reply_here(self, reply: Reply, ok: bool, value: Any) -> None:
        """``reply(ok, value)`` from whatever thread ran the actor's code (see ``_answer_off_loop``)."""
        if threading.get_ident() == self.loop_thread or isinstance(reply, (CallerReply, BroadcastReport)):
            reply(ok, value)
        else:
            assert self.loop is not None
            self.loop.call_soon_threadsafe(reply, ok, value)

    def _sync_ran(self, slot: ActorSlot, reply: Reply, ok: bool, res: tuple[bool, Any]) -> None:
        """On the actor's thread, after a sync endpoint it got straight: a caller's answer is
        written from here and a broadcast's success tells nobody (neither wakes the loop); a
        port's answer goes through the loop. Then the calls that waited behind it start."""
        assert self.loop is not None
        if not ok:  # _run_sync itself raised (it answers every endpoint's error): say so, never hang
            res = (False, error_payload("actor", f"{type(res).__name__}: {res}"))
        try:
            # here, before the next call runs: an answer is written from this thread (see
            # ProcConnection.write), and a broadcast that raised fails the actor first
            self._answer_off_loop(slot, reply, res)
        finally:  # whatever the answer did, the actor's next calls are let in
            with slot.lock:
                slot.on_thread -= 1
                drain = slot.on_thread == 0 and bool(slot.queue)
                if slot.on_thread == 0 and not drain:
                    slot.busy = False
        if drain:
            self._start_drain(slot)

    async def _drain(self, slot: ActorSlot) -> None:
        """Runs the actor's waiting calls in order. On its own loop when it has one: then the
        queue is filled from the proc's loop meanwhile, so taking the next call and letting go
        of ``busy`` happen under the lock, or a call could be left waiting with nobody to run it."""
        own = slot.own_loop() is not None
        while True:
            with slot.lock:
                if not slot.queue:
                    slot.busy = False
                    return
                ep, args, kwargs, reply, ctx = slot.queue.popleft()
            try:
                if slot.failed:  # it failed while this call waited its turn
                    res: tuple[bool, Any] = (False, slot.refusal())
                elif ep.is_async:
                    res = await self._run_async(slot, ep, args, kwargs, ctx)
                elif own:
                    res = self._run_sync(slot, ep, args, kwargs, ctx)
                else:
                    res = await self._actor_thread(slot).run(self._run_sync, slot, ep, args, kwargs, ctx)
                self._answer_off_loop(slot, reply, res)
            except Exception:  # noqa: BLE001 - one call's answer failing never strands the calls behind it
                log.exception("answering a call of %s failed", slot.name)

    def _actor_thread(self, slot: ActorSlot) -> ActorThread | ActorLoop:
        if slot.thread is None:
            assert self.loop is not None
            has_async = any(ep.is_async for ep in slot.endpoints.values())
            slot.thread = (ActorLoop if has_async else ActorThread)(slot.name, self.loop)
        return slot.thread

    def _on_loop(self, reply: Reply) -> Reply:
        """``reply`` made safe to call from an actor's thread (it writes to the loop's connections)."""

        def answer(ok: bool, value: Any) -> None:
            if threading.get_ident() == self.loop_thread:
                reply(ok, value)
            else:
                assert self.loop is not None
                self.loop.call_soon_threadsafe(reply, ok, value)

        return answer

    async def _run_concurrent(
        self, slot: ActorSlot, ep: Endpoint, args: tuple, kwargs: dict, reply: Reply, ctx: Context
    ) -> None:
        self._reply_here(reply, *await self._run_async(slot, ep, args, kwargs, ctx))

    async def _run_async(
        self, slot: ActorSlot, ep: Endpoint, args: tuple, kwargs: dict, ctx: Context | None = None
    ) -> tuple[bool, Any]:
        token = current_context.set(ctx or slot.ctx)
        try:
            return True, await ep.fn(slot.instance, *args, **kwargs)
        except (Exception, asyncio.CancelledError) as e:
            return False, self._error(slot, ep.name, e)
        except BaseException as e:  # SystemExit, KeyboardInterrupt, a user BaseException
            return False, self._fatal(slot, ep.name, e)
        finally:
            current_context.reset(token)

    @staticmethod
    def _in_context(slot: ActorSlot, fn: Callable[..., Any], args: tuple) -> Any:
        token = current_context.set(slot.ctx)
        try:
            return fn(*args)
        finally:
            current_context.reset(token)

    def _run_sync(
        self, slot: ActorSlot, ep: Endpoint, args: tuple, kwargs: dict, ctx: Context | None = None
    ) -> tuple[bool, Any]:
        if slot.failed:  # it failed (a broadcast raised, abort()) while this call waited on its thread
            return False, slot.refusal()
        token = current_context.set(ctx or slot.ctx)
        try:
            return True, ep.fn(slot.instance, *args, **kwargs)
        except Exception as e:
            return False, self._error(slot, ep.name, e)
        except BaseException as e:  # SystemExit, KeyboardInterrupt, a user BaseException
            return False, self._fatal(slot, ep.name, e)
        finally:
            current_context.reset(token)

    def _fatal(self, slot: ActorSlot, what: str, e: BaseException) -> ActorFailure:
        """An endpoint raised a BaseException that is not an Exception: as in Monarch, the actor
        has failed. The call is answered with SupervisionError (never left hanging, the connection
        kept), every later call to the actor is refused with why, and its owner is told."""
        err = self._error(slot, what, e)
        why = f"{err.message}: the actor has failed and takes no more calls"
        slot.failed = why
        if slot.owner is not None:  # and, as in Monarch, its owner gets a supervision event
            self._tell_owner(slot.owner[0], slot.owner[1], self._failure(slot, why))
        return error_payload("supervision", why, err.traceback, err.exception_type)

    def _error(self, slot: ActorSlot, what: str, e: BaseException) -> ActorFailure:
        where = f"{slot.cls_name}.{what} on proc {self.rank} of mesh {self.mesh_id} (host {self.host_index})"
        # "Actor call NAME.ENDPOINT failed" leads, as Monarch's ActorError says it
        return error_payload(
            "actor",
            f"Actor call {slot.name}.{what} failed: {where} raised {type(e).__name__}: {e}",
            "".join(traceback.format_exception(type(e), e, e.__traceback__)),
            type(e).__name__,
        )

    def _await_actor(self, actor_id: str, retry: Callable[[], None]) -> None:
        """Holds a call for an actor whose spawn has not arrived yet; after SPAWN_WAIT_S it is
        answered as for an actor that is not here."""
        waiting = self.awaiting.setdefault(actor_id, [])
        waiting.append(retry)
        if len(waiting) == 1:
            assert self.loop is not None
            self.loop.call_later(SPAWN_WAIT_S, self._give_up_on, actor_id)

    def _give_up_on(self, actor_id: str) -> None:
        if actor_id in self.constructing:  # a slow constructor: its calls wait for it, however long
            assert self.loop is not None
            self.loop.call_later(SPAWN_WAIT_S, self._give_up_on, actor_id)
            return
        if actor_id in self.awaiting and actor_id not in self.actors:
            self.ended.setdefault(
                actor_id,
                f"actor {actor_id} is not on proc {self.rank} of mesh {self.mesh_id} (never spawned here, or stopped)",
            )
            self._release_calls(actor_id)

    def _release_calls(self, actor_id: str) -> None:
        for retry in self.awaiting.pop(actor_id, []):
            retry()

    def _ended(self, actor_id: str, why: str) -> None:
        self.ended[actor_id] = why
        while len(self.ended) > MAX_ENDED:
            self.ended.pop(next(iter(self.ended)))
        self._release_calls(actor_id)

    def spawn(
        self,
        conn: ProcConnection,
        rid: int,
        actor_id: str,
        name: str,
        point: Point,
        bufs: list[bytearray],
        owner: str = "",
        creator: CreatorInstance | None = None,
        mesh: tuple[str, Any, int, bytes | None] | None = None,
    ) -> None:
        """Creates the actor; a failing constructor is answered to the spawner (its mesh's
        ``initialized``) and, as in Monarch, every call to the actor then fails with why."""
        if self.booting is not None:  # spawn_procs(bootstrap=...) runs before any other actor is made
            self.booting.append(lambda: self.spawn(conn, rid, actor_id, name, point, bufs, owner, creator, mesh))
            return
        inst_ctx = Context(
            ActorInstance(
                name,
                actor_id,
                point,
                self.rank,
                self.mesh_id,
                self.host_index,
                creator=creator,
                proc_mesh_source=self._proc_mesh(mesh),
                hosted_by=self.me if self.settings.in_client else None,
            )
        )
        slot = ActorSlot(actor_id, name, "?", None, inst_ctx, {})
        try:
            cls, args, kwargs = unpack(bufs)
            slot.cls_name = cls.__name__
            slot.qualname = f"{cls.__module__}.{cls.__qualname__}"
            inst_ctx.actor_instance.cls_path = slot.qualname
            slot.endpoints = endpoints_of(cls)
            instance = cls.__new__(cls)
        except Exception as e:
            err = error_payload(
                "actor",
                f"could not create actor {name!r} on proc {self.rank}: {type(e).__name__}: {e}",
                traceback.format_exc(),
                type(e).__name__,
            )
            self._ended(actor_id, f"{err.message}: the actor was never created")
            conn.reply(rid, False, err)
            return
        # As in Monarch, the constructor runs where the endpoints do (thread-local state it sets is
        # theirs): on the actor's own thread (its loop's, with async endpoints), where it may block
        # without holding other actors; calls that arrive meanwhile wait for it
        init = functools.partial(instance.__init__, *args, **kwargs)
        assert self.loop is not None
        self.constructing.add(actor_id)
        if getattr(cls, "_gates_the_proc", False):
            self.booting = []
        done = self._actor_thread(slot).run(self._in_context, slot, init, ())
        done.add_done_callback(lambda d: self._constructed(conn, rid, slot, instance, owner, d))

    def _proc_mesh(self, mesh: tuple[str, Any, int, bytes | None] | None) -> Callable[[], Any] | None:
        """Makes the ProcMesh an actor was spawned on, when it asks (its procs come with the first
        spawn on each proc, compressed; they are unpacked once, at the first ask on this proc)."""
        if mesh is None:
            return None
        mesh_id, shape, count, refs = mesh
        key = (mesh_id, count)
        if refs is not None and key not in self.mesh_refs:
            # one mesh id has one list of procs per size (a proc's this_proc() is 1 of N)
            self.mesh_refs[key] = refs

        def make() -> Any:
            from .mesh import ProcMesh

            procs = self.mesh_refs.get(key)
            if isinstance(procs, bytes):
                procs = self.mesh_refs[key] = pickle.loads(zlib.decompress(procs))
            return ProcMesh(self.pool, procs, shape, mesh_id) if procs else None

        return make

    def _constructed(
        self, conn: ProcConnection, rid: int, slot: ActorSlot, instance: Any, owner: str, done: asyncio.Future[Any]
    ) -> None:
        if getattr(type(instance), "_gates_the_proc", False) and self.booting is not None:
            held, self.booting = self.booting, None
            self.loop.call_soon(lambda: [spawn() for spawn in held])  # type: ignore[union-attr]
        if slot.actor_id in self.ended:  # stopped while its constructor ran
            if slot.thread is not None:
                slot.thread.close()
            return
        self.constructing.discard(slot.actor_id)
        exc = done.exception()
        if exc is not None:
            err = self._error(slot, "__init__", exc)
            self._ended(slot.actor_id, f"{err.message}: the actor was never created")
            conn.reply(rid, False, err)
            # as in Monarch, a constructor that raised is also a supervision event for the owner
            if getattr(type(instance), "_constructor_failure_is_a_fault", True):
                self._tell_owner(conn, owner, self._failure(slot, f"{err.message}: the actor was never created"))
            if slot.thread is not None:
                slot.thread.close()
            return
        slot.instance = instance
        slot.owner = (conn, owner)
        self.actors[slot.actor_id] = slot
        conn.reply(rid, True, None)
        self._release_calls(slot.actor_id)

    # ------------------------------------------------------------ multicast through a tree

    def cast(self, conn: ProcConnection, m: messages.Cast, bufs: list[bytearray]) -> None:
        """Forwards to each child subtree at once, runs locally in order, answers for the subtree."""
        hub = session.hub_for(self.pool)
        rid, sender, seqs, actor_id, ep = m.rid, m.sender, m.seqs, m.actor_id, m.endpoint
        point = (m.points[0], m.points[1], m.points[2][self.rank]) if m.points else None
        child_futs: list[tuple[list[int], Future[Any]]] = []
        for rank, addr, sub in m.tree:
            ranks = _subtree_ranks(rank, sub)
            fut: Future[Any] = Future(hub)
            points = (m.points[0], m.points[1], {r: m.points[2][r] for r in ranks}) if m.points else None
            header = messages.Cast(
                hub.next_id() if rid else 0, sender, {r: seqs[r] for r in ranks if r in seqs}, actor_id, ep, sub, points
            )
            try:
                hub.conn(ProcAddr(*addr)).send(encode(header, packed=bufs), header.rid, fut if rid else None)
            except Exception as e:
                if not rid:
                    log.warning("broadcast could not reach proc %d: %s", rank, e)
                fut.set_exception(e)
            child_futs.append((ranks, fut))
        if not rid:
            self.ordered(
                sender,
                seqs.get(self.rank),
                lambda: self.call(self._replier(None, 0, actor_id, ep), actor_id, ep, bufs, point),
            )
            return
        if not child_futs and isinstance(conn, ProcConnection):  # a leaf answers for itself alone
            self.ordered(
                sender,
                seqs.get(self.rank),
                lambda: self.call(CallerReply(conn, rid, self.rank), actor_id, ep, bufs, point),
            )
            return
        assert self.loop is not None
        loop = self.loop
        local: asyncio.Future[tuple[bool, Any]] = loop.create_future()

        def settle(ok: bool, v: Any) -> None:
            if not local.done():
                local.set_result((ok, v))

        self.ordered(sender, seqs.get(self.rank), lambda: self.call(settle, actor_id, ep, bufs, point))

        async def finish() -> None:
            children: list[tuple[int, bool, Any]] = []
            for ranks, fut in child_futs:  # answered on this loop, which reads the subtree's connections
                try:
                    children += await fut
                except Exception as e:
                    children += [(r, False, error_payload("supervision", str(e))) for r in ranks]
            ok, value = await local
            conn.reply(rid, True, [(self.rank, ok, value)] + children)

        loop.create_task(finish())

    # ------------------------------------------------------------ supervision of meshes we own

    def child_lost(self, owner_actor_id: str, failure: MeshFailure) -> None:
        """Called from the supervision thread when a proc of a mesh an actor here spawned dies."""
        assert self.loop is not None
        slot = self.actors.get(owner_actor_id)
        own = slot.own_loop() if slot is not None else None
        if own is not None:  # its __supervise__ runs where its endpoints do
            own.start(self._supervise(owner_actor_id, failure))
        else:
            self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._supervise(owner_actor_id, failure)))  # type: ignore[union-attr]

    async def _supervise(self, owner_actor_id: str, failure: MeshFailure) -> None:
        slot = self.actors.get(owner_actor_id)
        if slot is None or slot.failed:
            return
        handler = getattr(slot.instance, "__supervise__", None)
        handled, raised = False, ""
        if handler is not None:
            token = current_context.set(slot.ctx)
            try:
                res = handler(failure)
                if asyncio.iscoroutine(res):
                    res = await res
                handled = bool(res)
            except Exception as e:
                print(f"{slot.name}.__supervise__ raised:\n{traceback.format_exc()}", file=sys.stderr)
                raised = f" (its __supervise__ raised {type(e).__name__}: {e})"
            finally:
                current_context.reset(token)
        if not handled:  # as in Monarch, the owner fails too, and the event goes up to its own owner
            what = "had an actor fail" if failure.actor else "lost a proc"
            why = (
                f"actor {slot.name} failed: a mesh it owns {what} and it did not handle it{raised}: {failure.report()}"
            )
            print(why, file=sys.stderr, flush=True)
            self._actor_failed(owner_actor_id, why, leaf=failure)


def _fault_off_loop(hub: Any, owner_actor: str, payload: list[bytearray]) -> None:
    """A supervision event of the controller's own proc, told on a thread of its own: what the
    controller's ``unhandled_fault_hook`` raises there ends the program as from the supervision thread."""
    from . import supervision

    try:
        hub._fault(owner_actor, payload)
    except BaseException as e:  # noqa: BLE001 - the hook's verdict, passed to the main thread
        supervision.unhandled_off_caller(e)


def _subtree_ranks(rank: int, sub: list) -> list[int]:
    out = [rank]
    for r, _addr, s in sub:
        out += _subtree_ranks(r, s)
    return out


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s proc %(levelname)s %(message)s")
    try:
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    except (AttributeError, ValueError):
        pass
    from .actor import prefix_logs_with_actor

    bind = os.environ.get(placement.ENV)
    if bind:  # spawn_procs(proc_bind=...): before anything else runs (or starts a thread)
        try:
            placement.apply(json.loads(bind))
        except (ValueError, OSError) as e:
            print(f"proc {os.environ.get('MONARCH_TORCHX_PROC_RANK', '?')}: proc_bind {bind}: {e}", file=sys.stderr)
            raise SystemExit(1) from None
    prefix_logs_with_actor()
    server = ProcServer(ProcSettings.from_env(dict(os.environ)))
    asyncio.run(server.run())
    if server.stop_reason and server.stop_reason != "stopped by its owner":
        print(f"proc {server.rank} of mesh {server.mesh_id} stopping: {server.stop_reason}", file=sys.stderr)
