"""A host's side of syncfs: a chunk store on node-local disk and the generations built from it.

Each sync commits an immutable generation: a read-only tree materialized from chunks (files
unchanged since the previous generation are hard links to it, so a small change costs a small
commit), then the target path, a symlink, is switched to it with one atomic rename. Readers
never see a half-built tree, and files opened in an older generation keep working. Only the
current and the previous generation are kept; chunks no kept generation uses are removed once
they are an hour old (younger ones may belong to a sync still in flight).
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import blake3

from .manifest import Manifest

KEEP_GENERATIONS = 2
# an unreferenced chunk younger than this may belong to a sync still in flight: kept
GC_GRACE_S = 3600.0


class StoreError(Exception):
    """A one-line reason a host could not store or commit (disk full, bad chunk, bad target)."""


def _disk_error(e: OSError, what: str) -> StoreError:
    if e.errno == errno.ENOSPC:
        return StoreError(f"disk full while {what} ({e.filename or ''}); the previous generation is intact")
    return StoreError(f"{what} failed: {e.strerror or e}")


class ChunkStore:
    def __init__(self, root: Path):
        self.root = root
        self.pins: Dict[str, float] = {}  # chunks a sync in flight relies on -> when it said so
        self.manifest_chunks: Dict[Path, Tuple[int, set]] = {}  # a manifest file's chunks, by its mtime
        self.swept = 0.0
        self._have: Optional[set] = None
        self.chunks = root / "chunks"  # made on first use: a pool that never syncs leaves nothing on disk
        self.targets = root / "targets"

    def chunk_path(self, h: str) -> Path:
        if len(h) != 64 or not all(c in "0123456789abcdef" for c in h):
            raise StoreError(f"bad chunk name {h[:80]!r}")
        return self.chunks / h[:2] / h

    def present(self) -> set:
        """Every stored chunk's name, kept in memory (read once from disk, then updated by put
        and garbage collection): asking what is missing costs a set lookup per chunk."""
        if self._have is None:
            have: set = set()
            for sub in self.chunks.iterdir() if self.chunks.is_dir() else []:
                have.update(n for n in os.listdir(sub) if not n.startswith("."))
            self._have = have
        return self._have

    def missing(self, hashes: Iterable[str]) -> List[str]:
        """The chunks not stored here. The others are pinned: garbage collection spares them
        until the sync that is about to rely on them has committed (or for GC_GRACE_S)."""
        hashes = list(hashes)
        have = self.present()
        now = time.time()
        self.pins = {h: t for h, t in self.pins.items() if now - t < GC_GRACE_S}
        out = []
        for h in hashes:
            if h in have:
                self.pins[h] = now
            else:
                self.chunk_path(h)  # a name that could not be a chunk is refused here
                out.append(h)
        return out

    def put(self, chunks: List[Tuple[str, bytes]]) -> int:
        """Stores verified chunks; a chunk whose bytes do not hash to its name is refused whole."""
        for h, data in chunks:
            if blake3.blake3(data).hexdigest() != h:
                raise StoreError(f"chunk {h[:12]} does not match its hash (corrupted in transit); resend it")
        stored = 0
        for h, data in chunks:
            p = self.chunk_path(h)
            if p.exists():
                continue
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_name(f".{h}.{os.getpid()}")
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, p)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                raise _disk_error(e, f"storing chunk {h[:12]}") from None
            self.present().add(h)
            stored += len(data)
        return stored

    # ------------------------------------------------------------ generations

    def target_dir(self, target: Path) -> Path:
        return self.targets / hashlib.sha256(str(target).encode()).hexdigest()[:16]

    def generations(self, target: Path) -> List[int]:
        d = self.target_dir(target)
        return sorted(int(p.name[4:-9]) for p in d.glob("gen-*.manifest") if p.name[4:-9].isdigit()) if d.is_dir() else []

    def current(self, target: Path) -> Optional[int]:
        """The generation ``target`` shows: a symlink's (materialized) or the one FUSE serves."""
        try:
            base = os.path.basename(os.readlink(target))
            return int(base[4:]) if base.startswith("gen-") and base[4:].isdigit() else None
        except OSError:
            pass
        try:
            return int((self.target_dir(target) / "current").read_text())
        except (OSError, ValueError):
            return None

    def unchanged(self, target: Path, digest: str) -> Optional[int]:
        """The current generation, when its manifest has this digest (a no-op sync commits nothing)."""
        n = self.current(target)
        if n is None:
            return None
        try:
            return n if (self.target_dir(target) / f"gen-{n}.digest").read_text() == digest else None
        except OSError:
            return None

    def commit(self, target: Path, manifest: Manifest, fuse: bool) -> int:
        """Records the next generation of ``target``; materializes it and switches the symlink
        unless ``fuse`` (then the caller switches the mounted file system to it)."""
        if os.path.lexists(target) and not os.path.islink(target) and not fuse:
            raise StoreError(f"{target} exists and is not a syncfs target (a symlink to a generation): "
                             "remove it or choose another --to")
        have = self.present()
        missing = [h for h in manifest.chunk_sizes() if h not in have]
        if missing:
            raise StoreError(f"{len(missing)} chunk(s) missing (first {missing[0][:12]}): the sync did not finish")
        gens = self.generations(target)
        n = (gens[-1] if gens else 0) + 1
        tdir = self.target_dir(target)
        tdir.mkdir(parents=True, exist_ok=True)
        try:
            data = manifest.dumps()
            _write_atomic(tdir / f"gen-{n}.manifest", data)
            _write_atomic(tdir / f"gen-{n}.digest", manifest_digest(data).encode())
        except OSError as e:
            raise _disk_error(e, f"recording generation {n} of {target}") from None
        if fuse:
            try:
                _write_atomic(tdir / "current", str(n).encode())
            except OSError as e:
                raise _disk_error(e, f"switching {target} to generation {n}") from None
            return n
        for stale in tdir.glob("gen-*.tmp"):  # left by a commit that died (host killed mid-commit)
            _rmtree(stale)
        build = tdir / f"gen-{n}.tmp"
        prev = self.current(target)
        prev_dir = tdir / f"gen-{prev}" if prev else None
        prev_files = _previous_files(tdir / f"gen-{prev}.manifest") if prev_dir and prev_dir.is_dir() else {}
        try:
            _materialize(build, manifest, self, prev_dir, prev_files)
            _read_only(build, manifest)
            final = tdir / f"gen-{n}"
            os.rename(build, final)
        except OSError as e:
            _rmtree(build)
            (tdir / f"gen-{n}.manifest").unlink(missing_ok=True)
            raise _disk_error(e, f"building generation {n} of {target}") from None
        target.parent.mkdir(parents=True, exist_ok=True)
        link = target.with_name(f".{target.name}.syncfs-{os.getpid()}")
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(final, link)
        os.replace(link, target)  # the switch: atomic for every reader
        return n

    def collect(self, target: Path, sweep_every_s: float = 60.0) -> None:
        """Keeps the newest generations of ``target``; now and then, drops chunks that no kept
        generation uses, no sync in flight pinned, and that are older than GC_GRACE_S."""
        tdir = self.target_dir(target)
        dropped = self.generations(target)[:-KEEP_GENERATIONS]
        for g in dropped:
            _rmtree(tdir / f"gen-{g}")
            (tdir / f"gen-{g}.manifest").unlink(missing_ok=True)
            (tdir / f"gen-{g}.digest").unlink(missing_ok=True)
        if not dropped or time.time() - self.swept < sweep_every_s:
            return
        self.swept = time.time()
        used = set(self.pins)
        for man in self.targets.glob("*/gen-*.manifest"):
            try:
                mtime = man.stat().st_mtime_ns
                cached = self.manifest_chunks.get(man)
                if cached is None or cached[0] != mtime:
                    cached = self.manifest_chunks[man] = (mtime, set(Manifest.loads(man.read_bytes()).chunk_sizes()))
                used |= cached[1]
            except (OSError, ValueError, EOFError):
                return  # unreadable: keep everything rather than delete what may be in use
        self.manifest_chunks = {m: v for m, v in self.manifest_chunks.items() if m.exists()}
        old = time.time() - GC_GRACE_S
        for sub in self.chunks.iterdir() if self.chunks.is_dir() else []:
            for name in os.listdir(sub):
                if name not in used and not name.startswith("."):
                    p = sub / name
                    try:
                        if p.stat().st_mtime < old:
                            p.unlink()
                            self.present().discard(name)
                    except FileNotFoundError:
                        pass


