"""Ports: addresses any actor (or the controller) can send values to, in order.

``Channel.open()`` gives a picklable ``Port`` and the ``PortReceiver`` that stays here. Inside
an actor the proc's own server receives port messages; in a controller the hub starts an
authenticated listener the first time a channel is opened.
"""

from __future__ import annotations

import collections
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ..errors import MonarchError
from . import messages, session
from .errors import ActorFailure
from .future import Future
from .hub import Hub, ProcAddr, encode

T = TypeVar("T")


@dataclass(frozen=True)
class Port(Generic[T]):
    pool: str
    addr: ProcAddr
    port_id: str

    def send(self, value: T) -> None:
        self._post(value)

    def exception(self, exc: BaseException) -> None:
        """The receiver's next ``recv()`` raises (as an ActorError carrying this one's type, message
        and traceback: exception objects are never unpickled)."""
        import traceback

        from .errors import error_payload

        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self._post(_PortError(error_payload("actor", f"{type(exc).__name__}: {exc}", tb, type(exc).__name__)))

    def _post(self, value: Any) -> None:
        hub = session.hub_for(self.pool)
        if hub.listen_addr == self.addr:
            deliver = hub.ports.get(self.port_id)
            if deliver is not None:
                deliver(value)
            return
        hub.conn(self.addr).send(encode(messages.PortValue(self.port_id), value))


@dataclass(frozen=True)
class _PortError:
    """What ``Port.exception`` sends: the error, as plain strings."""

    payload: ActorFailure


class PortReceiver(Generic[T]):
    def __init__(self, hub: Hub | None, loop_thread: int | None):
        self._hub = hub
        self._loop_thread = loop_thread
        self._values: collections.deque[Any] = collections.deque()
        self._waiting: collections.deque[Future[Any]] = collections.deque()
        self._lock = threading.Lock()

    def _deliver(self, value: Any) -> None:
        with self._lock:
            fut = self._waiting.popleft() if self._waiting else None
            if fut is None:
                self._values.append(value)
        if fut is not None:
            _settle(fut, value)

    def recv(self) -> Future[T]:
        fut: Future[T] = Future(self._hub)
        fut.loop_thread = self._loop_thread
        with self._lock:
            if self._values:
                _settle(fut, self._values.popleft())
            else:
                self._waiting.append(fut)
        return fut


def _settle(fut: Future[Any], value: Any) -> None:
    if isinstance(value, _PortError):
        from .errors import remote_error

        fut.set_exception(remote_error(value.payload))
    else:
        fut.set_result(value)


class Channel(Generic[T]):
    @staticmethod
    def open(once: bool = False, pool: str | None = None) -> tuple[Port[T], PortReceiver[T]]:
        """A new port of this process. ``pool`` defaults to the pool last attached here.
        ``once`` (Monarch's once-port): the port takes one value; later ones are dropped."""
        me = session.this_proc()
        pool = pool or (me.pool if me is not None else session.current_pool())
        if pool is None:
            raise MonarchError("Channel.open() needs a pool: attach() to one first, or pass pool=")
        hub = session.hub_for(pool)
        if me is not None and me.pool == pool:
            addr = me.addr
            hub_driven, loop_thread = None, me.loop_thread
        else:  # the inbox thread completes these futures
            addr = hub.listen(hub.local_address())
            hub_driven, loop_thread = None, None
        assert addr is not None
        port_id = uuid.uuid4().hex
        receiver: PortReceiver[T] = PortReceiver(hub_driven, loop_thread)
        if once:

            def deliver_once(value: Any) -> None:
                if hub.ports.pop(port_id, None) is None:
                    return
                receiver._deliver(value)

            hub.ports[port_id] = deliver_once
        else:
            hub.ports[port_id] = receiver._deliver
        return Port(pool, addr, port_id), receiver
