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
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import quote

from .private import private_dir, write_private_bytes
from .specs import TERMINAL

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
    exit_code: Optional[int] = None
    msg: str = ""
    attempts: int = 1
    started: Optional[float] = None
    ended: Optional[float] = None
    hostname: str = ""
    # not stored: seconds since it was recorded, on the file system's clock (``read_ends``)
    age_s: Optional[float] = field(default=None, compare=False, repr=False)

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "ReplicaEnd":
        """The record, or ValueError for one that is not (a damaged or foreign file)."""
        known = {f.name for f in fields(cls)} - {"age_s"}
        try:
            end = cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as e:
            raise ValueError(str(e)) from None
        if end.state not in TERMINAL or not isinstance(end.replica_id, int):
            raise ValueError(f"not an end: state {end.state!r}")
        return end

    def status(self) -> Dict[str, Any]:
        """As an agent's replica status reads (what ``apps.replica_states`` hands on)."""
        return {"state": self.state, "exit_code": self.exit_code, "msg": self.msg, "attempts": self.attempts,
                "started": self.started, "ended": self.ended, "hostname": self.hostname, "recorded": True,
                "age_s": self.age_s}


def _app_dir(state_dir: Path, app_id: str) -> Path:
    return Path(state_dir) / ENDED_DIR / quote(app_id, safe="")


def end_path(state_dir: Path, app_id: str, role: str, replica_id: int) -> Path:
    return _app_dir(state_dir, app_id) / f"{quote(role, safe='')}.{int(replica_id)}.json"


def record_end(state_dir: Path, end: ReplicaEnd) -> None:
    """Writes ``end`` (atomically, 0600); OSError if it cannot be (a full disk): the caller says so."""
    d = _app_dir(state_dir, end.app_id)
    private_dir(d, from_=Path(state_dir) / ENDED_DIR)
    data = {k: v for k, v in asdict(end).items() if k != "age_s"}
    write_private_bytes(end_path(state_dir, end.app_id, end.role, end.replica_id), json.dumps(data).encode())


def forget_end(state_dir: Path, app_id: str, role: str, replica_id: int) -> None:
    """The replica starts again (a launch made again): its earlier end no longer holds."""
    with contextlib.suppress(FileNotFoundError):
        end_path(state_dir, app_id, role, replica_id).unlink()


def forget_app(state_dir: Path, app_id: str) -> None:
    """``torchx delete``: the app's ends go with its record."""
    shutil.rmtree(_app_dir(state_dir, app_id), ignore_errors=True)


def read_ends(state_dir: Path, app_id: str) -> Dict[Tuple[str, int], ReplicaEnd]:
    """The recorded ends of an app's replicas, by (role, replica id); damaged files are skipped
    (the agents are asked about those replicas instead)."""
    d = _app_dir(state_dir, app_id)
    out: Dict[Tuple[str, int], ReplicaEnd] = {}
    try:
        paths = list(d.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return out
    now = _fs_now(d)
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


def _fs_now(d: Path) -> Optional[float]:
    """"Now" as the file system stamps files (an agent on another node wrote the ends): a file
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


def _write_stopped(stopped_dir: Path, name: str, pools: List[StoppedPool]) -> None:
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


def stopped_pools(stopped_dir: Path, name: str) -> List[StoppedPool]:
    """The earlier pools of this name that were stopped, newest first (none if unreadable)."""
    try:
        data = json.loads(_stopped_path(stopped_dir, name).read_text())
        return [StoppedPool(**p) for p in data if isinstance(p, dict)]
    except (OSError, ValueError, TypeError):
        return []


def stopped_names(stopped_dir: Path) -> List[str]:
    return sorted(p.stem for p in Path(stopped_dir).glob("*.json"))


def retention_s() -> float:
    try:
        days = float(os.environ.get(HISTORY_DAYS_ENV, DEFAULT_HISTORY_DAYS))
    except ValueError:
        days = DEFAULT_HISTORY_DAYS
    return max(0.0, days) * 86400.0


def _newest_mtime(d: Path) -> float:
    newest = 0.0
    for root, dirs, files in os.walk(d):
        for n in (*dirs, *files):
            with contextlib.suppress(OSError):
                newest = max(newest, os.lstat(os.path.join(root, n)).st_mtime)
    return newest


def prune_stopped(stopped_dir: Path, live_state_dirs: List[Path], now: Optional[float] = None) -> List[Path]:
    """Removes the state dirs of stopped pools untouched for longer than the retention (never one
    a live pool uses, nor one that holds a pool's secret again); returns them."""
    now = time.time() if now is None else now
    keep = retention_s()
    live = {Path(d) for d in live_state_dirs}
    removed: List[Path] = []
    for name in stopped_names(stopped_dir):
        left = []
        for p in stopped_pools(stopped_dir, name):
            d = Path(p.state_dir)
            if d in live:
                left.append(p)
            elif d.is_dir() and not (now - _newest_mtime(d) > keep and not (d / "token").exists()):
                left.append(p)
            elif d.is_dir():
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
        with contextlib.suppress(OSError):
            _write_stopped(stopped_dir, name, left)
    return removed
