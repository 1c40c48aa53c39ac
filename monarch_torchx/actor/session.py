"""What this process is in the actor world: its hub per pool, and (in a proc) who it is.

Process-wide by nature (sockets, the reader role), so it lives here once, behind functions.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from ..credentials import PoolCredentials
from .hub import Hub, ProcAddr


@dataclass
class ProcIdentity:
    """Who a proc is (set process-wide in an actor proc; carried by the context of the actors of the
    controller's own proc): its pool, host, mesh and rank, and its own listening address."""

    pool: str
    creds: PoolCredentials
    host_index: int
    mesh_id: str
    rank: int
    addr: ProcAddr | None = None
    on_child_lost: Callable[..., Any] | None = None  # (owner actor id, MeshFailure)
    loop_thread: int | None = None  # the thread of the proc's event loop
    on_abort: Callable[[str, str], None] | None = None  # (actor id, reason): actor_instance.abort()
    # what each actor of this proc spawned (its ProcMeshes and ActorMeshes): stopped with it
    owned: dict[str, list[Any]] = field(default_factory=dict)
    in_client: bool = False  # the controller's own proc (its actors run in the controller's process)
    hosts: Callable[[str], bool] = lambda _actor_id: False  # whether an actor runs in this proc

    def record_owned(self, actor_id: str, mesh: Any) -> None:
        self.owned.setdefault(actor_id, []).append(mesh)


_lock = threading.Lock()
_client_lock = threading.Lock()
_hubs: dict[str, Hub] = {}
_proc: dict[str, ProcIdentity] = {}
_current: dict[str, Any] = {}
_attaching: dict[str, Any] = {}  # pool -> the Future of attach_to_workers still adopting its workers


def set_proc(ident: ProcIdentity) -> None:
    _proc["self"] = ident


def this_proc() -> ProcIdentity | None:
    """The proc the running code is in: this process, if it is an actor proc; in a controller,
    its own proc while one of that proc's actors runs (its identity rides on the actor's
    context); else None (the controller's own code)."""
    me = _proc.get("self")
    if me is not None:
        return me
    from .actor import current_context

    return current_context.get().actor_instance.hosted_by


def proc_hosting(actor_id: str) -> ProcIdentity | None:
    """The proc of this process where actor ``actor_id`` runs (to tell it of what it owns),
    from any thread: this actor proc, or the controller's own proc."""
    me = _proc.get("self")
    if me is not None:
        return me
    for proc in list(_current.get("client_procs", {}).values()):
        if proc.identity.hosts(actor_id):
            return proc.identity
    return None


def client_proc(pool: str) -> Any:
    """The controller's own proc on ``pool`` (Monarch's ``this_proc()`` in the root client),
    started on first use: actors spawned on it run in this process."""
    from .client_proc import ClientProc

    with _client_lock:  # not the session lock: the proc's own thread asks for its hub as it starts
        procs = _current.setdefault("client_procs", {})
        proc = procs.get(pool)
        hub = hub_for(pool)
        if proc is not None and not proc.ended and proc.server.creds != hub.creds:
            proc.stop()  # the pool was replaced under its name: its procs speak a new secret
        if proc is None or proc.ended:
            proc = procs[pool] = ClientProc.start(pool, hub)
        return proc


def set_current_pool(pool: str, attaching: Any = None) -> None:
    """``attaching``: the Future of an adoption still under way (attach_to_workers returns at
    once): code that then reaches the pool (``Channel.open()``, ``this_proc()``) waits for it."""
    _current["pool"] = pool
    if attaching is not None:
        _attaching[pool] = attaching


def current_pool() -> str | None:
    return _current.get("pool")


def hub_for(pool: str, creds: PoolCredentials | None = None) -> Hub:
    """This process's hub for ``pool``; ``creds`` (from a fresh registry read) replace stale ones."""
    adopting = _attaching.get(pool)
    if adopting is not None and creds is None:  # (the adoption itself passes the pool's creds)
        adopting.exception()  # waits; its failure is raised by whoever uses the mesh
        _attaching.pop(pool, None)
    hub = _hubs.get(pool)
    if hub is not None and (creds is None or hub.creds == creds):
        return hub
    if hub is not None:
        with _lock:  # the pool was replaced under the same name: its procs and agents have a new secret
            _hubs.pop(pool, None)
    with _lock:
        hub = _hubs.get(pool)
        if hub is None:
            me = this_proc()
            if creds is not None:
                pass
            elif me is not None and me.pool == pool:
                creds = me.creds
            else:
                from ..registry import Registry

                creds = Registry().require(pool).credentials
            hub = _hubs[pool] = Hub(creds, pool)
            if me is not None and not me.in_client and me.pool == pool and me.addr is not None:
                hub.listen_addr = me.addr  # ports of this proc are served by its own server
        return hub


def controllers(pool: str) -> Any:
    """This controller's actors spawned by name (get_or_spawn_controller) for ``pool``."""
    from .controllers import NamedActors

    with _lock:
        regs = _current.setdefault("controllers", {})
        if pool not in regs:
            regs[pool] = NamedActors(pool)
        return regs[pool]


def pool_ending(pool: str) -> None:
    """This process is ending ``pool`` on purpose (``HostMesh.shutdown()``, a job's ``kill()``):
    its procs' ends are expected, not supervision events."""
    hub = _hubs.get(pool)
    if hub is not None:
        hub.ending_all()
    if _current.get("pool") == pool:  # what this_proc() and get_or_spawn_controller() would use is gone
        _current.pop("pool", None)
    _current.get("controllers", {}).pop(pool, None)
    proc = _current.get("client_procs", {}).pop(pool, None)
    if proc is not None:
        proc.stop()


def end_all() -> None:
    """Every proc this process owns, in every pool, is let go: they stop as if it had exited."""
    for hub in list(_hubs.values()):
        hub.ending_all()
    _current.pop("controllers", None)
    for proc in list(_current.pop("client_procs", {}).values()):
        proc.stop()  # its actors' __cleanup__ run, as when the process exits


def forget_hubs_after_fork() -> None:
    """A forked child must not share its parent's sockets or reader state."""
    _hubs.clear()
    _proc.clear()
    _current.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=forget_hubs_after_fork)
