"""What was synced to a pool, remembered so that hosts which join later get it too.

Each sync that some host committed is remembered in the pool's state dir (``syncs/``, one file
per target, 0600): its source, target and exclusions. When hosts join (a grow: `pool resize`, a
run with ``grow=True``, a SLURM pool's allocator), ``replay_syncs`` syncs each remembered source,
as it is now, to the joining hosts only, before the pool's queue is handed them: synced targets
reach new hosts before they take work. A source that changed since it was synced gives the new
hosts what it holds now (said, with what to do); one that is gone is skipped (said too).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import MonarchError
from ..private import PrivatePathError, private_dir
from ..registry import write_private

SYNCS_DIR = "syncs"


@dataclass(frozen=True)
class SyncRecord:
    """One target as it was last synced to the pool."""

    src: str  # absolute, as the client saw it
    target: str
    exclude: list[str] = field(default_factory=list)
    digest: str = ""  # the manifest it committed (a replay says when the source changed since)


def _path(state_dir: str | Path, target: str) -> Path:
    return Path(state_dir) / SYNCS_DIR / f"{hashlib.sha256(target.encode()).hexdigest()[:16]}.json"


def remember(state_dir: str | Path, record: SyncRecord) -> None:
    """Best effort: a sync that worked is not failed because its memo could not be written."""
    try:
        private_dir(Path(state_dir) / SYNCS_DIR, from_=Path(state_dir))
        write_private(_path(state_dir, record.target), json.dumps(asdict(record)))
    except (OSError, PrivatePathError):
        pass


def remembered(state_dir: str | Path) -> list[SyncRecord]:
    out = []
    for p in sorted((Path(state_dir) / SYNCS_DIR).glob("*.json")):
        try:
            out.append(SyncRecord(**json.loads(p.read_text())))
        except (OSError, ValueError, TypeError):
            continue  # (unreadable: that target is synced again by hand)
    return out


def replay_syncs(pool: Any, hosts: list[int], progress: Callable[[str], None]) -> None:
    """Syncs every remembered target to ``hosts`` (see the module's docstring). Raises
    MonarchError, naming the host, when one of them did not get one: the caller gives them back."""
    from .client import sync

    for rec in remembered(pool.record.state_dir):
        where = f"host(s) {hosts[0]}-{hosts[-1]}" if len(hosts) > 1 else f"host {hosts[0]}"
        if not os.path.isdir(rec.src):
            progress(f"sync {rec.src} -> {rec.target} not replayed to {where}: the source is gone; sync it again")
            continue
        report = sync(pool, rec.src, rec.target, hosts=hosts, exclude=rec.exclude, remember=False)
        failed = [h.error for h in report.hosts if not h.ok]
        if failed:
            raise MonarchError(f"sync {rec.src} -> {rec.target} did not reach {'; '.join(failed)}")
        changed = rec.digest and report.digest and report.digest != rec.digest
        progress(
            f"sync {rec.src} -> {rec.target} replayed to {where} ({report.files} file(s))"
            + ("; the source changed since it was synced: sync it again to give every host the same" if changed else "")
        )
