"""``Actor`` and ``@endpoint``, and what an actor may ask about itself (``context()``)."""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar, overload

from . import config
from .shape import Extent, Point

F = TypeVar("F", bound=Callable[..., Any])


class Endpoint:
    """Marks a method as callable through a mesh. On an instance it is the plain method."""

    def __init__(self, fn: Callable[..., Any], explicit_response_port: bool = False, concurrent: bool = False):
        self.fn = fn
        self.name = fn.__name__
        self.is_async = inspect.iscoroutinefunction(fn)
        # Monarch's explicit_response_port: the method's first argument (after self) is the port
        # its answer goes to (port.send(value) or port.exception(exc)); what it returns is ignored
        self.explicit_response_port = explicit_response_port
        self.concurrent = concurrent  # runs at once, beside the actor's other messages (concurrent_endpoint)
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return self.fn.__get__(obj, objtype)


@overload
def endpoint(fn: F) -> F: ...
@overload
def endpoint(
    fn: None = None, *, explicit_response_port: bool = False, propagate: Any = None, instrument: bool = False
) -> Callable[[F], F]: ...


def endpoint(
    fn: Any = None, *, explicit_response_port: bool = False, propagate: Any = None, instrument: bool = False
) -> Any:
    """``@endpoint`` or ``@endpoint(...)``: sync and ``async def`` bodies both work.

    ``explicit_response_port=True``: as Monarch's, the method takes the caller's response port
    first and answers through it. ``instrument`` is accepted (calls are always observable through
    telemetry). ``propagate`` (Monarch's accumulator hook) is not supported: it is refused rather
    than ignored."""
    if propagate is not None:
        raise NotImplementedError("@endpoint(propagate=...) is not supported here; reduce with Accumulator instead")
    if fn is None:
        return lambda f: Endpoint(f, explicit_response_port)
    return Endpoint(fn, explicit_response_port)


def concurrent_endpoint(fn: Any = None, *, explicit_response_port: bool = False) -> Any:
    """As Monarch's ``@concurrent_endpoint``: calls to it do not wait for the actor's other
    messages to finish (each runs as its own task; many may be in flight at once), so the actor's
    state must be safe under that. It wraps an ``async def`` method, not an ``@endpoint``."""

    def wrap(f: Any) -> Endpoint:
        if isinstance(f, Endpoint):
            raise ValueError(f"@concurrent_endpoint does not wrap @endpoint ({f.name}): use one of the two")
        if not inspect.iscoroutinefunction(f):
            raise ValueError(
                f"@concurrent_endpoint can only wrap async endpoints ({getattr(f, '__name__', f)} is not async def)"
            )
        return Endpoint(f, explicit_response_port, concurrent=True)

    return wrap if fn is None else wrap(fn)


def endpoints_of(cls: type) -> dict[str, Endpoint]:
    found: dict[str, Endpoint] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            if isinstance(value, Endpoint):
                found[name] = value
            elif name in found:
                del found[name]  # overridden by a plain method
    return found


class Actor:
    """Base class of actors. Optional hooks:

    ``__supervise__(self, failure: MeshFailure) -> bool``: a proc of a mesh this actor spawned
    died; return True if handled, else this actor fails too (its callers get SupervisionError).
    ``__cleanup__(self, exc)`` (Monarch's) or ``__cleanup__(self)``: the actor's proc is stopping
    (mesh stopped or owner gone; ``exc`` is None then).
    """

    @property
    def logger(self) -> logging.Logger:
        """As Monarch's ``Actor.logger``: a logger named for the actor's class."""
        return logging.getLogger(f"{type(self).__module__}.{type(self).__qualname__}")


@dataclass(frozen=True)
class CreatorInstance:
    """Who spawned an actor (Monarch's ``actor_instance.creator``): its name, class and rank, and
    who spawned it in turn; the controller is ``root``, with no class and an empty rank."""

    name: str
    class_name: str | None
    rank: Point
    creator: CreatorInstance | None = None

    def __str__(self) -> str:
        return _qualified_name(self)


def _qualified_name(ins: Any) -> str:
    """``<root>.<module.Class name{'d': i/n}>``: the chain of creators, as Monarch names an actor."""
    names = []
    while ins is not None:
        cls = "" if ins.class_name is None else f"{ins.class_name} "
        point = repr(ins.rank) if ins.rank.coords else ""
        names.append(f"<{cls}{ins.name}{point}>")
        ins = ins.creator
    return ".".join(reversed(names))


