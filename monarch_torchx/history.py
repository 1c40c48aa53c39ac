"""App history that outlives agents, allocations and pools: how each replica ended, kept on disk.

Why: an agent knows how its replicas ended only while it lives. Once a pool idled out, was
`scancel`ed or stopped, asking the agents gave "host 0 is lost" for apps that had SUCCEEDED
long before, and `torchx status` of a stopped pool's apps said "no app". So the end of a replica
is written once it is known, next to the app's record in the pool's state dir:

    STATE_DIR/ended/APP/ROLE.K.json   one ReplicaEnd per replica that ended

by its agent as the replica ends (the state dir is on the client's file system for local pools
and the shared one on SLURM), and by any client that hears an agent report the end (for hosts
that do not share the client's files: Kubernetes). A recorded end is final: a later loss of the
host never rewrites it; only a new launch of the same replica (a start made again) removes it.

A stopped pool's state dir stays (apps, ends, logs) and is remembered under its name
(``$MONARCH_TORCHX_HOME/stopped/NAME.json``), so its apps still answer; stopped pools' dirs older than the
retention (``MONARCH_TORCHX_HISTORY_DAYS``, default 30) are pruned at the next pool stop.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import quote

from .private import private_dir, write_private_bytes
from .specs import TERMINAL, ReplicaState, ReplicaStatus

ENDED_DIR = "ended"
HISTORY_DAYS_ENV = "MONARCH_TORCHX_HISTORY_DAYS"
DEFAULT_HISTORY_DAYS = 30.0


@dataclass
class ReplicaEnd:
    """How one replica ended, as its agent saw it."""

    app_id: str
    role: str
    replica_id: int
    state: str  # one of specs.TERMINAL
    exit_code: int | None = None
    msg: str = ""
    attempts: int = 1
    started: float | None = None
    ended: float | None = None
    hostname: str = ""
    # not stored: seconds since it was recorded, on the file system's clock (``read_ends``)
    age_s: float | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ReplicaEnd:
        """The record, or ValueError for one that is not (a damaged or foreign file)."""
        known = {f.name for f in fields(cls)} - {"age_s"}
        try:
            end = cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as e:
            raise ValueError(str(e)) from None
        if (
            not isinstance(end.app_id, str)
            or not isinstance(end.role, str)
            or isinstance(end.replica_id, bool)
            or not isinstance(end.replica_id, int)
            or end.state not in TERMINAL
        ):
            raise ValueError(f"not an end: {data!r:.200}")
        return end

    @classmethod
    def from_status(cls, app_id: str, role: str, replica_id: int, st: ReplicaStatus) -> ReplicaEnd:
        """From an agent's replica status (``describe`` and ``list`` answer it), or a loss a client
        inferred; ValueError for one that is not an end."""
        return cls.from_json(
            {
                "app_id": app_id,
                "role": role,
                "replica_id": replica_id,
                "state": st.state.value,
                "exit_code": st.exit_code,
                "msg": st.msg,
                "attempts": st.attempts or 1,
                "started": st.started,
                "ended": st.ended,
                "hostname": st.hostname,
            }
        )

    def status(self) -> ReplicaStatus:
        """As an agent's answer for the replica reads (what ``apps.replica_states`` hands on)."""
        return ReplicaStatus(
            state=ReplicaState(self.state),
            exit_code=self.exit_code,
            msg=self.msg,
            attempts=self.attempts,
            started=self.started,
            ended=self.ended,
            hostname=self.hostname,
            recorded=True,
            age_s=self.age_s,
            app_id=self.app_id,
            role=self.role,
            replica_id=self.replica_id,
        )


def _app_dir(state_dir: Path, app_id: str) -> Path:
    return Path(state_dir) / ENDED_DIR / quote(app_id, safe="")


def end_path(state_dir: Path, app_id: str, role: str, replica_id: int) -> Path:
    return _app_dir(state_dir, app_id) / f"{quote(role, safe='')}.{int(replica_id)}.json"


def record_end(state_dir: Path, end: ReplicaEnd, checked: set | None = None) -> None:
    """Writes ``end`` (atomically, 0600); OSError if it cannot be (a full disk): the caller says so.
    ``checked``: the app dirs already made and checked by this caller (an agent: each app's dir is
    checked once, not at every end, on a shared file system where each check is a walk up)."""
    d = _app_dir(state_dir, end.app_id)
    if checked is None or d not in checked:
        private_dir(d, from_=Path(state_dir) / ENDED_DIR)
        if checked is not None:
            checked.add(d)
    data = {k: v for k, v in asdict(end).items() if k != "age_s"}
    write_private_bytes(end_path(state_dir, end.app_id, end.role, end.replica_id), json.dumps(data).encode())


def forget_end(state_dir: Path, app_id: str, role: str, replica_id: int) -> None:
    """The replica starts again (a launch made again): its earlier end no longer holds."""
    with contextlib.suppress(FileNotFoundError):
        end_path(state_dir, app_id, role, replica_id).unlink()


