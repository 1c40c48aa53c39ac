"""What an actor call can fail with, as Monarch names it."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class ActorError(Exception):
    """An endpoint (or constructor) raised; the actor lives on. ``traceback`` is the remote one."""

    def __init__(self, message: str, traceback: str = "", exception_type: str = ""):
        super().__init__(message)
        self.traceback = traceback
        self.exception_type = exception_type

    def __str__(self) -> str:
        msg = super().__str__()
        return f"{msg}\n\nRemote traceback:\n{self.traceback}" if self.traceback else msg


class MalformedActorFailure(ActorError):
    """What came back as an actor's failure is not an ``ActorFailure`` (a proc of another version,
    or a damaged frame): the call failed, and why cannot be read."""


class SupervisionError(RuntimeError):
    """A proc (or the actor that owned a failed mesh) is gone: the call cannot be answered.
    A RuntimeError, as Monarch's (``except RuntimeError`` catches it there too)."""


class ProcStopped(SupervisionError):
    """The proc was stopped on purpose (``ProcMesh.stop()``), not lost."""


class ActorAborted(SupervisionError):
    """The actor failed itself with ``context().actor_instance.abort(reason)``."""


@dataclass
class MeshFailure:
    """Handed to an owner's ``__supervise__`` (or, in a controller, ``unhandled_fault_hook``):
    which member of which mesh failed, and how: a proc that died, or an actor that failed. An
    owner that does not handle it fails too, and the event goes up unchanged: the report names the
    actor where the failure began, as Monarch's does."""

    mesh: str
    rank: int
    host: int
    hostname: str
    reason: str
    mesh_name: str = ""  # the actor mesh's name (as spawned) when an actor failed; "" for a proc
    actor: str = ""  # the failed actor's id, when it was an actor
    actor_class: str = ""  # module.Class of the failed actor
    point: str = ""  # its coordinates, as Monarch prints them: {'gpus': 0/2}
    actors_on_proc: tuple[str, ...] = ()  # a dead proc: the actors spawned on it (name{point})
    exit_code: int | None = None  # a dead proc's exit code (negative: the signal that killed it)

    def __str__(self) -> str:  # Monarch's shape: MeshFailure(mesh_name=.., crashed_ranks=[..], event=..)
        what = f"actor {self.mesh_name} (rank {self.rank})" if self.actor else f"proc {self.rank}"
        event = f"{what} of mesh {self.mesh} on host {self.host} ({self.hostname}) {self.reason}"
        return f"MeshFailure(mesh_name={self.mesh_name or self.mesh}, crashed_ranks=[{self.rank}], event={event})"

    def report(self) -> str:
        """A user-readable report of the failure, in the words of Monarch's ``MeshFailure.report()``."""
        if self.actor:
            who = f"{self.actor_class} {self.mesh_name}{self.point}".strip()
            return f"The actor {who} and all its descendants have failed:\n  {self.reason}"
        who = ", ".join(self.actors_on_proc) or f"on proc {self.rank} of mesh {self.mesh}"
        how = f"Killed(sig={-self.exit_code})" if self.exit_code is not None and self.exit_code < 0 else self.reason
        return (
            f"The actor {who} and all its descendants have failed:\n  the process this actor was running on "
            f"failed: {how} (proc {self.rank} of mesh {self.mesh} on host {self.host}, {self.hostname}: "
            f"{self.reason})"
        )


def point_text(point: Any) -> str:
    """A mesh point as Monarch prints one in its reports: ``{'hosts': 0/2, 'gpus': 1/4}``."""
    from .shape import Point

    return repr(point) if isinstance(point, Point) else ""


class FailureKind(str, Enum):
    """What failed, as the caller's exception type says it (``ActorFailure.to_exception``)."""

    ACTOR = "actor"  # the endpoint raised: ActorError, with its traceback
    SUPERVISION = "supervision"  # the actor (or its proc) has failed: SupervisionError
    ABORTED = "aborted"  # the actor called abort(): ActorAborted
    USAGE = "usage"  # the call itself was wrong (no such endpoint): ValueError


@dataclass(frozen=True)
class ActorFailure:
    """An endpoint's failure as it travels back to its caller: named fields of plain strings,
    never a pickled exception object (a proc unpickles nothing of a peer's classes for it)."""

    kind: FailureKind
    message: str
    traceback: str = ""
    exception_type: str = ""  # the name of the type the endpoint raised

    def to_exception(self) -> BaseException:
        if self.kind == FailureKind.SUPERVISION:
            return SupervisionError(self.message)
        if self.kind == FailureKind.ABORTED:
            return ActorAborted(self.message)
        if self.kind == FailureKind.USAGE:
            return ValueError(self.message)
        return ActorError(self.message, self.traceback, self.exception_type)


def error_payload(kind: str, message: str, tb: str = "", etype: str = "") -> ActorFailure:
    return ActorFailure(FailureKind(kind), message, tb, etype)


def remote_error(payload: Any) -> BaseException:
    """Rebuilds the error an actor proc sent back (never unpickles exception objects)."""
    if not isinstance(payload, ActorFailure):
        return MalformedActorFailure(f"malformed error from actor: {payload!r:.200}")
    return payload.to_exception()


def supervision_reason(status: dict | None) -> str:
    if status is None:
        return "is gone (its host no longer knows it)"
    return status.get("msg") or f"ended ({status.get('state')})"