def manifest_digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def _previous_files(manifest_path: Path) -> Dict[str, Tuple[Tuple[Tuple[str, int], ...], int]]:
    try:
        man = Manifest.loads(manifest_path.read_bytes())
    except (OSError, ValueError, EOFError):
        return {}
    return {e.path: (tuple(e.chunks), e.mode) for e in man.entries if e.kind == "f"}


def _safe(rel: str) -> str:
    parts = rel.split("/")
    if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise StoreError(f"unsafe path in manifest: {rel!r}")
    return rel


def _materialize(build: Path, manifest: Manifest, store: ChunkStore, prev_dir: Optional[Path],
                 prev_files: Dict[str, Tuple[Tuple[Tuple[str, int], ...], int]]) -> None:
    build.mkdir()
    for e in manifest.entries:
        dst = build / _safe(e.path)
        if e.kind == "d":
            dst.mkdir(exist_ok=True)
        elif e.kind == "l":
            os.symlink(e.target, dst)
        elif e.kind == "h":
            os.link(build / _safe(e.target), dst)
        elif e.kind == "f":
            if prev_dir is not None and prev_files.get(e.path) == (tuple(e.chunks), e.mode):
                os.link(prev_dir / e.path, dst)  # unchanged: the same read-only inode
                continue
            with open(dst, "wb") as out:
                for h, _ in e.chunks:
                    with open(store.chunk_path(h), "rb") as src:
                        shutil.copyfileobj(src, out, 1 << 20)
            os.chmod(dst, e.mode & ~0o222)
            os.utime(dst, ns=(e.mtime_ns, e.mtime_ns))  # Python checks .pyc files against their source's mtime


def _read_only(build: Path, manifest: Manifest) -> None:
    for e in sorted((e for e in manifest.entries if e.kind == "d"), key=lambda e: -e.path.count("/")):
        os.chmod(build / e.path, (e.mode | 0o500) & ~0o222)
    os.chmod(build, 0o555)


def _rmtree(path: Path) -> None:
    """Removes a generation (read-only directories included)."""
    if not path.exists():
        return
    for d, dirs, _ in os.walk(path):
        for x in dirs:
            try:
                os.chmod(os.path.join(d, x), 0o700)
            except OSError:
                pass
    os.chmod(path, 0o700)
    shutil.rmtree(path, ignore_errors=True)