def forget_app(state_dir: Path, app_id: str) -> None:
    """``torchx delete``: the app's ends go with its record."""
    shutil.rmtree(_app_dir(state_dir, app_id), ignore_errors=True)


def read_ends(state_dir: Path, app_id: str, ages: bool = False) -> dict[tuple[str, int], ReplicaEnd]:
    """The recorded ends of an app's replicas, by (role, replica id); damaged files are skipped
    (the agents are asked about those replicas instead). ``ages``: each end's ``age_s`` too, on
    the file system's clock (a file is touched for it: only where the age is used)."""
    d = _app_dir(state_dir, app_id)
    out: dict[tuple[str, int], ReplicaEnd] = {}
    try:
        paths = list(d.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return out
    now = _fs_now(d) if ages else None
    for p in paths:
        if p.suffix != ".json":
            continue
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(p.read_text())
            if isinstance(data, dict):
                end = ReplicaEnd.from_json(data)
                if end.app_id == app_id:
                    if now is not None:
                        end.age_s = max(0.0, now - p.stat().st_mtime)
                    out[(end.role, end.replica_id)] = end
    return out


def _fs_now(d: Path) -> float | None:
    """ "Now" as the file system stamps files (an agent on another node wrote the ends): a file
    touched here, read back; None where it cannot be (read-only)."""
    try:
        fd = os.open(d / ".clock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        return None
    try:
        os.utime(fd)
        return os.fstat(fd).st_mtime
    except OSError:
        return None
    finally:
        os.close(fd)


# ------------------------------------------------------------ stopped pools


@dataclass
class StoppedPool:
    """A pool that was stopped, whose state dir (its apps, their ends and logs) is kept."""

    name: str
    scheduler: str
    state_dir: str
    stopped: float


def _stopped_path(stopped_dir: Path, name: str) -> Path:
    return Path(stopped_dir) / f"{name}.json"


def _write_stopped(stopped_dir: Path, name: str, pools: list[StoppedPool]) -> None:
    path = _stopped_path(stopped_dir, name)
    if not pools:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    private_dir(stopped_dir)
    write_private_bytes(path, json.dumps([asdict(p) for p in pools]).encode())


def remember_stopped(stopped_dir: Path, name: str, scheduler: str, state_dir: Path) -> None:
    """Pool ``name`` (state dir ``state_dir``) was stopped: its apps keep answering from there.
    ``stopped_dir``: the home's ``stopped/`` (not in ``pools/``: any name there may be a pool's)."""
    earlier = [p for p in stopped_pools(stopped_dir, name) if Path(p.state_dir) != Path(state_dir)]
    _write_stopped(stopped_dir, name, [StoppedPool(name, scheduler, str(state_dir), time.time()), *earlier])


def stopped_pools(stopped_dir: Path, name: str) -> list[StoppedPool]:
    """The earlier pools of this name that were stopped, newest first (none if unreadable)."""
    try:
        data = json.loads(_stopped_path(stopped_dir, name).read_text())
        return [StoppedPool(**p) for p in data if isinstance(p, dict)]
    except (OSError, ValueError, TypeError):
        return []


def stopped_names(stopped_dir: Path) -> list[str]:
    return sorted(p.stem for p in Path(stopped_dir).glob("*.json"))


def retention_s() -> float:
    try:
        days = float(os.environ.get(HISTORY_DAYS_ENV, DEFAULT_HISTORY_DAYS))
    except ValueError:
        days = DEFAULT_HISTORY_DAYS
    return max(0.0, days) * 86400.0


def prune_stopped(
    stopped_dir: Path,
    live_state_dirs: list[Path],
    now: float | None = None,
    skip: Path | None = None,
    names: list[str] | None = None,
) -> list[Path]:
    """Removes the state dirs of pools stopped longer ago than the retention (never one a live
    pool uses, one that holds a pool's secret again, nor ``skip``: the one being stopped now);
    returns them. The caller holds the lock of each name it prunes (``Registry.prune_stopped``)."""
    now = time.time() if now is None else now
    keep = retention_s()
    live = {Path(d) for d in live_state_dirs}
    removed: list[Path] = []
    for name in stopped_names(stopped_dir) if names is None else names:
        left = []
        for p in stopped_pools(stopped_dir, name):
            d = Path(p.state_dir)
            if not d.is_dir():
                continue
            if d in live or d == skip or now - p.stopped <= keep or (d / "token").exists():
                left.append(p)
            else:
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
        with contextlib.suppress(OSError):
            _write_stopped(stopped_dir, name, left)
    return removed


def prune_old_apps(state_dir: Path, now: float | None = None) -> int:
    """Forgets the apps of a pool's state dir (records, ends) older than the retention: a pool
    name reused for months keeps its state dir, and its apps would pile up there (their logs are
    bounded by the log limits). Returns how many."""
    now = time.time() if now is None else now
    keep = retention_s()
    n = 0
    for rec in (Path(state_dir) / "apps").glob("*.json"):
        with contextlib.suppress(OSError):
            if now - rec.stat().st_mtime > keep:
                rec.unlink()
                forget_app(state_dir, rec.stem)
                n += 1
    return n
