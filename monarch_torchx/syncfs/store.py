"""A host's side of syncfs: a chunk store on node-local disk and the generations built from it.

Chunks are not files of their own: every stored batch writes its new chunks end to end to one
pack file, with an index beside it. Creating a file per chunk cost a host more than receiving,
verifying and forwarding it (most of a virtualenv's 40k paths are small files, and on a node
whose file system keeps no journal, ext4 scans past recently deleted inodes at every creation).
A pack is deleted when no chunk in it is used any more, and one that is mostly unused is
rewritten with the chunks still used, so an edited file's old chunks do not keep their
neighbours' space. Chunk files an earlier version of the store wrote are still read and
collected.

Each sync commits an immutable generation: a read-only tree materialized from chunks (files
unchanged since the previous generation are hard links to it, so a small change costs a small
commit), then the target path, a symlink, is switched to it with one atomic rename. Readers
never see a half-built tree, and files opened in an older generation keep working. Only the
current and the previous generation are kept; chunks no kept generation uses are removed once
they are an hour old (younger ones may belong to a sync still in flight): after each commit, and
now and then from the agent (``sweep``), so an aborted sync to a target that never committed does
not keep its chunks either.

A chunk is trusted by its name only once its bytes were hashed in this agent's life: those a
sync stores are hashed on arrival, those found on disk (a store an earlier agent of the same pool
left) when a sync first relies on one.
"""

from __future__ import annotations

import errno
import hashlib
import marshal
import os
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable

import blake3

from ..private import PrivatePathError, open_private, private_dir, write_private_bytes
from .manifest import Manifest

KEEP_GENERATIONS = 2
# a pack whose used chunks fill less than this share of it is rewritten with only those
COMPACT_BELOW = 0.5
# an unreferenced chunk younger than this may belong to a sync still in flight: kept
GC_GRACE_S = float(os.environ.get("MONARCH_TORCHX_SYNC_GC_GRACE_S", "3600"))
MAX_SESSIONS = 64  # syncs whose packs a store remembers (see ChunkStore.session_packs)


class StoreError(ValueError):
    """A one-line reason a host could not store or commit (disk full, bad chunk, bad target)."""


class ChunkCorrupt(StoreError):
    """A chunk's bytes do not hash to its name (damaged in transit): sending it again may work."""


class DiskFull(StoreError):
    """The store's disk is full: the sync fails here, and what it had stored is given back at once."""


def _disk_error(e: OSError, what: str) -> StoreError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFull(f"disk full while {what} ({e.filename or ''}); the previous generation is intact")
    return StoreError(f"{what} failed: {e.strerror or e}")


class PackIndex:
    """Where each packed chunk lies: name -> (pack file name, offset, size). Read from the packs'
    index files, and grown with new ones; the FUSE server keeps one of its own and refreshes it
    when a chunk it is asked for is not in it yet."""

    def __init__(self, packs: Path):
        self.packs = packs
        self.where: dict[str, tuple[str, int, int]] = {}
        self.rows: dict[str, list[tuple[str, int, int]]] = {}  # pack name -> its chunks

    def refresh(self) -> None:
        try:
            names = os.listdir(self.packs)
        except FileNotFoundError:
            return
        for name in names:
            pack = name[:-4] + ".pack"
            if not name.endswith(".idx") or name.startswith(".") or pack in self.rows:
                continue
            try:
                rows = marshal.loads((self.packs / name).read_bytes())
            except (OSError, ValueError, EOFError):
                continue  # unreadable: its chunks count as missing and are sent again
            self.add(pack, rows)

    def add(self, pack: str, rows: list[tuple[str, int, int]]) -> None:
        self.rows[pack] = rows
        for h, off, n in rows:
            self.where.setdefault(h, (pack, off, n))

    def forget(self, h: str) -> None:
        """Drops a chunk whose bytes proved bad, every copy of it: no rebuild of ``where`` brings
        it back, and the copy that is sent again is the one served."""
        self.where.pop(h, None)
        for pack, rows in self.rows.items():
            if any(r[0] == h for r in rows):
                self.rows[pack] = [r for r in rows if r[0] != h]

    def remove(self, packs: list[str]) -> set:
        """Forgets packs; returns the chunks no remaining pack holds. ``where`` is replaced whole,
        never emptied in place: a reader without the lock sees the old map or the new one."""
        affected = {h for p in packs for h, _, _ in self.rows.pop(p, [])}
        where: dict[str, tuple[str, int, int]] = {}
        for pack, rows in self.rows.items():
            for h, off, n in rows:
                where.setdefault(h, (pack, off, n))
        self.where = where
        return affected - where.keys()


