"""The controller's own proc: Monarch's ``this_proc()`` in the root client.

In Monarch the controller is a proc too: ``this_proc().spawn(...)`` and
``get_or_spawn_controller(...)`` make actors that run in the controller's own OS process. Here
that proc is a ``ProcServer`` like any other (the same code runs its actors: sync endpoints on
each actor's thread, async ones on its event loop), on an event loop thread of the controller's,
listening on the pool's authenticated protocol so the pool's actors can call it. Its actors see
it as their proc (``session.this_proc()`` through their context); the controller's own code
does not.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import uuid
from typing import Any

from ..errors import MonarchError
from .hub import Hub, ProcAddr
from .proc import ProcServer, ProcSettings

START_TIMEOUT_S = 30.0


class ClientProc:
    """One pool's proc in this process, started on first use and kept for the process's life
    (or until the pool ends, or ``shutdown_context()``)."""

    def __init__(self, pool: str, server: ProcServer, addr: ProcAddr, loop: asyncio.AbstractEventLoop):
        self.pool = pool
        self.server = server
        self.addr = addr
        self._loop = loop
        self._let_go = False
        self._mesh: Any | None = None

    @property
    def ended(self) -> bool:
        """Let go, or stopped (``this_proc().stop()``): the next ``this_proc()`` starts another."""
        return self._let_go or bool(self.server.stop_reason)

    @property
    def identity(self) -> Any:
        return self.server.me

    @staticmethod
    def start(pool: str, hub: Hub) -> ClientProc:
        """Starts the proc's loop thread and waits until it listens, on the address this
        process's connections to the pool leave from (as its ports' inbox does)."""
        settings = ProcSettings(
            pool,
            hub.creds,
            mesh_id=f"client-{uuid.uuid4().hex[:8]}",
            rank=0,
            host_index=-1,
            bind=hub.local_address(_first_host(pool)),
            in_client=True,
        )
        server = ProcServer(settings)
        ready = threading.Event()
        got: dict = {}

        def serve() -> None:
            loop = asyncio.new_event_loop()
            got["loop"] = loop

            def listening(addr: ProcAddr) -> None:
                got["addr"] = addr
                ready.set()

            try:
                loop.run_until_complete(server.run(on_ready=listening))
            except BaseException as e:  # noqa: BLE001 - told to the starting caller
                got["error"] = e
                ready.set()
            finally:
                loop.close()

        threading.Thread(target=serve, name=f"monarch-torchx-client-proc-{pool}", daemon=True).start()
        if not ready.wait(START_TIMEOUT_S) or "addr" not in got:
            raise MonarchError(
                f"the controller's own proc on pool {pool!r} did not start: "
                f"{got.get('error') or 'no answer within {:.0f} s'.format(START_TIMEOUT_S)}"  # noqa: UP032
            )
        return ClientProc(pool, server, got["addr"], got["loop"])

    def mesh(self) -> Any:
        """This proc as a ProcMesh with no dims (what ``this_proc()`` gives the controller)."""
        if self._mesh is None:
            from .mesh import ProcMesh, ProcRef
            from .shape import Shape

            ref = ProcRef(self.addr, self.server.mesh_id, 0, -1, socket.gethostname(), None)
            self._mesh = ProcMesh(self.pool, [ref], Shape((), (), (0,)), self.server.mesh_id)
        return self._mesh

    def stop(self, timeout: float = 30.0) -> None:
        """Its actors' ``__cleanup__`` run and it stops listening; the process goes on."""
        if self.ended:
            return
        self._let_go = True
        done = threading.Event()
        try:
            self._loop.call_soon_threadsafe(self.server.begin_stop, "the controller let it go", done.set)
        except RuntimeError:  # its loop is gone already
            return
        from . import session

        if threading.get_ident() == self.server.loop_thread or session.this_proc() is self.identity:
            return  # asked by one of its own actors: its stop cannot wait for itself
        done.wait(timeout)


def _first_host(pool: str) -> str | None:
    """Host 0's address: the proc listens where the route toward the pool's hosts leaves from."""
    from ..registry import Registry

    rec = Registry().get(pool)
    return next((h.host for h in Registry.hosts(rec) if h is not None), None) if rec is not None else None
