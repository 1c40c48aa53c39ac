"""Agent module ``syncfs``: receives chunks into the node-local store and commits generations.

Targets: a relative ``--to`` lands under the pool's store on this node (``mounts/PATH``); an
absolute one must lie under an allowed root (``/workspace``, ``/env``, or ``$MONARCH_TORCHX_SYNC_ROOTS``,
':'-separated, set where the pool is created). Commits to one target are serialized; a sync
that is interrupted never switches a target.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Tuple

from .manifest import Manifest
from .store import ChunkStore, StoreError

DEFAULT_ROOTS = ("/workspace", "/env")


def store_root(agent: Any) -> Path:
    base = os.environ.get("MONARCH_TORCHX_SYNC_STORE") or os.path.join(tempfile.gettempdir(), "monarch_torchx", "syncfs")
    return Path(base) / f"{agent.pool}-host{agent.index}"


def allowed_roots() -> List[Path]:
    extra = [p for p in os.environ.get("MONARCH_TORCHX_SYNC_ROOTS", "").split(":") if p]
    return [Path(p).resolve() for p in (*DEFAULT_ROOTS, *extra)]


def resolve_target(store: ChunkStore, target: str) -> Path:
    if not target:
        raise ValueError("empty target: pass --to PATH")
    if not os.path.isabs(target):
        rel = os.path.normpath(target)
        if rel.startswith("..") or rel == ".":
            raise ValueError(f"target {target!r} leaves the pool's sync area")
        return store.root / "mounts" / rel
    path = Path(os.path.normpath(target))
    parent = path.parent.resolve()
    roots = allowed_roots()
    if not any(parent == r or r in parent.parents or path == r for r in roots):
        raise ValueError(f"target {target} is outside what this agent allows ({', '.join(map(str, roots))}; "
                         "more with MONARCH_TORCHX_SYNC_ROOTS when the pool is created); or use a relative --to")
    return path


def setup(agent: Any) -> None:
    store = ChunkStore(store_root(agent))
    locks: Dict[Path, asyncio.Lock] = {}
    made: List[Path] = []

    async def run(fn: Any, *args: Any) -> Any:
        try:
            return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
        except StoreError as e:
            raise ValueError(f"host {agent.index}: {e}") from None

    async def missing(peer: Any, hashes: List[str], target: str = "") -> List[str]:
        """The chunks this host lacks; the target is checked first, before any byte is sent."""
        if target:
            resolve_target(store, target)
        return await run(store.missing, hashes)

    async def put(peer: Any, chunks: List[Tuple[str, bytes]]) -> int:
        return await run(store.put, chunks)

    async def commit(peer: Any, target: str, manifest: str) -> Dict[str, Any]:
        path = resolve_target(store, target)
        lock = locks.setdefault(path, asyncio.Lock())
        async with lock:  # two syncs to one target: one after the other, each whole
            n = await run(store.commit, path, Manifest.from_json(manifest))
        if path not in made:
            made.append(path)
        return {"generation": n, "path": str(path)}

    async def where(peer: Any, target: str) -> Dict[str, Any]:
        path = resolve_target(store, target)
        return {"path": str(path), "generation": store.current(path)}

    def cleanup() -> None:  # a stopped pool leaves no synced trees or chunks on the node
        for p in made:
            if os.path.islink(p) and str(os.readlink(p)).startswith(str(store.root)):
                os.unlink(p)
        from .store import _rmtree

        for d in store.targets.glob("*/gen-*"):
            _rmtree(d)
        shutil.rmtree(store.root, ignore_errors=True)

    for op, fn in (("syncfs.missing", missing), ("syncfs.put", put), ("syncfs.commit", commit),
                   ("syncfs.where", where)):
        agent.add_handler(op, fn)
    agent.on_stop(cleanup)