class ChunkStore:
    def __init__(self, root: Path, private_from: Path | None = None):
        """``private_from``: the highest directory above ``root`` that must be ours alone too
        (default: root's parent), checked before anything is written."""
        self.root = root
        self.private_from = private_from or root.parent
        self.pins: dict[str, float] = {}  # chunks a sync in flight relies on -> when it said so
        # the packs each sync in flight stored, so a sync that fails gives their space back at once
        # (``give_back``) instead of after GC_GRACE_S; the oldest are forgotten past MAX_SESSIONS
        self.session_packs: OrderedDict[str, list[str]] = OrderedDict()
        self.manifest_chunks: dict[Path, tuple[int, set]] = {}  # a manifest file's chunks, by its mtime
        self.swept = 0.0
        self._have: set | None = None
        self._unverified: set = set()  # found on disk, not hashed yet in this life
        self._index: PackIndex | None = None
        self._dirs: set = set()  # chunk directories known to exist
        self.lock = threading.Lock()  # the pack index: stores and sweeps run in different threads
        self.commits = 0  # generations committed: a sweep that saw fewer deletes nothing (see committed)
        self._sweeping = threading.Lock()  # one sweep at a time (after a commit, and the agent's own)
        self.chunks = root / "chunks"  # made on first use: a pool that never syncs leaves nothing on disk
        self.packs = root / "packs"
        self.targets = root / "targets"

    def make_dir(self, d: Path) -> None:
        """Makes a directory of the store; the store's root (and its parent) must be ours alone.

        On a shared node another user could have made the root first, to read what we sync or
        to plant a chunk under a hash we will trust: such a root is refused, in one line.
        """
        if d in self._dirs:
            return
        if self.root not in self._dirs:
            try:
                private_dir(self.root, from_=self.private_from)
            except PrivatePathError as e:
                raise StoreError(f"refusing the sync store: {e}") from None
            self._dirs.add(self.root)
        private_dir(d, check=False)
        self._dirs.add(d)

    def chunk_path(self, h: str) -> Path:
        if len(h) != 64 or not all(c in "0123456789abcdef" for c in h):
            raise StoreError(f"bad chunk name {h[:80]!r}")
        return self.chunks / h[:2] / h

    def present(self) -> set:
        """Every stored chunk's name, kept in memory (read once from disk, then updated by put
        and garbage collection): asking what is missing costs a set lookup per chunk."""
        if self._have is None:
            have: set = set(self.index().where)
            for sub in self.chunks.iterdir() if self.chunks.is_dir() else []:
                have.update(n for n in os.listdir(sub) if not n.startswith("."))
            self._unverified = set(have)
            self._have = have
        return self._have

    def _verified(self, h: str) -> bool:
        """Hashes a chunk found on disk the first time a sync would rely on it; one whose bytes
        do not match its name is forgotten (and sent again), never served."""
        try:
            f, off, n = self.open_chunk(h)
            with f:
                f.seek(off)
                data = f.read() if n is None else f.read(n)
            good = blake3.blake3(data).hexdigest() == h
        except (OSError, StoreError):
            good = False
        with self.lock:
            self._unverified.discard(h)
            if not good:
                self.present().discard(h)
                self.index().forget(h)
                if self.chunks in self.chunk_path(h).parents:
                    self.chunk_path(h).unlink(missing_ok=True)
        return good

    def index(self) -> PackIndex:
        if self._index is None:
            self._index = PackIndex(self.packs)
            self._index.refresh()
        return self._index

    def open_chunk(self, h: str) -> tuple[Any, int, int | None]:
        """The file holding chunk ``h``, open, where in it the chunk starts, and its size in a
        pack (None: a file of its own). Found and opened under the lock a pack's rewrite deletes
        the old pack under: an open pack stays readable."""
        with self.lock:
            packed = self.index().where.get(h)
            if packed is None:
                return open(self.chunk_path(h), "rb"), 0, None
            return open(self.packs / packed[0], "rb"), packed[1], packed[2]

    def committed(self, chunks: Iterable[str]) -> None:
        """A generation using ``chunks`` was committed: their pins are not needed any more (its
        manifest protects them). A sweep that read the manifests before this deletes nothing."""
        with self.lock:
            self.commits += 1
            for h in chunks:
                self.pins.pop(h, None)

    def missing(self, hashes: Iterable[str]) -> list[str]:
        """The chunks not stored here. The others are pinned: garbage collection spares them
        until the sync that is about to rely on them has committed (or for GC_GRACE_S)."""
        hashes = list(hashes)
        have = self.present()
        for h in [h for h in hashes if h in self._unverified]:
            self._verified(h)
        now = time.time()
        out = []
        with self.lock:  # a sweep re-checks the pins under it before it deletes anything
            self.pins = {h: t for h, t in self.pins.items() if now - t < GC_GRACE_S}
            for h in hashes:
                if h in have:
                    self.pins[h] = now
                else:
                    self.chunk_path(h)  # a name that could not be a chunk is refused here
                    out.append(h)
        return out

    def put(self, index: list[tuple[str, int]], data: Any, session: str = "") -> int:
        """Stores a batch of verified chunks (``data``: those of ``index`` end to end); a batch with
        a chunk whose bytes do not hash to its name is refused whole. ``session``: the sync it
        belongs to; chunks of the batch already here are pinned for it, like those ``missing``
        found, so a failed sync giving back its packs never takes one another sync relies on."""
        view = memoryview(data).cast("B")
        if sum(n for _, n in index) != view.nbytes:
            raise StoreError(f"a batch of {view.nbytes} bytes does not hold the {len(index)} chunk(s) it names")
        chunks, off = [], 0
        for h, n in index:
            chunk = view[off : off + n]
            off += n
            if blake3.blake3(chunk).hexdigest() != h:
                raise ChunkCorrupt(f"chunk {h[:12]} does not match its hash (corrupted in transit); resend it")
            chunks.append((h, chunk))
        have = self.present()
        new = {h: data for h, data in chunks if h not in have}
        if session and len(new) < len(chunks):
            now = time.time()
            with self.lock:
                for h, _ in chunks:
                    if h not in new:
                        self.pins[h] = now
        if not new:
            return 0
        name, size = self._write_pack(new)
        if session:
            with self.lock:
                self.session_packs.setdefault(session, []).append(name)
                self.session_packs.move_to_end(session)
                while len(self.session_packs) > MAX_SESSIONS:
                    self.session_packs.popitem(last=False)  # (its packs are the sweep's, as before)
        return size

    def give_back(self, session: str) -> int:
        """Deletes the packs that sync ``session`` stored here, now, unless a committed generation
        or another sync in flight (a pin) uses a chunk of one; returns the bytes freed. For a sync
        that failed (a full disk, a host it could not reach): the sweep would keep them for
        GC_GRACE_S, in case the sync were still in flight."""
        with self.lock:
            packs = self.session_packs.pop(session, [])
            epoch = self.commits
        if not packs:
            return 0
        used = self._manifest_chunks()
        if used is None:
            return 0  # a manifest could not be read: keep everything, the sweep decides later
        freed, dead = 0, []
        with self.lock:
            if self.commits != epoch:  # a generation committed since the manifests were read: again
                used = self._manifest_chunks()
                if used is None:
                    return 0
            index = self.index()
            for pack in packs:
                rows = index.rows.get(pack)
                if rows is None:
                    continue
                if any(h in used or h in self.pins for h, _, _ in rows):
                    continue
                (self.packs / (pack[:-5] + ".idx")).unlink(missing_ok=True)
                (self.packs / pack).unlink(missing_ok=True)
                freed += sum(n for _, _, n in rows)
                dead.append(pack)
            if dead:
                self.present().difference_update(index.remove(dead))
        return freed

    def _manifest_chunks(self) -> set | None:
        """Every chunk a kept generation's manifest names (None if one could not be read)."""
        used: set = set()
        for man in self.targets.glob("*/gen-*.manifest"):
            try:
                mtime = man.stat().st_mtime_ns
                cached = self.manifest_chunks.get(man)
                if cached is None or cached[0] != mtime:
                    rows = marshal.loads(man.read_bytes())
                    cached = self.manifest_chunks[man] = (mtime, {h for r in rows for h, _ in r[5]})
                used |= cached[1]
            except (OSError, ValueError, EOFError):  # (dropped meanwhile, too: judge again later)
                return None
        return used

    def _write_pack(self, chunks: dict[str, Any], durable: bool = False) -> tuple[str, int]:
        """Writes chunks as one pack file, then its index (a pack without one is ignored, and
        removed by the next sweep): the chunks are stored once the index is in place. Returns
        the pack's name and size. ``durable``: both are on disk before this returns (a rewrite
        deletes the old pack next)."""
        name = uuid.uuid4().hex
        pack, idx = self.packs / f"{name}.pack", self.packs / f"{name}.idx"
        rows, off = [], 0
        for h, data in chunks.items():
            n = memoryview(data).nbytes
            rows.append((h, off, n))
            off += n
        self.make_dir(self.packs)
        try:
            with open_private(pack) as f:
                for data in chunks.values():  # each from the received batch: no joined copy
                    f.write(data)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            _write_atomic(idx, marshal.dumps(rows))
            if durable:
                for path in (idx, self.packs):
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
        except OSError as e:
            pack.unlink(missing_ok=True)
            raise _disk_error(e, f"storing {len(rows)} chunk(s)") from None
        with self.lock:
            self.index().add(pack.name, rows)
            self.present().update(chunks)
        return pack.name, off

    def _compact(self, pack: str, used: set, epoch: int) -> None:
        """Rewrites a mostly unused pack with only its used chunks, hashed again on the way (a bad
        one is forgotten and will be sent again), then deletes it. The new pack is on disk and
        indexed before the old one goes, so every chunk is readable at every moment; a reader
        that finds the old pack gone reads its index afresh (``fusefs``). Undone when a sync was
        promised a chunk left out, or a generation was committed, since ``used`` was read."""
        rows = self.index().rows.get(pack, [])
        try:
            with open(self.packs / pack, "rb") as f:
                found = {h: os.pread(f.fileno(), n, off) for h, off, n in rows if h in used}
        except OSError:
            return  # unreadable now: left for a later sweep
        good = {h: data for h, data in found.items() if blake3.blake3(data).hexdigest() == h}
        try:
            new, _ = self._write_pack(good, durable=True) if good else ("", 0)
        except StoreError:
            return  # a full disk: the old pack stays whole, and a sweep never fails what called it
        with self.lock:
            left_out = {h for h, _, _ in rows if h not in good}
            if self.commits != epoch or any(h in self.pins for h in left_out - set(found)):
                gone = new  # undone: the new pack goes ("" when nothing was written)
            else:
                gone = pack
                for h in set(found) - set(good):  # its bytes are bad here: sent again, never served
                    self.index().forget(h)
                    self.present().discard(h)
                self._unverified.difference_update(good)
            if gone:
                (self.packs / (gone[:-5] + ".idx")).unlink(missing_ok=True)
                (self.packs / gone).unlink(missing_ok=True)
                self.present().difference_update(self.index().remove([gone]))

    # ------------------------------------------------------------ generations

    def target_dir(self, target: Path) -> Path:
        return self.targets / hashlib.sha256(str(target).encode()).hexdigest()[:16]

    def generations(self, target: Path) -> list[int]:
        d = self.target_dir(target)
        return (
            sorted(int(p.name[4:-9]) for p in d.glob("gen-*.manifest") if p.name[4:-9].isdigit()) if d.is_dir() else []
        )

    def current(self, target: Path) -> int | None:
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

    def unchanged(self, target: Path, digest: str) -> int | None:
        """The current generation, when its manifest has this digest (a no-op sync commits nothing)."""
        n = self.current(target)
        if n is None:
            return None
        try:
            return n if (self.target_dir(target) / f"gen-{n}.digest").read_text() == digest else None
        except OSError:
            return None

    def commit(self, target: Path, manifest: Manifest, fuse: bool, data: bytes | None = None) -> int:
        """Records the next generation of ``target``; materializes it and switches the symlink
        unless ``fuse`` (then the caller switches the mounted file system to it). ``data``: the
        manifest's ``dumps()``, when the caller has it already."""
        if os.path.lexists(target) and not os.path.islink(target) and not fuse:
            raise StoreError(
                f"{target} exists and is not a syncfs target (a symlink to a generation): "
                "remove it or choose another --to"
            )
        have = self.present()
        missing = [h for h in manifest.chunk_sizes() if h not in have]
        if missing:
            raise StoreError(f"{len(missing)} chunk(s) missing (first {missing[0][:12]}): the sync did not finish")
        gens = self.generations(target)
        n = (gens[-1] if gens else 0) + 1
        tdir = self.target_dir(target)
        self.make_dir(tdir)
        try:
            data = manifest.dumps() if data is None else data
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
        except (OSError, StoreError) as e:
            _rmtree(build)
            (tdir / f"gen-{n}.manifest").unlink(missing_ok=True)
            if isinstance(e, StoreError):
                raise
            raise _disk_error(e, f"building generation {n} of {target}") from None
        target.parent.mkdir(parents=True, exist_ok=True)
        link = target.with_name(f".{target.name}.syncfs-{os.getpid()}")
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(final, link)
        os.replace(link, target)  # the switch: atomic for every reader
        return n

    def collect(self, target: Path, sweep_every_s: float | None = 60.0) -> bool:
        """Keeps the newest generations of ``target``; says whether it dropped one. Then, now and
        then, drops chunks that no kept generation uses, no sync in flight pinned, and that are
        older than GC_GRACE_S (``sweep_every_s=None``: the caller sweeps, off its own path)."""
        tdir = self.target_dir(target)
        dropped = self.generations(target)[:-KEEP_GENERATIONS]
        for g in dropped:
            _rmtree(tdir / f"gen-{g}")
            (tdir / f"gen-{g}.manifest").unlink(missing_ok=True)
            (tdir / f"gen-{g}.digest").unlink(missing_ok=True)
        if dropped and sweep_every_s is not None:
            self.sweep(sweep_every_s)
        return bool(dropped)

    def sweep(self, every_s: float = 0.0) -> None:
        """Drops chunks that no kept generation uses, that no sync in flight pinned, and that
        are older than GC_GRACE_S (at most once per ``every_s``, and one sweep at a time)."""
        if time.time() - self.swept < every_s or not self.root.is_dir():
            return
        if not self._sweeping.acquire(blocking=False):
            return
        try:
            self._sweep()
        finally:
            self._sweeping.release()

    def _sweep(self) -> None:
        self.swept = time.time()
        with self.lock:  # a pin lasts GC_GRACE_S: a sync that said it relies on a chunk has committed by then
            self.pins = {h: t for h, t in self.pins.items() if self.swept - t < GC_GRACE_S}
            epoch = self.commits  # read before the manifests: a commit after it stops the deletions
        used = self._manifest_chunks()
        if used is None:
            return  # unreadable: keep everything rather than delete what may be in use
        used |= set(self.pins)
        self.manifest_chunks = {m: v for m, v in self.manifest_chunks.items() if m.exists()}
        old = time.time() - GC_GRACE_S
        index = self.index()
        sparse = []
        with self.lock:
            if self.commits != epoch:
                return  # a generation committed since the manifests were read: the next sweep
            dead = []
            for pack, rows in list(index.rows.items()):
                try:
                    if (self.packs / pack).stat().st_mtime >= old:
                        continue
                except FileNotFoundError:
                    pass
                # a chunk counts where it is served from: a second copy (a rewrite that died
                # before deleting its old pack) keeps nothing alive
                live = [n for h, _, n in rows if (h in used or h in self.pins) and index.where.get(h, ("",))[0] == pack]
                if live:
                    if sum(live) < COMPACT_BELOW * sum(n for _, _, n in rows):
                        sparse.append(pack)
                    continue
                (self.packs / (pack[:-5] + ".idx")).unlink(missing_ok=True)
                (self.packs / pack).unlink(missing_ok=True)
                dead.append(pack)
            if dead:
                self.present().difference_update(index.remove(dead))
            used = used | set(self.pins)
        for pack in sparse:
            self._compact(pack, used, epoch)
        names = set(os.listdir(self.packs)) if self.packs.is_dir() else set()
        for name in names:  # packs a crash left without an index, indexes that could not be read
            stray = (name.endswith(".idx") and name[:-4] + ".pack" not in index.rows) or (
                not name.endswith(".idx") and name not in index.rows
            )
            if stray:
                try:
                    if (self.packs / name).stat().st_mtime < old:
                        (self.packs / name).unlink()
                except FileNotFoundError:
                    pass
        for sub in self.chunks.iterdir() if self.chunks.is_dir() else []:
            for name in os.listdir(sub):
                if name not in used and not name.startswith("."):
                    p = sub / name
                    try:
                        with self.lock:
                            if self.commits != epoch:
                                return
                            if name not in self.pins and p.stat().st_mtime < old:
                                p.unlink()
                                self.present().discard(name)
                    except FileNotFoundError:
                        pass


