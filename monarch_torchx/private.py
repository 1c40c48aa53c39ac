"""Paths only their owner can use: how everything a pool keeps on a (shared) node is made.

Cluster nodes are shared with other users, and ``/tmp`` is writable by all of them: a directory
at a predictable path there may already exist, made by someone else to read or plant what we
put in it. So every directory we keep state in is made 0700 level by level, and one that already
exists is used only if it is a real directory, ours, and closed to group and others.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import secrets
import stat
import tempfile
from pathlib import Path


class PrivatePathError(PermissionError):
    """A path we would keep state in is not ours alone; the message says what to do."""


def node_temp_root() -> Path:
    """This user's root in the node's temp directory, for what agents keep there (never shared)."""
    return Path(tempfile.gettempdir()) / f"monarch_torchx-{os.getuid()}"


def sync_store_base() -> tuple[Path, Path]:
    """(where hosts' sync stores go, the highest directory of it that must be ours alone). Here,
    not in syncfs, because the agent removes a dead host's store without loading syncfs."""
    if os.environ.get("MONARCH_TORCHX_SYNC_STORE"):
        base = Path(os.environ["MONARCH_TORCHX_SYNC_STORE"])
        return base, base
    return node_temp_root() / "syncfs", node_temp_root()


def check_private_dir(path: Path) -> None:
    """Raises PrivatePathError unless ``path`` is a real directory of ours that only we can use."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise PrivatePathError(f"{path} is not a directory (a symlink or a file is there); remove it")
    _check_ours(path, st, "chmod 700 it, or remove it")


def read_private_file(path: Path) -> bytes:
    """The contents of ``path``, which must be a regular file of ours that only we can read (a
    secret). Opened without following a symlink, and checked on the open file itself."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PrivatePathError(f"{path} is a symlink; put the file itself there") from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise PrivatePathError(f"{path} is not a regular file; remove it")
        _check_ours(path, st, "chmod 600 it")
        return f.read()


def _check_ours(path: Path, st: os.stat_result, fix: str) -> None:
    if st.st_uid != os.getuid():
        raise PrivatePathError(f"{path} belongs to uid {st.st_uid}, not you: remove it or choose another path")
    if st.st_mode & 0o077:
        raise PrivatePathError(f"{path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}): {fix}")


def _untrusted_why(d: str, st: os.stat_result) -> str | None:
    """Why directory ``d`` lets someone else replace what we keep below it, or None."""
    if st.st_uid not in (0, os.getuid()):
        return f"it belongs to uid {st.st_uid}, who can rename or replace what is in it"
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        who = "others" if st.st_mode & 0o002 else "its group"
        return (
            f"{who} can write it (mode {stat.S_IMODE(st.st_mode):o}, no sticky bit), so they can rename "
            "what is in it and put theirs there"
        )
    return None


def check_trusted_parents(path: str | Path) -> None:
    """Raises PrivatePathError unless every directory above ``path`` up to ``/`` is safe to keep
    our state under: owned by us or root, and not writable by others unless sticky (``/tmp``).

    A private leaf is not enough: whoever can write its parent can rename the leaf away after we
    checked it and put their own in its place (their token, their code on our ``sys.path``).
    Both the path as written and the real one (after symlinks) are walked, since a symlinked
    level is as safe as the directory it sits in and the one it points to.
    """
    path = Path(os.path.abspath(path))
    seen = set()
    for chain in (path.parents, Path(os.path.realpath(path)).parents):
        for d in chain:
            key = str(d)
            if key in seen:
                continue
            seen.add(key)
            try:
                st = os.lstat(d)
            except FileNotFoundError:
                continue  # made by us below, 0700
            if stat.S_ISLNK(st.st_mode):
                continue  # its directory is on this chain and its target on the real one
            why = _untrusted_why(key, st)
            if why:
                raise PrivatePathError(
                    f"refusing to keep state under {d}: {why}; choose a directory "
                    "only you (or root) can write, e.g. under your home"
                )


def private_dir(path: str | Path, check: bool = True, from_: Path | None = None) -> Path:
    """mkdir -p where each level made here is 0700. With ``check``, the leaf, and every level from
    ``from_`` down to it (the part of the path that must be ours), is checked before anything is
    made inside it (see check_private_dir), so nothing is ever created under a planted directory."""
    path = Path(path)
    top = from_ if from_ is not None and (from_ == path or from_ in path.parents) else path
    chain = [path]
    while chain[-1] != top:
        chain.append(chain[-1].parent)
    above = top.parent
    if check:
        check_trusted_parents(top)
    missing = []
    while not os.path.lexists(above):  # (os.makedirs would give the levels above the leaf 0777)
        missing.append(above)
        above = above.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, 0o700)
    for d in reversed(chain):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            if check:
                check_private_dir(d)
    return path


def write_private_bytes(path: Path, data: bytes) -> None:
    """Atomically writes a 0600 file (readers see the old or the new content, never half)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def open_private(path: Path) -> io.BufferedWriter:
    """A new file, 0600, for writing bytes (fails if something is already there)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb")


def remove_empty_dirs(path: Path, up_to: Path) -> None:
    """Removes ``path`` and its parents while they are empty, up to (and including) ``up_to``."""
    p = path
    while True:
        try:
            os.rmdir(p)
        except OSError:
            return
        if p == up_to or up_to not in p.parents:
            return
        p = p.parent


def agent_temp_dir(kind: str, pool: str, index: int) -> Path:
    """``node_temp_root()/KIND/POOL-INDEX-HOSTNAME-PID``: what one agent keeps on the node's temp disk.

    Made private. Directories of the same kind that agents of this host left when they died
    without cleaning up (SIGKILL) are removed first, so nothing piles up; the host name keeps a
    temp directory that several nodes share from judging other nodes' pids.
    """
    import shutil
    import socket

    from . import procfs

    parent = node_temp_root() / kind
    private_dir(parent, from_=node_temp_root())
    host = socket.gethostname()
    for d in parent.iterdir():
        rest, _, pid = d.name.rpartition("-")
        if rest.endswith(f"-{host}") and pid.isdigit() and int(pid) != os.getpid() and not procfs.alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
    return private_dir(parent / f"{pool}-{index}-{host}-{os.getpid()}")
