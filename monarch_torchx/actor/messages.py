"""The messages a controller, its actors and their procs send each other, as named types.

Each frame of the actor protocol is a header (one of these, plainly pickled) plus a payload
pickled once and carried as the frame's buffers (see ``hub``). Naming the headers keeps the
sender in ``mesh`` and the receivers in ``proc`` and ``hub`` agreeing on one field list, and
lets each receiver pick its handler by the header's type. They are NamedTuples: as cheap to
pickle and compare as the plain tuples they replace, which matters on the call path.

Headers only come from authenticated peers of the same pool (the handshake is checked before
any frame is read); ``decode`` still refuses a frame whose header is not one of these.
"""

from __future__ import annotations

import pickle
from typing import Any, NamedTuple, Optional, Union

from .. import net

# Where a member stands in a slice of its actor mesh that a message was sent to: (labels, sizes,
# coords), what its ``context().message_rank`` is while that message runs (None: the whole mesh)
MessagePoint = Optional[tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]]  # noqa: UP007, UP045


class Call(NamedTuple):
    """Run ``endpoint`` of actor ``actor_id`` with the payload's arguments; answer ``rid`` (0: nobody
    waits). ``sender``/``seq`` order one sender's messages to one proc; ``point``: see MessagePoint."""

    rid: int
    sender: str | None
    seq: int | None
    actor_id: str
    endpoint: str
    point: MessagePoint = None


class Cast(NamedTuple):
    """A multicast down a tree of procs: run locally, forward to each subtree of ``tree`` (a list of
    ``(rank, addr, subtree)``), answer for the whole subtree when ``rid`` is set. ``seqs`` holds
    each rank's sequence number from the original sender; ``points``, sent to a slice of the mesh,
    the slice's labels and sizes and each rank's coordinates in it (see MessagePoint)."""

    rid: int
    sender: str | None
    seqs: dict[int, int]
    actor_id: str
    endpoint: str
    tree: list[tuple[int, tuple, list]]
    points: tuple[tuple[str, ...], tuple[int, ...], dict[int, tuple[int, ...]]] | None = None


class Spawn(NamedTuple):
    """Construct actor ``actor_id`` (class and arguments in the payload) at ``coords`` of a mesh with
    these ``labels``/``sizes``. ``mesh`` is ``(mesh_id, shape, n_procs, refs or None)``: the refs
    travel in the first spawn a proc sees for that mesh only, and so do ``links``: the procs this
    one forwards a multicast of the whole mesh to, which it connects to at once."""

    rid: int
    sender: str | None
    seq: int | None
    actor_id: str
    name: str
    coords: tuple[int, ...]
    labels: tuple[str, ...]
    sizes: tuple[int, ...]
    owner: str
    creator: Any
    mesh: tuple[str, Any, int, bytes | None] | None
    links: tuple[tuple[str, int, str], ...] = ()


class CallPort(NamedTuple):
    """Monarch's ``send(..., port=)``: run ``endpoint`` and send its value to ``port``."""

    sender: str | None
    seq: int | None
    actor_id: str
    endpoint: str
    port: Any


class StopActor(NamedTuple):
    """``ActorMesh.stop()`` on one proc: the queued calls run, then ``__cleanup__``."""

    rid: int
    sender: str | None
    seq: int | None
    actor_id: str


class Own(NamedTuple):
    """This connection's end stops the proc (sent by the controller that spawned it)."""


class Stop(NamedTuple):
    """Stop the proc (every actor's cleanup runs), then answer ``rid``."""

    rid: int


class PortValue(NamedTuple):
    """A value (the payload) for the port ``port_id`` opened by the receiving process."""

    port_id: str


class Answer(NamedTuple):
    """The answer to request ``rid``: its value (``ok``) or an error payload."""

    rid: int
    ok: bool


class Fault(NamedTuple):
    """An actor that ``owner_actor`` spawned failed with nobody to tell (a broadcast raised); the
    payload is the failure's fields."""

    owner_actor: str


ToProc = Union[Call, Cast, Spawn, CallPort, StopActor, Own, Stop, PortValue]  # noqa: UP007
ToCaller = Union[Answer, Fault, PortValue]  # noqa: UP007
Message = Union[ToProc, ToCaller]  # noqa: UP007

TO_PROC = (Call, Cast, Spawn, CallPort, StopActor, Own, Stop, PortValue)
TO_CALLER = (Answer, Fault, PortValue)


def dumps(header: Message) -> bytes:
    return pickle.dumps(header, protocol=5)


def decode(body: Any, expected: tuple[type, ...]) -> Message:
    """The header of a frame; raises ``net.MalformedFrame`` when it is not one of ``expected``."""
    try:
        header = pickle.loads(body)
    except Exception as e:
        raise net.MalformedFrame(f"malformed message: {e}") from None
    if type(header) not in expected:
        raise net.MalformedFrame(f"unexpected message {type(header).__name__}")
    return header