def manifest_digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    write_private_bytes(path, data)


def _previous_files(manifest_path: Path) -> dict[str, tuple[tuple[tuple[str, int], ...], int]]:
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


def _materialize(
    build: Path,
    manifest: Manifest,
    store: ChunkStore,
    prev_dir: Path | None,
    prev_files: dict[str, tuple[tuple[tuple[str, int], ...], int]],
) -> None:
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
                for h, n in e.chunks:
                    src, off, size = store.open_chunk(h)
                    with src:
                        if size is not None and size != n:
                            raise StoreError(f"chunk {h[:12]} is {size} bytes in its pack; the manifest says {n}")
                        _copy_range(src.fileno(), out.fileno(), off, n)
            os.chmod(dst, e.mode & ~0o222)
            os.utime(dst, ns=(e.mtime_ns, e.mtime_ns))  # Python checks .pyc files against their source's mtime


def _copy_range(src: int, dst: int, off: int, n: int) -> None:
    """Appends ``n`` bytes of ``src`` from ``off`` to ``dst``, in the kernel where it can."""
    try:
        while n > 0:
            done = os.copy_file_range(src, dst, n, off)
            if done == 0:
                raise OSError(errno.EIO, "a chunk ends early in its pack")
            off, n = off + done, n - done
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
        while n > 0:  # a file system without copy_file_range: through memory
            data = os.pread(src, min(n, 1 << 20), off)
            if not data:
                raise OSError(errno.EIO, "a chunk ends early in its pack") from None
            view = memoryview(data)
            while view:
                view = view[os.write(dst, view) :]
            off, n = off + len(data), n - len(data)


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
