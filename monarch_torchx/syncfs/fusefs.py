"""The read-only FUSE file system that serves a target's generations from the chunk store.

One process per mounted target (``python -m monarch_torchx.syncfs.fusefs TARGET_DIR MOUNTPOINT
STORE``), started by the agent. It serves the generation named in ``TARGET_DIR/current`` and
switches on SIGUSR1: lookups from the root then see the new tree at once, while files and
directories already opened in the previous generation keep serving it (inode numbers carry
their generation). Nothing is copied at commit: a file's bytes are read from its chunks.
"""

from __future__ import annotations

import bisect
import errno
import logging
import os
import signal
import stat
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import pyfuse3
import trio

from ..quick_exit import exit_without_finalizing
from .manifest import Entry, Manifest
from .store import PackIndex

log = logging.getLogger("monarch_torchx.syncfs.fuse")
GEN_SHIFT = 32
TIMEOUT_S = 3600.0  # entries below the root never change within a generation; the root is invalidated on a switch
OPEN_FDS = 256


@dataclass
class Node:
    entry: Entry
    ino: int
    children: dict[str, int] = field(default_factory=dict)  # name -> ino
    offsets: list[int] = field(default_factory=list)  # chunk start offsets (files)
    nlink: int = 1


class Generation:
    """One generation's tree, with inode numbers ``gen << 32 | index``."""

    def __init__(self, number: int, manifest: Manifest):
        self.number = number
        self.nodes: dict[int, Node] = {}
        self.root: dict[str, int] = {}
        by_path: dict[str, int] = {}
        for k, e in enumerate(manifest.entries):
            ino = (number << GEN_SHIFT) | (k + 2)
            if e.kind == "h":  # a hard link is another name for its target's inode
                target = by_path.get(e.target)
                if target is None:
                    continue
                self.nodes[target].nlink += 1
                ino = target
            else:
                node = Node(e, ino)
                if e.kind == "f":
                    pos = 0
                    for _, n in e.chunks:
                        node.offsets.append(pos)
                        pos += n
                self.nodes[ino] = node
            by_path[e.path] = ino
            parent, _, name = e.path.rpartition("/")
            (self.nodes[by_path[parent]].children if parent else self.root)[name] = ino


def load(target_dir: str) -> Generation:
    with open(os.path.join(target_dir, "current")) as f:
        number = int(f.read().strip())
    with open(os.path.join(target_dir, f"gen-{number}.manifest"), "rb") as f:
        return Generation(number, Manifest.loads(f.read()))


