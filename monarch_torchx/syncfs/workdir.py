"""A writable working directory over a read-only synced tree: what a workspace run's cwd is.

The synced tree (a FUSE mount that switches generations atomically) stays read-only, so a sync
keeps its speed and atomicity. The working directory lives outside the pool's temporary sync
area, so outputs outlive the pool: the tree's directories as real directories and its files as
symlinks into the synced copy, refreshed when the generation changes. A script that writes
``snapshot.pt`` (or anything new, anywhere in the tree) writes a real file there, and the next
run, on new code, finds it. A synced file itself stays read-only (writing through its link fails
with EROFS): replace it (write a new file and rename it over the link) or write elsewhere.

Where the hosts share a file system (``monarch_local``, a SLURM cluster's shared home), one
directory per pool and mount serves every host, so what any rank writes is seen by all ranks and
by the next run, as on NFS. Its links then cannot point at one host's copy (that path is mounted
on that node alone): they go through the pool's *view* of the target, a path that is the same
string on every node and that each host points at its own copy (``syncfs.view``). Elsewhere
(Kubernetes pods) each host keeps a directory of its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from pathlib import Path
from typing import Iterator

from ..private import private_dir, read_private_file, write_private_bytes

STAMP = ".monarch-torchx-generation"  # the generation the links were last made for
CHECK = ".shared-check"  # beside the shared directory: what its last refresh wrote, read by every host
_SLUG = re.compile(r"[^A-Za-z0-9_.-]+")


def mount_dir(home: Path, pool: str, target: str) -> Path:
    """``HOME/workspaces/POOL/MOUNT``: named after the mount the user gave."""
    slug = _SLUG.sub("_", target.strip("/")) or "root"
    return home / "workspaces" / pool / slug


def workdir_root(home: Path, pool: str, target: str, index: int) -> Path:
    """``HOME/workspaces/POOL/MOUNT/hostN``: one per host, where the hosts share no file system."""
    return mount_dir(home, pool, target) / f"host{index}"


def shared_root(home: Path, pool: str, target: str) -> Path:
    """``HOME/workspaces/POOL/MOUNT/shared``: one for every host of the pool (a shared file system)."""
    return mount_dir(home, pool, target) / "shared"


def point_view(view: Path, copy: Path, private_from: Path) -> None:
    """Points ``view`` (a symlink at the same path on every node) at this host's ``copy``; atomic, so
    a rank that reads through it meanwhile sees one copy or the other, never nothing."""
    private_dir(view.parent, from_=private_from)
    if os.path.lexists(view) and not os.path.islink(view):
        raise FileExistsError(f"{view} is not a symlink (syncfs keeps the pool's view of a target there); remove it")
    if os.path.islink(view) and os.readlink(view) == str(copy):
        return
    tmp = view.with_name(f".{view.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.symlink(copy, tmp)
    os.replace(tmp, view)


def view_shows(view: Path, copy: Path) -> str:
    """Why ``view`` does not show this host's ``copy`` of the tree here ("" when it does): on a node
    whose temp directory another node shares, the view points at a copy mounted on that node only."""
    try:
        seen, mine = sorted(os.listdir(view)), sorted(os.listdir(copy))
    except OSError as e:
        return f"{view}: {e.strerror}"
    if seen != mine or os.path.ismount(os.path.realpath(view)) != os.path.ismount(os.path.realpath(copy)):
        return f"{view} leads to {os.path.realpath(view)}, a copy this node does not serve"
    return ""


def refresh(tree: Path, workdir: Path, generation: object | None, links_to: Path | None = None) -> Path:
    """Makes ``workdir`` mirror ``tree`` (dirs made, files linked); a no-op when ``generation`` is done.

    Links point into ``links_to`` (the view, for a shared directory) or else ``tree`` itself.
    Files written by runs are never touched; links whose file left the tree are removed. Ranks of
    a running app may write into ``workdir`` meanwhile: a name they take first is theirs.
    """
    private_dir(workdir, from_=workdir.parent)  # made 0700; one someone else made is refused
    base = str(links_to or tree)
    stamp = workdir / STAMP
    want = None if generation is None else f"{generation} {base}"
    if want is not None:
        with contextlib.suppress(OSError):
            if stamp.read_text().strip() == want:
                return workdir
    tree_s = str(tree)
    for dirpath, dirnames, filenames in os.walk(tree):
        rel = os.path.relpath(dirpath, tree_s)
        here = workdir if rel == "." else workdir / rel
        linked = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        dirnames[:] = [d for d in dirnames if d not in linked]
        filenames = filenames + linked  # a synced symlink to a directory is linked like a file
        if rel != "." and not here.is_dir():
            if here.is_symlink() or here.exists():
                dirnames[:] = []  # the run put a file where the tree now has a directory: the run's wins
                continue
            with contextlib.suppress(FileExistsError):  # (a rank made it just now)
                here.mkdir(mode=0o700)
        for name in filenames:
            _link(here / name, os.path.join(base, rel, name) if rel != "." else os.path.join(base, name), base)
    _drop_stale_links(workdir, base)
    if want is not None:
        tmp = workdir / (STAMP + ".tmp")
        tmp.write_text(want)
        os.replace(tmp, stamp)
    return workdir


def _link(link: Path, target: str, base: str) -> None:
    """Links ``link`` to ``target`` unless the run made that name its own (a file, its own link)."""
    if link.is_symlink():
        dest = os.readlink(link)
        if dest == target or not dest.startswith(base + os.sep):
            return  # current, or a link the run made itself
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
    elif link.exists():
        return  # a file the run wrote: kept
    with contextlib.suppress(FileExistsError):  # a rank wrote that name meanwhile: the run's wins
        os.symlink(target, link)


def _drop_stale_links(workdir: Path, base: str) -> None:
    for dirpath, dirnames, filenames in os.walk(workdir):
        for name in filenames + dirnames:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                dest = os.readlink(p)
                if dest.startswith(base + os.sep) and not os.path.lexists(dest):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(p)


@contextlib.contextmanager
def locked(workdir: Path) -> Iterator[None]:
    """Two apps that start on one pool and mount at once refresh its shared directory one after the
    other (the lock file sits beside it, in the mount's private directory)."""
    private_dir(workdir.parent, from_=workdir.parent)
    fd = os.open(workdir.parent / ".shared.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        with contextlib.suppress(OSError):  # a file system without locks: refreshes tolerate each other
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def refresh_shared(tree: Path, workdir: Path, generation: object, view: Path, nonce: str) -> Path:
    """Refreshes the shared directory (links through ``view``) and leaves ``nonce`` beside it, for
    every host to read back (``sees_shared``): proof that they share this file system."""
    with locked(workdir):
        refresh(tree, workdir, generation, links_to=view)
    write_private_bytes(workdir.parent / CHECK, nonce.encode())
    return workdir


def sees_shared(workdir: Path, nonce: str) -> str:
    """Why this host does not see the shared directory another host just refreshed ("" when it does)."""
    try:
        got = read_private_file(workdir.parent / CHECK).decode()
    except FileNotFoundError:
        return f"{workdir.parent} is not on a file system this node shares with the others"
    except OSError as e:  # (PrivatePathError is one: not ours, or open to others)
        return str(e)
    return (
        "" if got == nonce else f"{workdir.parent} here is not the one the other hosts use (not a shared file system)"
    )
