"""Monarch's ``get_or_spawn_controller``: one actor per name, for the whole program.

In Monarch the names live in the root client, and the actors run there. Here too: the
controller process keeps, per pool, the actors spawned by name, on its own proc (``this_proc()``
of the controller: they run in the controller's OS process). Actors elsewhere reach the names
through a port of the controller's: the procs a controller spawns get that port in their
environment (``MONARCH_TORCHX_CONTROLLERS``), and pass it on to the procs they spawn. Asking
from an actor is one port message and one answer.
"""

from __future__ import annotations

import contextvars
import json
import os
import threading
from typing import Any

from ..errors import MonarchError
from . import session
from .channel import Channel, Port, PortReceiver
from .future import Future
from .hub import ProcAddr

ENV = "MONARCH_TORCHX_CONTROLLERS"


class NamedActors:
    """The controller's actors spawned by name for one pool, and the port actors ask it through."""

    def __init__(self, pool: str):
        self.pool = pool
        self._lock = threading.RLock()  # spawning its procs asks for port_env() again
        self._meshes: dict[str, Any] = {}
        self._port: Port[Any] | None = None

    def get_or_spawn(self, name: str, cls: type, args: tuple, kwargs: dict) -> Any:
        with self._lock:
            mesh = self._meshes.get(name)
            if mesh is None:  # spawned by the program, not by whichever actor asked first (nor stopped with it)
                spawn = session.client_proc(self.pool).mesh().spawn
                mesh = self._meshes[name] = contextvars.Context().run(spawn, name, cls, *args, **kwargs)
            return mesh

    def port_env(self, toward: str) -> str:
        """The port procs ask through, as the environment variable carries it (opened on first
        use, on the address the route to host ``toward`` leaves from)."""
        with self._lock:
            if self._port is None:
                self._port = _serve(self, toward)
            p = self._port
        return json.dumps([p.pool, list(p.addr), p.port_id])

    def answer(self, request: tuple[str, type, tuple, dict, Port[Any]]) -> None:
        """On the inbox thread: one actor's request, answered on the port it sent."""
        try:
            name, cls, args, kwargs, reply = request
        except (TypeError, ValueError):
            return  # not a request of ours: nothing to answer to
        try:
            mesh = self.get_or_spawn(name, cls, args, kwargs)
        except Exception as e:
            reply.exception(e)
        else:
            reply.send(mesh)


def _serve(names: NamedActors, toward: str) -> Port[Any]:
    hub = session.hub_for(names.pool)
    hub.listen(hub.local_address(toward))
    port: Port[Any]
    _rx: PortReceiver[Any]
    port, _rx = Channel.open(pool=names.pool)
    # requests are served as they arrive (on the inbox thread), not queued for a receiver
    hub.ports[port.port_id] = lambda req: threading.Thread(
        target=names.answer, args=(req,), daemon=True, name="monarch-torchx-controllers"
    ).start()
    return port


def get_or_spawn_controller(name: str, cls: type, *args: Any, **kwargs: Any) -> Future[Any]:
    """The actor ``name`` of this program (an ActorMesh of one), spawned from ``cls(*args, **kwargs)``
    the first time it is asked for, as Monarch's. Later calls, from the controller or from any
    actor it started, get the same actor (the arguments of the first call count)."""
    me = session.this_proc()
    if me is None or me.in_client:  # the controller, or one of the actors running in it
        fut: Future[Any] = Future()
        try:
            fut.set_result(
                session.controllers(me.pool if me is not None else _controller_pool()).get_or_spawn(
                    name, cls, args, kwargs
                )
            )
        except Exception as e:
            fut.set_exception(e)
        return fut
    raw = os.environ.get(ENV)
    if not raw:
        raise MonarchError(
            "get_or_spawn_controller() in an actor needs the controller that started its proc "
            f"(${ENV} is not set: this proc was not spawned by a monarch_torchx controller)"
        )
    pool, addr, port_id = json.loads(raw)
    names_port: Port[Any] = Port(pool, ProcAddr(*addr), port_id)
    reply: Port[Any]
    rx: PortReceiver[Any]
    reply, rx = Channel.open(once=True, pool=me.pool)
    names_port.send((name, cls, args, kwargs, reply))
    return rx.recv()


def _controller_pool() -> str:
    pool = session.current_pool()
    if pool is None:
        from .mesh import this_host

        this_host()  # the local pool, as this_proc() would use
        pool = session.current_pool()
    assert pool is not None
    return pool
