"""A writable working directory over a read-only synced tree: what a workspace run's cwd is.

The synced tree (a FUSE mount that switches generations atomically) stays read-only, so a sync
keeps its speed and atomicity. Each host gets a directory of its own, outside the pool's
temporary sync area so outputs outlive the pool: the tree's directories as real directories and
its files as symlinks into the mount, refreshed when the generation changes. A script that
writes ``snapshot.pt`` (or anything new, anywhere in the tree) writes a real file there, and the
next run, on new code, finds it. A synced file itself stays read-only (writing through its link
fails with EROFS): replace it (write a new file and rename it over the link) or write elsewhere.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

from ..private import private_dir

STAMP = ".monarch-torchx-generation"  # the generation the links were last made for
_SLUG = re.compile(r"[^A-Za-z0-9_.-]+")


def workdir_root(home: Path, pool: str, target: str, index: int) -> Path:
    """``HOME/workspaces/POOL/MOUNT/hostN``: one per host, named after the mount the user gave."""
    slug = _SLUG.sub("_", target.strip("/")) or "root"
    return home / "workspaces" / pool / slug / f"host{index}"


def refresh(tree: Path, workdir: Path, generation: Optional[int]) -> Path:
    """Makes ``workdir`` mirror ``tree`` (dirs made, files linked); a no-op when ``generation`` is done.

    Files written by runs are never touched; links whose file left the tree are removed.
    """
    private_dir(workdir, from_=workdir.parent)  # made 0700; one someone else made is refused
    stamp = workdir / STAMP
    if generation is not None:
        try:
            if stamp.read_text().strip() == str(generation):
                return workdir
        except OSError:
            pass
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
            here.mkdir(mode=0o700)
        for name in filenames:
            link = here / name
            target = os.path.join(dirpath, name)
            if link.is_symlink():
                if os.readlink(link) == target:
                    continue
                if not os.readlink(link).startswith(tree_s + os.sep):
                    continue  # a link the run made itself
                link.unlink()
            elif link.exists():
                continue  # a file the run wrote: kept
            os.symlink(target, link)
    _drop_stale_links(workdir, tree_s)
    if generation is not None:
        tmp = workdir / (STAMP + ".tmp")
        tmp.write_text(str(generation))
        os.replace(tmp, stamp)
    return workdir


def _drop_stale_links(workdir: Path, tree: str) -> None:
    for dirpath, dirnames, filenames in os.walk(workdir):
        for name in filenames + dirnames:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                dest = os.readlink(p)
                if dest.startswith(tree + os.sep) and not os.path.lexists(dest):
                    os.unlink(p)
