"""What a tree is, independent of where it lives: a manifest of entries and content-addressed chunks.

Files are cut into content-defined chunks (FastCDC), so an edit in the middle of a large file
changes only the chunks around it, and each chunk is named by its BLAKE3 hash, so a host that
has a chunk never receives it again. Hashing an unchanged tree is skipped through a cache keyed
by each file's size, mtime and inode: a no-op resync reads metadata only.
"""

from __future__ import annotations

import builtins
import marshal
import mmap
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import blake3

from .ignore import IgnoreRules

SMALL_FILE = 256 << 10  # below this a file is one chunk
# FastCDC skips a chunk's first min_size bytes without rolling its hash over them, so a minimum
# of half the average (restic's choice too) scans half of each file where a quarter scanned three
# quarters; an edit resends about one average chunk either way, a little more with this minimum
# (RESULTS.md, `sync-cpu`). Chunk lists a client cached with other sizes stay valid: chunks are
# named by their contents.
CDC = {"min_size": 512 << 10, "avg_size": 1 << 20, "max_size": 4 << 20}


@dataclass(slots=True)
class Entry:
    """One path of the tree. ``kind``: f(ile), d(ir), l (symlink), h (hard link to ``target``)."""

    path: str
    kind: str
    mode: int
    size: int = 0
    mtime_ns: int = 0
    chunks: list[tuple[str, int]] = field(default_factory=list)  # (blake3 hex, size), in file order
    target: str = ""


@dataclass
class Manifest:
    entries: list[Entry]

    def chunk_sizes(self) -> dict[str, int]:
        return {h: n for e in self.entries for h, n in e.chunks}

    @property
    def bytes(self) -> int:
        return sum(e.size for e in self.entries if e.kind == "f")

    def rows(self) -> list[tuple]:
        """Compact: one tuple per entry, in ``Entry``'s field order (what travels and is stored)."""
        return [(e.path, e.kind, e.mode, e.size, e.mtime_ns, e.chunks, e.target) for e in self.entries]

    @classmethod
    def from_rows(cls, rows: list[Any]) -> Manifest:
        """Checks the shape of what a peer sent, then builds the manifest."""
        out = []
        for r in rows:
            p, k, m, sz, mt, ch, t = r
            if not (
                isinstance(p, str)
                and k in ("f", "d", "l", "h")
                and isinstance(m, int)
                and isinstance(sz, int)
                and isinstance(mt, int)
                and isinstance(t, str)
            ):
                raise ValueError(f"malformed manifest entry {str(r)[:120]}")
            q = f"/{p}/"  # no absolute path, no empty, "." or ".." part (checked in C, not part by part)
            if p.startswith("/") or "//" in q or "/./" in q or "/../" in q or "\0" in p:
                raise ValueError(f"unsafe path in manifest: {p[:120]!r}")
            if ch and not all(type(c) is tuple and len(c) == 2 and type(c[0]) is str and type(c[1]) is int for c in ch):
                raise ValueError(f"malformed chunk list in manifest entry {p[:120]!r}")
            out.append(Entry(p, k, m, sz, mt, list(ch), t))
        return cls(out)

    def dumps(self) -> builtins.bytes:
        """What travels to the hosts and what they keep on disk: marshal is several times faster
        than pickle or JSON for 40k small tuples (a peer's bytes are loaded only after it
        authenticated, as pickles are, and then checked by ``from_rows``). Version 2 has no
        back-references, so equal manifests give equal bytes (and digests)."""
        return marshal.dumps(self.rows(), 2)

    @classmethod
    def loads(cls, data: builtins.bytes) -> Manifest:
        """A manifest this host's agent checked and wrote itself (not checked again: a 40k-path
        tree is read at every switch)."""
        return cls([Entry(*r) for r in marshal.loads(data)])


@dataclass
class ChunkSource:
    """Where the client reads a chunk from."""

    path: str
    offset: int
    size: int
    data: bytes | None = None  # a small file's bytes, kept from hashing it until they are sent


def chunk_file(path: str, size: int) -> list[tuple[str, int, int]]:
    """(hash, offset, size) of each content-defined chunk of a file."""
    return read_and_chunk(path, size)[0]


def read_and_chunk(path: str, size: int) -> tuple[list[tuple[str, int, int]], bytes | None]:
    """``chunk_file``, and a small file's bytes (read anyway to hash them: not read twice)."""
    if size == 0:
        return [], None
    with open(path, "rb") as f:
        if size <= SMALL_FILE:
            data = f.read()
            return [(blake3.blake3(data).hexdigest(), 0, len(data))], data
        import fastcdc  # here, not at the top: a host's FUSE server reads manifests and never chunks

        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            view = memoryview(m)
            try:
                return [
                    (blake3.blake3(view[c.offset : c.offset + c.length]).hexdigest(), c.offset, c.length)
                    for c in fastcdc.fastcdc(m, fat=False, hf=None, **CDC)
                ], None
            finally:
                view.release()


