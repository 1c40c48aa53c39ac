"""Typed requests and replies that cross the wire between a client and an agent."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

# Replica states as they travel (plain strings: an agent's answer and a recorded end are read by
# clients of other versions), spelled as TorchX's AppState names so they map one to one.
PENDING, RUNNING, SUCCEEDED, FAILED, CANCELLED = "PENDING", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"
UNKNOWN = "UNKNOWN"  # its host did not answer in time: maybe busy, maybe gone; asked again later
TERMINAL = (SUCCEEDED, FAILED, CANCELLED)


class ReplicaState(str, Enum):
    """A replica's state, as ``ReplicaStatus`` holds it (equal to its wire string, as TorchX's
    ``AppState`` names it)."""

    PENDING = PENDING
    RUNNING = RUNNING
    SUCCEEDED = SUCCEEDED
    FAILED = FAILED
    CANCELLED = CANCELLED
    UNKNOWN = UNKNOWN

    @property
    def terminal(self) -> bool:
        return self.value in TERMINAL


@dataclass
class ReplicaStatus:
    """What is known of one replica: an agent's answer (``describe``, ``list``), its recorded end
    (``history.ReplicaEnd``), or what a client found (its host lost, unreachable)."""

    state: ReplicaState
    msg: str = ""
    hostname: str = ""
    exit_code: int | None = None
    attempts: int = 0
    started: float | None = None
    ended: float | None = None
    age_s: float | None = None  # how long ago it ended, on its host's (or the file system's) clock
    recorded: bool = False  # its end is on record (written by the agent, or read from there)
    final: bool = True  # False: a failure that may yet be answered otherwise (a launch not yet heard)
    host_lost: bool = False  # it failed because its host was lost (a client's finding): it may be requeued
    app_id: str = ""
    role: str = ""
    replica_id: int = -1
    pid: int | None = None
    argv: list[str] = field(default_factory=list)
    log_dir: str = ""

    @classmethod
    def from_wire(cls, d: dict[str, Any], **more: Any) -> ReplicaStatus:
        """From an agent's status dict (``Replica.status``); fields a newer agent added are left
        out, and ``more`` (e.g. the hostname the client knows) is added."""
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in {**d, **more}.items() if k in known and v is not None or k == "exit_code"}
        fields["state"] = ReplicaState(fields["state"])
        return cls(**fields)

    @property
    def failed_for_good(self) -> bool:
        return self.state == ReplicaState.FAILED and self.final


def known_fields(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without the keys dataclass ``cls`` lacks: a record or message written by a newer
    version (a client, an agent) is still read by this one."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}


def may_requeue(spec: dict[str, Any], requeues: int) -> bool:
    """Whether a replica (its launched spec, as a dict) whose host was lost starts again on
    another host, having been requeued ``requeues`` times: while its role has ``max_retries``
    left, and a submitit job (it has a ``requeue_code``) up to REQUEUES_ON_LOSS times, as SLURM
    requeues a job whose node failed."""
    limit = int(spec.get("max_retries") or 0)
    if spec.get("requeue_code") is not None:
        limit = max(limit, REQUEUES_ON_LOSS)
    return requeues < limit


REQUEUES_ON_LOSS = 3


@dataclass
class LaunchSpec:
    """One process to run on one host: a TorchX role replica, a submitit task, an actor proc."""

    app_id: str
    role: str
    replica_id: int
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    # the submitting shell's environment, under ``env`` (as TorchX's local_cwd and slurm pass it);
    # its PATH goes after the agent's interpreter dir, so `python` stays the pool's (see procs.py)
    inherited_env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    max_retries: int = 0
    # optional: also append the raw output to these files (submitit's %j_%t_log.out/err)
    stdout_path: str | None = None
    stderr_path: str | None = None
    # optional: SIGUSR2 at timeout_s - signal_delay_s (checkpoint), then killed at timeout_s
    timeout_s: float | None = None
    signal_delay_s: float = 30.0
    # optional: an exit with this code means "run me again" (a requeue), not a failure
    requeue_code: int | None = None
    # optional: what it asks of its host (``resources.Resources``' fields): counted against the
    # host's capacity while it lives, and its GPUs are its own (CUDA_VISIBLE_DEVICES)
    resources: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        for what, name in (("app id", self.app_id), ("role", self.role)):  # (they name directories on the host)
            if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\0" in name:
                raise ValueError(f"{what} {name!r} cannot name a directory: no '/', not '.' or '..'")
        if not self.argv or not all(isinstance(a, str) for a in self.argv):
            raise ValueError("argv must be a non-empty list of strings")
        for env in (self.env, self.inherited_env):
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
                raise ValueError("env must map strings to strings")
