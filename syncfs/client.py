"""The client side of ``monarch-torchx sync``: scan, send each host only what it lacks, commit.

Every host is fed in parallel over its own authenticated connection: first the list of chunk
hashes (the host answers with those it lacks), then the missing chunks in batches, then the
manifest, which the host commits as a new generation. A host that fails (dead, disk full) is
named in the report; the others still commit. A batch the host finds corrupted (its bytes do not
hash to their names) is sent again.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional

from ..errors import MonarchError
from ..registry import home
from .manifest import ChunkSource, HashCache, scan

BATCH_BYTES = 8 << 20
RETRIES = 3


@dataclass
class HostResult:
    index: int
    ok: bool
    generation: Optional[int] = None
    path: str = ""
    bytes_sent: int = 0
    error: str = ""


@dataclass
class SyncReport:
    """What `sync --json` prints."""

    files: int
    bytes: int
    bytes_sent: int
    bytes_skipped: int
    seconds: float
    generation: Optional[int]
    hosts: List[HostResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(h.ok for h in self.hosts)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def read_chunk(src: ChunkSource) -> bytes:
    with open(src.path, "rb") as f:
        f.seek(src.offset)
        return f.read(src.size)


class _Progress:
    """Calls ``say`` at most twice a second with files, bytes, rate and each host's state."""

    def __init__(self, say: Callable[[str], None], total: int, hosts: List[int]):
        self.say, self.total, self.start = say, total, time.time()
        self.sent = {i: 0 for i in hosts}
        self.state = {i: "checking" for i in hosts}
        self.last = 0.0
        self.lock = threading.Lock()

    def update(self, i: int, sent: int = 0, state: Optional[str] = None, force: bool = False) -> None:
        with self.lock:
            self.sent[i] += sent
            if state:
                self.state[i] = state
            now = time.time()
            if not force and now - self.last < 0.5:
                return
            self.last = now
            total = sum(self.sent.values())
            rate = total / max(now - self.start, 1e-6) / 1e6
            hosts = " ".join(f"h{i}:{s}" for i, s in sorted(self.state.items()))
            self.say(f"sync: {total / 1e6:.1f} MB sent, {rate:.0f} MB/s; {hosts}")


def _cache_for(src: str) -> HashCache:
    key = hashlib.sha256(os.path.realpath(src).encode()).hexdigest()[:24]
    return HashCache(home() / "syncfs-cache" / f"{key}.json")


def sync(pool: Any, src: str, target: str, hosts: Optional[List[int]] = None,
         progress: Callable[[str], None] = lambda _m: None, timeout: float = 600.0) -> SyncReport:
    """Syncs directory ``src`` to ``target`` on every host of ``pool`` (or ``hosts``)."""
    t0 = time.time()
    if not os.path.exists(src):
        raise MonarchError(f"sync source {src!r} does not exist")
    if not os.path.isdir(src):
        raise MonarchError(f"sync source {src!r} is not a directory (sync a directory holding it)")
    if not target:
        raise MonarchError("no target: pass --to PATH (relative paths land in the pool's own sync area)")
    indices = list(range(len(pool.hosts))) if hosts is None else hosts
    bad = [i for i in indices if not 0 <= i < len(pool.hosts)]
    if bad:
        raise MonarchError(f"pool {pool.name!r} has no host(s) {bad} (it has {len(pool.hosts)})")
    cache = _cache_for(src)
    manifest, sources = scan(src, cache)
    cache.save()
    sizes = manifest.chunk_sizes()
    meter = _Progress(progress, sum(sizes.values()), indices)
    text = manifest.to_json()

    def one(i: int) -> HostResult:
        res = HostResult(i, False)
        try:
            with pool.connect(i, timeout=10.0) as c:
                c.settimeout(timeout)
                missing = c.call("syncfs.missing", hashes=list(sizes), target=target)
                meter.update(i, state=f"sending {len(missing)} chunk(s)")
                batch: List[Any] = []
                size = 0
                for h in missing + [None]:
                    if h is not None:
                        batch.append(h)
                        size += sizes[h]
                    if batch and (h is None or size >= BATCH_BYTES):
                        _send(c, batch, sources)
                        res.bytes_sent += size
                        meter.update(i, size)
                        batch, size = [], 0
                meter.update(i, state="committing")
                out = c.call("syncfs.commit", target=target, manifest=text)
                res.ok, res.generation, res.path = True, out["generation"], out["path"]
                meter.update(i, state=f"gen {out['generation']}")
        except Exception as e:  # one host's failure is reported, the others carry on
            res.error = str(e) or type(e).__name__
            meter.update(i, state="FAILED")
        return res

    with ThreadPoolExecutor(max_workers=min(16, max(1, len(indices)))) as ex:
        results = list(ex.map(one, indices))
    meter.update(indices[0] if indices else 0, force=True)
    sent = sum(r.bytes_sent for r in results)
    total = manifest.bytes * len(indices)
    gens = {r.generation for r in results if r.ok}
    return SyncReport(files=sum(1 for e in manifest.entries if e.kind in ("f", "h", "l")), bytes=manifest.bytes,
                      bytes_sent=sent, bytes_skipped=max(0, total - sent), seconds=round(time.time() - t0, 3),
                      generation=max(gens) if gens else None, hosts=results)


def _send(client: Any, batch: List[str], sources: Dict[str, ChunkSource]) -> None:
    from ..wire import RemoteError

    for attempt in range(RETRIES):
        chunks = [(h, read_chunk(sources[h])) for h in batch]
        try:
            client.call("syncfs.put", chunks=chunks)
            return
        except RemoteError as e:
            if "does not match its hash" not in str(e) or attempt == RETRIES - 1:
                raise