@dataclass
class ActorInstance:
    """Who is running: the actor's name and id, and its rank in the mesh it was spawned in."""

    name: str
    actor_id: str
    rank: Point
    proc_rank: int
    mesh_id: str
    host_index: int
    cls_path: str = ""  # module.Class of the actor
    creator: CreatorInstance | None = None  # who spawned it (None for the controller itself)
    # makes the ProcMesh it was spawned on (``proc_mesh``), on first use
    proc_mesh_source: Callable[[], Any] | None = field(default=None, repr=False, compare=False)
    # the controller's own proc, for an actor running in the controller's process (session.this_proc())
    hosted_by: Any = field(default=None, repr=False, compare=False)

    @property
    def proc_mesh(self) -> Any:
        """The ProcMesh it was spawned on (Monarch's ``actor_instance.proc_mesh``), made when first
        asked for: it names every proc of the mesh, and most actors never ask."""
        if "_proc_mesh" not in self.__dict__:
            source = self.proc_mesh_source
            self.__dict__["_proc_mesh"] = source() if source is not None else None
        return self.__dict__["_proc_mesh"]

    def __getstate__(self) -> dict[str, Any]:  # sent elsewhere, it is a description, not a proc of theirs
        return {**self.__dict__, "hosted_by": None, "proc_mesh_source": None, "_proc_mesh": self.proc_mesh}

    @property
    def class_name(self) -> str | None:
        return None if self.actor_id == "client" else self.cls_path

    def as_creator(self) -> CreatorInstance:
        """This instance, as the actors it spawns see their creator."""
        if self.actor_id == "client":
            return CreatorInstance("root", None, self.rank)
        return CreatorInstance(self.name, self.cls_path, self.rank, self.creator)

    def __str__(self) -> str:  # as Monarch prints an actor instance (and prefixes its logs with)
        if self.actor_id == "client":
            return "<root>"
        return _qualified_name(self)

    @property
    def extent(self) -> Extent:
        return self.rank.extent

    @property
    def proc(self) -> Any:
        """The proc this actor runs in, as a ProcMesh with no dims (Monarch's ``actor_instance.proc``)."""
        from .mesh import this_proc

        return this_proc()

    def abort(self, reason: str | None = None) -> None:
        """Fails this actor now, as Monarch's: later calls to it are refused, and its owner gets a
        supervision event (``__supervise__``, or a controller's ``unhandled_fault_hook``)."""
        from . import session

        me = session.this_proc()
        if me is None or me.on_abort is None:
            raise RuntimeError("abort() is for an actor; the controller has nothing to abort")
        me.on_abort(self.actor_id, f"actor {self.name} explicitly aborted due to: {reason or 'no reason provided'}")


@dataclass
class Context:
    actor_instance: ActorInstance
    message_point: Point | None = None  # the running message's, when it was sent to a slice

    @property
    def message_rank(self) -> Point:
        """As Monarch's: where this actor stands in what the running message was sent to. For a
        message to a slice of its mesh, its point in that slice (``mesh.slice(gpus=1)``: no
        ``gpus`` dim); otherwise its own rank."""
        return self.message_point if self.message_point is not None else self.actor_instance.rank


_CLIENT = Context(ActorInstance("client", "client", Point((), Extent((), ())), 0, "", -1))
current_context: contextvars.ContextVar[Context] = contextvars.ContextVar("monarch_torchx_context", default=_CLIENT)


def context() -> Context:
    """The running actor's context (in the controller: the client's, rank 0 of an empty mesh).
    As in Monarch, from the first call on, log records say who emitted them (``[actor=<root>]``
    in the controller), unless ``config.prefix_python_logs_with_actor`` is False."""
    prefix_logs_with_actor()
    return current_context.get()


def current_rank() -> Point:
    """As Monarch's: the running message's ``message_rank`` (the actor's own rank, unless the
    message was sent to a slice of its mesh)."""
    return current_context.get().message_rank


def current_actor_name() -> str:
    """The running actor's id as a string, as Monarch's: one per member of a mesh (its name as
    given to spawn, the mesh's id and the member's point); "client" in a controller."""
    ai = current_context.get().actor_instance
    return ai.actor_id if ai.actor_id == "client" else f"{ai.actor_id}{ai.rank!r}"


def current_size() -> dict[str, int]:
    return dict(current_context.get().message_rank.extent)


def prefix_logs_with_actor() -> None:
    """Installs Monarch's actor prefix on log records, once per process (see ``_install_prefix``)."""
    with _PREFIX_LOCK:  # two threads' first context() must not wrap the factory twice
        _install_prefix()


_PREFIX_LOCK = threading.Lock()


@functools.cache  # once per process: the record factory wraps itself otherwise
def _install_prefix() -> None:
    """A log record starts ``[actor=<root>.<module.Class name{point}>]`` (the emitting actor, or
    ``<root>`` in a controller), as Monarch's do; an empty message, as torch's structured logging
    emits, is left alone. Set ``monarch_torchx.actor.config.prefix_python_logs_with_actor = False``
    to turn it off. Installed in a proc at its start and in a controller at its first ``context()``."""
    make = logging.getLogRecordFactory()

    def record(*args: Any, **kwargs: Any) -> logging.LogRecord:
        rec = make(*args, **kwargs)
        if config.prefix_python_logs_with_actor and isinstance(rec.msg, str) and rec.msg:
            rec.msg = f"[actor={current_context.get().actor_instance}] {rec.msg}"
        return rec

    logging.setLogRecordFactory(record)