class SyncFS(pyfuse3.Operations):
    def __init__(self, target_dir: str, store: str):
        super().__init__()
        self.target_dir, self.store = target_dir, store
        self.current = load(target_dir)
        self.gens: OrderedDict[int, Generation] = OrderedDict({self.current.number: self.current})
        self.fds: OrderedDict[str, int] = OrderedDict()
        self.packs = PackIndex(Path(store) / "packs")
        self.uid, self.gid = os.getuid(), os.getgid()

    # ------------------------------------------------------------ generations

    def switch(self) -> list[str]:
        """Loads the generation ``current`` names; returns the root names to invalidate."""
        new = load(self.target_dir)
        old_names = list(self.current.root)
        self.gens[new.number] = new
        self.current = new
        # packs a sweep deleted (or rewrote) since stay on disk while a descriptor holds them: let
        # them go at each switch, and read the index afresh when next asked
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        self.packs = PackIndex(Path(self.store) / "packs")
        while len(self.gens) > 2:  # the store keeps two generations' chunks
            self.gens.popitem(last=False)
        return sorted(set(old_names) | set(new.root))

    def node(self, ino: int) -> Node:
        gen = self.gens.get(ino >> GEN_SHIFT)
        node = gen.nodes.get(ino) if gen else None
        if node is None:
            raise pyfuse3.FUSEError(errno.ESTALE)
        return node

    # ------------------------------------------------------------ attributes

    def attrs(self, node: Node | None, ino: int = pyfuse3.ROOT_INODE) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino if node is None else node.ino
        a.entry_timeout = a.attr_timeout = 1.0 if node is None else TIMEOUT_S
        a.st_uid, a.st_gid = self.uid, self.gid
        a.st_blksize = 128 << 10
        if node is None:
            a.st_mode, a.st_nlink, a.st_size = stat.S_IFDIR | 0o555, 2, 0
            return a
        e = node.entry
        if e.kind == "d":
            a.st_mode, a.st_nlink = stat.S_IFDIR | ((e.mode | 0o500) & ~0o222), 2
        elif e.kind == "l":
            a.st_mode, a.st_size = stat.S_IFLNK | 0o777, len(os.fsencode(e.target))
        else:
            a.st_mode, a.st_size, a.st_nlink = stat.S_IFREG | (e.mode & ~0o222), e.size, node.nlink
        a.st_mtime_ns = a.st_ctime_ns = a.st_atime_ns = e.mtime_ns
        a.st_blocks = (a.st_size + 511) // 512
        return a

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext | None = None) -> pyfuse3.EntryAttributes:
        if inode == pyfuse3.ROOT_INODE:
            return self.attrs(None)
        return self.attrs(self.node(inode))

    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext | None = None
    ) -> pyfuse3.EntryAttributes:
        children = self.current.root if parent_inode == pyfuse3.ROOT_INODE else self.node(parent_inode).children
        ino = children.get(os.fsdecode(name))
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self.attrs(self.node(ino))

    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        node = self.node(inode)
        if node.entry.kind != "l":
            raise pyfuse3.FUSEError(errno.EINVAL)
        return os.fsencode(node.entry.target)

    # ------------------------------------------------------------ directories

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        if inode != pyfuse3.ROOT_INODE:
            self.node(inode)
        return inode if inode != pyfuse3.ROOT_INODE else (self.current.number << GEN_SHIFT) | 1

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        if fh & 0xFFFFFFFF == 1:  # the root of the generation that was current at opendir
            gen = self.gens.get(fh >> GEN_SHIFT) or self.current
            children = gen.root
        else:
            children = self.node(fh).children
        names = sorted(children)
        for k in range(start_id, len(names)):
            if not pyfuse3.readdir_reply(
                token, os.fsencode(names[k]), self.attrs(self.node(children[names[k]])), k + 1
            ):
                return

    async def releasedir(self, fh: int) -> None:
        pass

    # ------------------------------------------------------------ files

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
            raise pyfuse3.FUSEError(errno.EROFS)
        node = self.node(inode)
        if node.entry.kind != "f":
            raise pyfuse3.FUSEError(errno.EISDIR if node.entry.kind == "d" else errno.EINVAL)
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)  # immutable: the page cache stays valid

    def _where(self, h: str, n: int) -> tuple[int, int]:
        """An open descriptor of the file holding chunk ``h`` (of size ``n``), and its offset there."""
        try:
            return self._open(*self._locate(h, n))
        except (KeyError, FileNotFoundError):
            # a pack this index knew was collected or rewritten (its chunks are in another): read afresh
            self.packs = PackIndex(Path(self.store) / "packs")
            self.packs.refresh()
            for fd in self.fds.values():
                os.close(fd)
            self.fds.clear()
            return self._open(*self._locate(h, n))

    def _locate(self, h: str, n: int) -> tuple[str, int]:
        if h not in self.packs.where:
            self.packs.refresh()  # a pack written since this generation was loaded
        if h in self.packs.where:
            pack, off, _ = self.packs.where[h]
            return os.path.join(self.store, "packs", pack), off
        return os.path.join(self.store, "chunks", h[:2], h), 0  # a file of its own: an earlier store's

    def _open(self, path: str, off: int) -> tuple[int, int]:
        fd = self.fds.get(path)
        if fd is not None:
            self.fds.move_to_end(path)
            return fd, off
        fd = os.open(path, os.O_RDONLY)
        self.fds[path] = fd
        if len(self.fds) > OPEN_FDS:
            os.close(self.fds.popitem(last=False)[1])
        return fd, off

    async def read(self, fh: int, off: int, size: int) -> bytes:
        node = self.node(fh)
        e = node.entry
        if off >= e.size:
            return b""
        size = min(size, e.size - off)
        k = bisect.bisect_right(node.offsets, off) - 1
        parts = []
        while size > 0 and k < len(e.chunks):
            h, n = e.chunks[k]
            inner = off - node.offsets[k]
            take = min(size, n - inner)
            try:
                fd, base = self._where(h, n)
                parts.append(os.pread(fd, take, base + inner))
            except KeyError:
                raise pyfuse3.FUSEError(errno.EIO) from None
            except OSError as err:
                raise pyfuse3.FUSEError(err.errno or errno.EIO) from None
            off += take
            size -= take
            k += 1
        return b"".join(parts)

    async def release(self, fh: int) -> None:
        pass

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        s = pyfuse3.StatvfsData()
        st = os.statvfs(self.store)
        s.f_bsize, s.f_frsize, s.f_blocks, s.f_bfree, s.f_bavail = st.f_bsize, st.f_frsize, st.f_blocks, 0, 0
        s.f_files, s.f_ffree, s.f_favail, s.f_namemax = len(self.current.nodes), 0, 0, 255
        return s


