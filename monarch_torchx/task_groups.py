"""Tasks as calls in kept workers: what a client hands the pool for submitit's worker mode
(``monarch_workers=True``), and what the pool and its workers say to each other about it.

A *task group* is the jobs of one executor, run by *workers*: long-lived processes that the pool's
queue (``agent/queue.py``) starts like any queued app, each holding one task's ask of its host, and
that take one task after another from host 0's agent (``agent/tasks.py``), running each in
process as submitit's ``_submit`` would. A task then costs a call, not a process: no fork, no
per-task app record. What a task gives up by it is said in ``docs/placement.md``.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass, field
from typing import Any

from .specs import CANCELLED, FAILED, PENDING, SUCCEEDED, LaunchSpec, known_fields

WORKER_ROLE = "worker"
# what a worker's environment names: where the group's holder listens and which group it serves
HOLDER_ENV = "MONARCH_TORCHX_TASKS_HOLDER"  # the address of host 0's agent (a host, or a unix socket's)
HOLDER_PORT_ENV = "MONARCH_TORCHX_TASKS_HOLDER_PORT"
HOLDER_IDENTITY_ENV = "MONARCH_TORCHX_TASKS_IDENTITY"
GROUP_ENV = "MONARCH_TORCHX_TASKS_GROUP"
WORKER_ENV = "MONARCH_TORCHX_TASKS_WORKER"
FOLDER_ENV = "MONARCH_TORCHX_TASKS_FOLDER"  # submitit's folder (as the executor was given it: %j stays)
TERMINAL_TASK_STATES = (SUCCEEDED, FAILED, CANCELLED)
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # (a group's id names its files on the host)


def _check_id(what: str, value: str) -> None:
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise ValueError(f"{what} {value!r}: 1-64 letters, digits, '_' or '-'")


@dataclass
class Task:
    """One submitit job of a group: its id (submitit's job id), the environment its function sees
    (``MONARCH_SUBMITIT_*``, as a process of its own would), and where its output goes."""

    task_id: str
    env: dict[str, str]
    stdout_path: str
    stderr_path: str

    def __post_init__(self) -> None:
        _check_id("task id", self.task_id)

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Task:
        return cls(**known_fields(cls, d))


@dataclass
class TaskGroup:
    """The jobs of one executor in worker mode. ``worker``: the template of its workers (argv,
    cwd, environment, and what each asks of its host: ``resources``), ``folder``: submitit's;
    ``timeout_s``: how long one task may run (its worker is then ended, and replaced)."""

    group_id: str
    name: str
    folder: str
    worker: LaunchSpec
    timeout_s: float
    max_workers: int = 0  # 0: as many as the pool's hosts fit
    submitted: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        _check_id("task group id", self.group_id)

    def to_wire(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["worker"] = dict(vars(self.worker))
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> TaskGroup:
        d = known_fields(cls, d)
        d["worker"] = LaunchSpec(**d["worker"])
        return cls(**d)


@dataclass
class TaskStatus:
    """What became of one task: PENDING, RUNNING, or how it ended (with why, when it failed)."""

    task_id: str
    state: str = PENDING
    msg: str = ""
    started: float | None = None
    ended: float | None = None
    worker: str = ""  # the worker (its app id) that ran or runs it
    forgotten: bool = False  # its group ended and was forgotten by the holder: the state is not known

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_TASK_STATES

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> TaskStatus:
        return cls(**known_fields(cls, d))


@dataclass
class Assignment:
    """A holder's answer to a worker asking for work: the next task, or none (the worker exits,
    giving its slot back): ``why`` says which (the group is done, cancelled, or idle)."""

    task: Task | None
    why: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {"task": self.task.to_wire() if self.task else None, "why": self.why}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Assignment:
        return cls(Task.from_wire(d["task"]) if d.get("task") else None, d.get("why", ""))