class HashCache:
    """Per-source cache of file chunk lists, keyed by (size, mtime_ns, inode); a marshal file of
    the client's own (JSON would take longer to load than a 10k-file no-op sync may)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            data = marshal.loads(path.read_bytes())
            self.data: dict[str, list] = data if isinstance(data, dict) else {}
        except (OSError, ValueError, EOFError, TypeError):
            self.data = {}
        self.used: dict[str, list] = {}
        self.misses = 0  # files looked up and not found fresh: they are read and hashed

    def get(self, rel: str, st: os.stat_result) -> list[tuple[str, int, int]] | None:
        hit = self.data.get(rel)
        if hit and hit[0] == st.st_size and hit[1] == st.st_mtime_ns and hit[2] == st.st_ino:
            self.used[rel] = hit
            return hit[3]
        self.misses += 1
        return None

    def put(self, rel: str, st: os.stat_result, chunks: list[tuple[str, int, int]]) -> None:
        self.used[rel] = [st.st_size, st.st_mtime_ns, st.st_ino, chunks]

    def save(self) -> None:
        if self.used == self.data:  # nothing changed (a no-op sync): no rewrite
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + f".{os.getpid()}")
        tmp.write_bytes(marshal.dumps(self.used))
        os.replace(tmp, self.path)


def _walk(root: str, ignore: IgnoreRules | None = None) -> Iterator[tuple[str, os.DirEntry]]:
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        with os.scandir(os.path.join(root, rel_dir) if rel_dir else root) as it:
            for d in sorted(it, key=lambda d: d.name):
                rel = f"{rel_dir}/{d.name}" if rel_dir else d.name
                if ignore and ignore.ignored(rel):
                    continue
                yield rel, d
                if d.is_dir(follow_symlinks=False):
                    stack.append(rel)


def scan_groups(
    root: str,
    cache: HashCache | None = None,
    group_bytes: int = 64 << 20,
    workers: int = 4,
    ignore: IgnoreRules | None = None,
) -> Iterator[tuple[list[Entry], dict[str, ChunkSource]]]:
    """Walks ``root`` and yields its entries in groups of up to about ``group_bytes`` of file data
    (the first ones smaller, 4 MiB and doubling, so the first bytes go out early),
    each group hashed (in worker threads) when it is yielded: a caller can send one group while
    the next is read, so reading the tree from disk overlaps the transfer."""
    from concurrent.futures import ThreadPoolExecutor

    seen_inodes: dict[tuple[int, int], str] = {}
    entries: list[Entry] = []
    todo: list[tuple[Entry, str, os.stat_result]] = []
    size = 0
    limit = min(group_bytes, 4 << 20)

    def finish() -> tuple[list[Entry], dict[str, ChunkSource]]:
        found: list[list[tuple[str, int, int]] | None] = [cache.get(e.path, st) if cache else None for e, _, st in todo]
        misses = [k for k, hit in enumerate(found) if hit is None]
        datas: dict[int, bytes] = {}
        if misses:

            def hash_some(some: list[int]) -> None:
                for k in some:
                    found[k], data = read_and_chunk(todo[k][1], todo[k][2].st_size)
                    if data is not None:
                        datas[k] = data

            with ThreadPoolExecutor(max_workers=workers) as ex:
                list(ex.map(hash_some, [misses[k::workers] for k in range(workers)]))
        sources: dict[str, ChunkSource] = {}
        for k, ((e, path, st), chunks) in enumerate(zip(todo, found)):
            assert chunks is not None
            if cache:
                cache.put(e.path, st, chunks)
            for h, off, n in chunks:
                sources.setdefault(h, ChunkSource(path, off, n, datas.get(k)))
            e.chunks = [(h, n) for h, _, n in chunks]
        return entries, sources

    for rel, d in _walk(root, ignore):
        st = d.stat(follow_symlinks=False)
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISDIR(st.st_mode):
            entries.append(Entry(rel, "d", mode, mtime_ns=st.st_mtime_ns))
        elif stat.S_ISLNK(st.st_mode):
            entries.append(Entry(rel, "l", mode, mtime_ns=st.st_mtime_ns, target=os.readlink(d.path)))
        elif stat.S_ISREG(st.st_mode):
            key = (st.st_dev, st.st_ino)
            if st.st_nlink > 1 and key in seen_inodes:
                entries.append(Entry(rel, "h", mode, target=seen_inodes[key]))
                continue
            seen_inodes[key] = rel
            e = Entry(rel, "f", mode, st.st_size, st.st_mtime_ns)
            entries.append(e)
            todo.append((e, d.path, st))
            size += st.st_size
            if size >= limit:
                yield finish()
                entries, todo, size = [], [], 0
                limit = min(group_bytes, limit * 2)
        # sockets, fifos and devices are not synced
    yield finish()