PARENT_CHECK_S = 0.5


async def _serve(fs: SyncFS, agent_pid: int) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pyfuse3.main)

        async def with_the_agent() -> None:
            """Ends (and unmounts) when the agent that started us is gone: its replicas went with
            it, and a server nobody owns would keep the mount and the store busy forever."""
            while os.getppid() == agent_pid:
                await trio.sleep(PARENT_CHECK_S)
            log.info("the agent (pid %d) is gone: unmounting", agent_pid)
            nursery.cancel_scope.cancel()

        nursery.start_soon(with_the_agent)

        async def on_switch() -> None:
            with trio.open_signal_receiver(signal.SIGUSR1, signal.SIGTERM, signal.SIGINT) as signals:
                async for sig in signals:
                    if sig != signal.SIGUSR1:
                        nursery.cancel_scope.cancel()
                        return
                    try:
                        names = fs.switch()
                    except (OSError, ValueError, EOFError) as e:
                        log.error("could not switch generation: %s", e)
                        print(f"failed: {e}", flush=True)  # the agent waits for a line
                        continue
                    for name in names:
                        try:
                            pyfuse3.invalidate_entry_async(pyfuse3.ROOT_INODE, os.fsencode(name))
                        except Exception:  # noqa: BLE001 - an entry the kernel never looked up
                            pass
                    log.info("serving generation %d", fs.current.number)
                    print(f"serving {fs.current.number}", flush=True)  # what the agent waits for

        nursery.start_soon(on_switch)


def main(argv: list[str] | None = None) -> None:
    agent_pid = os.getppid()
    target_dir, mountpoint, store = (argv or sys.argv[1:])[:3]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s syncfs-fuse %(levelname)s %(message)s")
    # started ahead of the first commit (imports done): mount once the agent says so
    if sys.stdin.readline().strip() != "mount":
        return  # the agent let go of this server without a commit
    fs = SyncFS(target_dir, store)
    options = set(pyfuse3.default_options) | {"fsname=monarch-syncfs", "ro", "subtype=monarch"}
    if os.getuid() == 0:
        options.add("allow_other")
    pyfuse3.init(fs, mountpoint, options)
    log.info("serving generation %d", fs.current.number)
    print("mounted", flush=True)  # the agent waits for this line
    try:
        trio.run(_serve, fs, agent_pid)
    finally:
        pyfuse3.close(unmount=True)
    exit_without_finalizing()  # unmounted: nothing is left but the heap


if __name__ == "__main__":
    main()
