"""The messages between an agent's launcher and its fork servers, as named types.

ctl (launcher -> fork server): ``Start`` (a program) or ``StartServer`` (another fork server),
each framed after a marker byte that carries the new process's fds (SCM_RIGHTS).
evt (fork server -> launcher): ``Ready`` once, then ``Started`` or ``StartFailed`` for each
request (by its token), and ``Exited`` for each program that ends.

Both ends are the same install (the agent starts its fork servers), over a socket pair nobody
else holds; kept apart from ``forkserver`` because that one runs as ``__main__``, where pickled
classes could not be found again by the launcher.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class StartMode(str, Enum):
    PYTHON = "python"  # this interpreter: the program runs in a forked child
    EXEC = "exec"  # any other program: posix_spawn (or fork + exec)


@dataclass
class Start:
    """Start one program with the request's fds as its stdout and stderr (and a third, when
    sent, as its stdin: a terminal's, ``agent/shell.py``)."""

    token: int
    mode: StartMode
    argv: list[str]
    env: dict[str, str]
    cwd: str | None = None
    exe: str = ""  # (an exec's program, resolved on the request's PATH by the fork server)


@dataclass
class StartServer:
    """Fork another fork server from this one (the request's fds: its ctl and evt)."""

    token: int
    name: str
    preloads: list[str] = field(default_factory=list)
    warm_imports: list[str] = field(default_factory=list)


@dataclass
class Ready:
    """The fork server serves: what it imported, what it could not, and how long that took."""

    preloaded: list[str]
    failed: dict[str, str]  # module -> the exception, one line
    seconds: float


@dataclass
class Started:
    token: int
    pid: int


@dataclass
class StartFailed:
    token: int
    error: str  # why, as the OS says it


@dataclass
class Exited:
    pid: int
    code: int  # as os.waitstatus_to_exitcode: negative for a signal
