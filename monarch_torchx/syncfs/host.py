"""Agent module ``syncfs``: receives chunks into the node-local store and commits generations.

Targets: a relative ``--to`` lands under the pool's store on this node (``mounts/PATH``); an
absolute one must lie under an allowed root (``/workspace``, ``/env``, or ``$MONARCH_TORCHX_SYNC_ROOTS``,
':'-separated, set where the pool is created). Commits to one target are serialized; a sync
that is interrupted never switches a target.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import marshal
import os
import shutil
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from ..interpreter import module_argv
from ..private import remove_empty_dirs, sync_store_base
from ..registry import home as registry_home
from ..seam import AgentHost
from . import transfer
from . import workdir as wd
from .manifest import Manifest
from .store import ChunkStore, DiskFull, StoreError, manifest_digest

DEFAULT_ROOTS = ("/workspace", "/env")
PIPELINE_DEPTH = 4  # batches a host holds for the next one before it slows its sender down

log = logging.getLogger("monarch_torchx.agent.syncfs")


class _Link:
    """One group below this host: batches go to its first host, which passes them on to the rest."""

    def __init__(self, fw: Forwarder, group: list[dict[str, Any]], streams: int):
        self.fw, self.next, self.rest = fw, group[0], group[1:]
        self.pump = transfer.Pump(
            self._connect, self._send, PIPELINE_DEPTH, streams, f"syncfs-forward-{fw.session[:8]}"
        )
        self.failed: dict[int, str] = {}  # host index -> why; hosts after a failed one are not reached
        self.unreached: list[int] = []

    def _connect(self) -> Any:
        from .. import net

        c = net.Client(
            self.next["host"], self.next["port"], self.fw.creds, timeout=10.0, identity=self.next["identity"].encode()
        )
        c.settimeout(600.0)
        return c

    def _send(self, client: Any, batch: tuple[list[tuple[str, int]], Any]) -> None:
        index, data = batch
        args, release = transfer.outgoing(self.fw.mode, self.fw.pool, client.local_address, data)
        try:
            client.call(
                "syncfs.put",
                chunks=index,
                session=self.fw.session,
                chain=self.rest,
                chain_length=self.fw.chain_length,
                **args,
            )
        finally:
            release()

    def _fail(self, why: str) -> None:
        if not self.failed:
            self.failed[self.next["index"]] = why
            self.unreached = [h["index"] for h in self.rest]
            log.warning("sync %s: host %d failed: %s", self.fw.session[:8], self.next["index"], why)

    def finish(self) -> None:
        if self.pump.finish():
            self._fail(self.pump.error)
        if not self.failed and self.rest:
            try:
                with self._connect() as c:
                    down = c.call("syncfs.flush", session=self.fw.session)
                self.failed.update({int(k): v for k, v in down["failed"].items()})
                self.unreached = down["unreached"]
            except Exception as e:
                self._fail(str(e) or type(e).__name__)


class Forwarder:
    """Passes every batch this host received on to the hosts below it (``transfer.downstream_groups``:
    a chain, or two halves of a big group), from threads of its own (parallel streams, as from the
    client): the sender is answered as soon as a batch is stored here and queued, so each hop
    works on different batches at once."""

    def __init__(
        self,
        pool: str,
        creds: Any,
        session: str,
        chain: list[dict[str, Any]],
        mode: str,
        chain_length: int,
        streams: int = 4,
    ):
        self.pool, self.creds, self.session, self.chain_length = pool, creds, session, chain_length
        self.mode = mode  # socket or rdma: as the batches came here
        self.links = [_Link(self, g, streams) for g in transfer.downstream_groups(chain, chain_length)]
        self.last_used = time.monotonic()

    @property
    def next_hosts(self) -> list[int]:
        return [link.next["index"] for link in self.links]

    def put(self, batch: tuple[list[tuple[str, int]], Any]) -> None:
        for link in self.links:  # the same buffer to each: it is only read
            link.pump.put(batch)

    def abort(self, why: str) -> None:
        for link in self.links:
            link.pump.abort(why)

    def drain(self) -> None:
        for link in self.links:
            link.pump.finish()

    def finish(self) -> dict[str, Any]:
        failed: dict[int, str] = {}
        unreached: list[int] = []
        for link in self.links:
            link.finish()
            failed.update(link.failed)
            unreached += link.unreached
        return {"failed": failed, "unreached": unreached}


SESSION_IDLE_S = float(os.environ.get("MONARCH_TORCHX_SYNC_SESSION_IDLE_S", "300"))
SWEEP_EVERY_S = float(os.environ.get("MONARCH_TORCHX_SYNC_SWEEP_S", "600"))  # how often the store is swept


def pool_id(key: bytes) -> str:
    """Names one pool (not one pool name): two pools called alike, in two homes, never share a store."""
    return hashlib.sha256(b"monarch-torchx pool id\0" + key).hexdigest()[:12]


def store_base() -> tuple[Path, Path]:
    """(where hosts' stores go, the highest directory of it that must be ours alone)."""
    return sync_store_base()


def store_root(agent: AgentHost) -> Path:
    """This host's store: under a root of this user's alone (made 0700 and checked before use). A
    successor's (a renewed SLURM allocation's: ``agent/handover.py``) is its own, named after its
    incarnation too: its predecessor for the same host may be on the same node, and removes its
    store as it leaves."""
    own = f"-{agent.incarnation}" if agent.successor else ""
    return store_base()[0] / f"{agent.pool}-{pool_id(agent.key)}-host{agent.index}{own}"


def allowed_roots() -> list[Path]:
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
        raise ValueError(
            f"target {target} is outside what this agent allows ({', '.join(map(str, roots))}; "
            "more with MONARCH_TORCHX_SYNC_ROOTS when the pool is created); or use a relative --to"
        )
    return path


def fuse_available() -> str:
    """Why FUSE cannot serve targets here ("" when it can)."""
    if os.environ.get("MONARCH_TORCHX_SYNC_FUSE", "1") == "0":
        return "disabled by MONARCH_TORCHX_SYNC_FUSE=0"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    import importlib.util

    if importlib.util.find_spec("pyfuse3") is None:
        return "pyfuse3 is not installed"
    return ""


class Mount:
    """The FUSE process serving one target; switched by SIGUSR1, confirmed through ``current``."""

    def __init__(self, store: ChunkStore, target: Path):
        """Starts the server in standby: imported and waiting, not mounted yet (see ``start``), so
        a sync can have it ready while its last chunks are still on the way."""
        import subprocess

        self.target, self.tdir, self.started = target, store.target_dir(target), False
        if os.path.ismount(target):  # served by the FUSE process of an earlier agent of this host
            _end_orphans(str(target))
        if store.root in target.parents:  # a relative --to: inside the store, made private like it
            store.make_dir(target)
        else:
            target.mkdir(parents=True, exist_ok=True)
        if any(target.iterdir()):
            raise StoreError(
                f"{target} is a non-empty directory: syncfs mounts its generations there; "
                "empty it or choose another --to"
            )
        store.make_dir(self.tdir)
        self.log_path = self.tdir / "fuse.log"
        log_fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(log_fd, "ab") as err:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                module_argv("monarch_torchx.syncfs.fusefs", str(self.tdir), str(target), str(store.root)),
                stdout=subprocess.PIPE,
                stderr=err,
                stdin=subprocess.PIPE,
                start_new_session=True,
                cwd=self.tdir,
            )

    def start(self) -> None:
        """Mounts ``current`` (the generation just committed); returns once the mount serves it."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(b"mount\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # it exited: said below
        line = self.proc.stdout.readline()
        if line.strip() != b"mounted":
            self.proc.kill()
            self.proc.wait()
            log_path = self.log_path
            tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] if log_path.exists() else []
            raise StoreError(f"could not mount {self.target} with FUSE: {' '.join(tail) or 'no reason given'}")
        self.started = True

    def alive(self) -> bool:
        return self.proc.poll() is None

    def switch(self, n: int, timeout: float = 10.0) -> None:
        """Tells the FS to serve ``current`` and waits until it says, on its stdout, that it does."""
        import select
        import signal
        import time

        assert self.proc.stdout is not None
        os.kill(self.proc.pid, signal.SIGUSR1)
        deadline = time.time() + timeout
        while (left := deadline - time.time()) > 0 and select.select([self.proc.stdout], [], [], left)[0]:
            line = self.proc.stdout.readline().decode(errors="replace").strip()
            if line == f"serving {n}":
                return
            if not line or line.startswith("failed"):
                raise StoreError(
                    f"the file system at {self.target} did not switch to generation {n}: {line or 'it exited'}"
                )
        raise StoreError(f"the file system at {self.target} did not switch to generation {n} within {timeout:.0f} s")

    def stop(self) -> None:
        import subprocess

        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if os.path.ismount(self.target):
            subprocess.run(["umount", "-l", str(self.target)], capture_output=True)
            subprocess.run(["fusermount3", "-u", "-z", str(self.target)], capture_output=True)


def _end_orphans(target: str) -> None:
    """Stops the FUSE server an agent that died left serving ``target``, and unmounts it."""
    import signal
    import subprocess
    import time

    from .. import procfs

    for pid in procfs.pids_with(b"monarch_torchx.syncfs.fusefs", os.fsencode(target)):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.time() + 5
    while os.path.ismount(target) and time.time() < deadline:
        time.sleep(0.05)
    if os.path.ismount(target):
        subprocess.run(["umount", "-l", target], capture_output=True)


class SyncfsModule:
    """This host's side of syncfs, plugged into its agent (``AgentModule``): the ``syncfs.*``
    operations (chunks in, chains on, manifests prepared and committed, targets served), two
    background sweeps, and at stop no mount, synced tree or chunk left on the node."""

    def __init__(self, agent: AgentHost):
        self.agent = agent
        self.store = ChunkStore(store_root(self.agent), private_from=store_base()[1])
        self.mounts: dict[Path, Mount] = {}
        self.no_fuse = fuse_available()
        self.locks: dict[Path, asyncio.Lock] = {}
        self.made: list[Path] = []
        self.views: list[Path] = []  # the pool's views of targets this host pointed at its copies
        self.sessions: dict[str, Forwarder] = {}
        self.abandoned: OrderedDict[str, int] = OrderedDict()  # session -> the next host, for a late flush
        self.prepared: OrderedDict[tuple[Path, str], tuple[Manifest, bytes]] = OrderedDict()
        self.sweep_soon = asyncio.Event()  # a commit dropped a generation: its chunks may go

    def operations(self) -> dict[str, Any]:
        return {
            "syncfs.missing": (self.missing, lambda _args, lists: sorted(set().union(*lists))),
            "syncfs.put": (self.put, None),
            "syncfs.flush": (self.flush, None),
            "syncfs.give_back": (self.give_back, None),
            "syncfs.prepare": (self.prepare, None),
            "syncfs.commit": (self.commit, None),
            "syncfs.where": (self.where, None),
            "syncfs.workdir": (self.workdir, None),
            "syncfs.view": (self.view, None),
            "syncfs.shared_workdir": (self.shared_workdir, None),
            "syncfs.check_shared": (self.check_shared, None),
            "syncfs.sessions": (self.open_sessions, None),
        }

    def background_tasks(self) -> list[Any]:
        return [self.reap_abandoned(), self.sweep_store()]

    def warm_imports(self) -> list[str]:
        return []

    async def reap_abandoned(self) -> None:
        """Drops the forwarders of syncs whose client went away without a flush (killed,
        interrupted): their threads and connections would otherwise live as long as the agent."""
        while True:
            await asyncio.sleep(max(0.2, SESSION_IDLE_S / 4))
            now = time.monotonic()
            for sid in [sid for sid, fw in self.sessions.items() if now - fw.last_used > SESSION_IDLE_S]:
                fw = self.sessions.pop(sid)
                fw.abort("abandoned")
                self.abandoned[sid] = fw.next_hosts[0]
                while len(self.abandoned) > 256:
                    self.abandoned.popitem(last=False)
                log.warning("sync %s: no batch for %.0f s: dropped its forwarding", sid[:8], now - fw.last_used)
                await self.run(fw.drain)  # its threads drain the queues and close their connections
                await self.run(self.store.give_back, sid)  # its client is gone: so is what it stored

    async def open_sessions(self, peer: Any) -> list[dict[str, Any]]:
        """The chained syncs this host is forwarding now (session, next host, seconds idle)."""
        now = time.monotonic()
        return [
            {"session": sid, "next": fw.next_hosts, "idle_s": round(now - fw.last_used, 1)}
            for sid, fw in self.sessions.items()
        ]

    async def run(self, fn: Any, *args: Any) -> Any:  # a StoreError's type reaches the client, which names the host
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def missing(self, peer: Any, hashes: list[str], target: str = "") -> list[str]:
        """The chunks this host lacks; the target is checked first, before any byte is sent."""
        if target:
            resolve_target(self.store, target)
        return await self.run(self.store.missing, hashes)

    async def put(
        self,
        peer: Any,
        chunks: list[tuple[str, int]],
        data: Any = None,
        rdma: Any = None,
        session: str = "",
        chain: list[dict[str, Any]] | None = None,
        chain_length: int = transfer.CHAIN_LENGTH,
    ) -> dict[str, Any]:
        """Stores a batch (``data``, or what ``rdma`` points at: the ``chunks``, (name, size) each,
        end to end); with a ``chain`` (every host below this one), also passes it on to them."""
        data, via = await self.run(transfer.incoming, self.agent.pool, self.agent.creds, data, rdma)
        try:
            stored = await self.run(self.store.put, chunks, data, session)
        except DiskFull:  # this host's part of the sync has failed: what it stored goes now
            if session:
                freed = await self.run(self.store.give_back, session)
                log.warning("sync %s: disk full; gave back %d bytes it had stored", session[:8], freed)
            raise
        if chain:
            fw = self.sessions.get(session)
            if fw is None:  # no await between the check and the insert: parallel streams share one
                fw = self.sessions[session] = Forwarder(
                    self.agent.pool,
                    self.agent.creds,
                    session,
                    chain,
                    transfer.forwarding(via),
                    max(1, int(chain_length)),
                )
            fw.last_used = time.monotonic()
            await self.run(fw.put, (chunks, data))
        return {"stored": stored, "via": via}

    async def give_back(self, peer: Any, session: str) -> int:
        """The client's word that sync ``session`` failed here (or as a whole): its chunks' space is
        given back now (``ChunkStore.give_back``); returns the bytes freed."""
        fw = self.sessions.pop(session, None)
        if fw is not None:
            fw.abort("the sync failed")
            await self.run(fw.drain)
        return await self.run(self.store.give_back, session)

    async def flush(self, peer: Any, session: str) -> dict[str, Any]:
        """Waits until every batch of the session went down the chain; who failed, who was not reached."""
        fw = self.sessions.pop(session, None)
        if fw is None and session in self.abandoned:
            why = f"the sync stalled for more than {SESSION_IDLE_S:.0f} s and this host dropped its forwarding"
            return {"failed": {self.abandoned[session]: why}, "unreached": []}
        if fw is None:
            return {"failed": {}, "unreached": []}
        return await self.run(fw.finish)

    def parse(self, data: Any) -> Manifest:
        if not isinstance(data, bytes):
            raise ValueError("manifest must be the bytes of Manifest.dumps()")
        try:
            return Manifest.from_rows(marshal.loads(data))
        except (ValueError, EOFError, TypeError) as e:
            raise ValueError(f"malformed manifest: {e}") from None

    def fuse_for(self, path: Path) -> bool:
        return not self.no_fuse and not os.path.islink(path)  # a target first served materialized stays so

    def serving(self, path: Path) -> bool:
        """Whether the target shows its current generation: a FUSE target only while its server
        runs (after a failed mount, or under a new agent, the same tree is committed again)."""
        if not self.fuse_for(path):
            return True
        m = self.mounts.get(path)
        return m is not None and m.started and m.alive()

    def unchanged(self, path: Path, digest: str) -> int | None:
        return self.store.unchanged(path, digest) if self.serving(path) else None

    def standby(self, path: Path) -> None:
        """A FUSE server for a target that has none yet, started ahead of its first commit."""
        m = self.mounts.get(path)
        if self.fuse_for(path) and (m is None or not m.alive()):
            if m is not None:
                m.stop()
            self.mounts[path] = Mount(self.store, path)

    def commit_blocking(self, path: Path, manifest: Manifest, data: bytes) -> tuple[dict[str, Any], bool]:
        """The commit's answer, and whether it dropped a generation (then a sweep is due)."""
        fuse = self.fuse_for(path)
        if fuse:
            self.standby(path)  # started first: a target that cannot be mounted (not empty) is refused here
        n = self.store.commit(path, manifest, fuse, data)
        if fuse:
            m = self.mounts[path]
            if not m.started:
                m.start()  # serves ``current``: generation n
            else:
                m.switch(n)
        self.store.committed(manifest.chunk_sizes())  # a kept generation now protects them
        # the sweep (which may rewrite packs) runs after the reply, on the module's own task
        dropped = self.store.collect(path, sweep_every_s=None)
        return {
            "generation": n,
            "path": str(path),
            "served_by": "fuse" if fuse else f"symlink ({self.no_fuse})",
        }, dropped

    async def prepare(self, peer: Any, target: str, digest: str, manifest: bytes | None = None) -> dict[str, Any]:
        """Gets a commit ready while the sync's last chunks are still on their way: the manifest
        checked and kept (by its digest), the target's FUSE server started. Without a
        ``manifest``, says whether one is needed: not when the target already serves that tree
        (``unchanged``) or one with that digest is ready."""
        path = resolve_target(self.store, target)
        n = self.unchanged(path, digest)
        if n is not None:  # what a commit would answer: the client need not ask for it
            return {
                "unchanged": True,
                "prepared": False,
                "generation": n,
                "path": str(path),
                "served_by": "fuse" if self.fuse_for(path) else f"symlink ({self.no_fuse})",
            }
        if (path, digest) not in self.prepared:
            if manifest is None:
                return {"unchanged": False, "prepared": False}
            if not isinstance(manifest, bytes) or manifest_digest(manifest) != digest:
                raise ValueError("the manifest does not match its digest")
            self.prepared[(path, digest)] = (await self.run(self.parse, manifest), manifest)
            while len(self.prepared) > 4:  # abandoned syncs' manifests
                self.prepared.popitem(last=False)
        async with self.locks.setdefault(path, asyncio.Lock()):  # one server per target, even for two syncs
            await self.run(self.standby, path)
        return {"unchanged": False, "prepared": True}

    async def commit(self, peer: Any, target: str, manifest: bytes | None = None, digest: str = "") -> dict[str, Any]:
        """Commits a generation: the one ``prepare`` made ready under ``digest``, or ``manifest``
        (its ``Manifest.dumps()``). ``committed`` is False when neither is at hand (then send the
        manifest); a target that already serves that tree changes nothing (``unchanged``)."""
        path = resolve_target(self.store, target)
        lock = self.locks.setdefault(path, asyncio.Lock())
        async with lock:  # two syncs to one target: one after the other, each whole
            if manifest is None:
                n = self.unchanged(path, digest)
                ready = self.prepared.pop((path, digest), None) if n is None else None
                if ready is None:
                    return {
                        "committed": n is not None,
                        "unchanged": n is not None,
                        "generation": n,
                        "path": str(path),
                        "served_by": "fuse" if self.fuse_for(path) else f"symlink ({self.no_fuse})",
                    }
                out, dropped = await self.run(self.commit_blocking, path, *ready)  # off the event loop
            else:
                out, dropped = await self.run(lambda: self.commit_blocking(path, self.parse(manifest), manifest))
        if path not in self.made:
            self.made.append(path)
        if dropped:
            self.sweep_soon.set()
        return {**out, "committed": True, "unchanged": False}

    def _served(self, target: str) -> tuple[Path, int]:
        """This host's copy of ``target`` and its generation; LookupError when nothing is synced there."""
        path = resolve_target(self.store, target)
        gen = self.store.current(path)
        if gen is None:
            raise LookupError(f"nothing is synced to {target} on host {self.agent.index}")
        return path, gen

    async def workdir(self, peer: Any, target: str) -> dict[str, Any]:
        """This host's own writable working directory over its copy of ``target`` (see workdir.py):
        where the hosts share no file system."""
        path, gen = self._served(target)
        d = wd.workdir_root(registry_home(), self.agent.pool, target, self.agent.index)
        return {"path": str(await self.run(wd.refresh, path, d, gen)), "generation": gen}

    def view_path(self, target: str) -> Path:
        """The pool's view of ``target``: a path that is the same string on every node, through which
        a shared working directory's links reach each host's own copy. An absolute target is
        one already; a relative one's copy is under this host's store, so a symlink beside it."""
        if os.path.isabs(target):
            return resolve_target(self.store, target)
        rel = os.path.normpath(target)
        return store_base()[0] / f"{self.agent.pool}-{pool_id(self.agent.key)}-views" / rel

    async def view(self, peer: Any, target: str) -> dict[str, Any]:
        """Points the pool's view of ``target`` on this node at this host's copy."""
        path, _ = self._served(target)
        view = self.view_path(target)
        if view != path:
            await self.run(wd.point_view, view, path, store_base()[1])
            if view not in self.views:
                self.views.append(view)
        return {"view": str(view)}

    async def shared_workdir(self, peer: Any, target: str, view: str, nonce: str) -> dict[str, Any]:
        """Refreshes the pool's shared working directory over ``target`` (one host does, for all),
        its links through the pool's view (the ``view`` every host reported); ``nonce`` is left
        beside it for the others to read back."""
        path, gen = self._served(target)
        mine = self.view_path(target)
        if str(mine) != view:
            raise ValueError(f"host {self.agent.index} keeps its view of {target} at {mine}, not {view}")
        d = wd.shared_root(registry_home(), self.agent.pool, target)
        try:  # the tree's digest, not its generation number: numbers differ between hosts
            stamp = (self.store.target_dir(path) / f"gen-{gen}.digest").read_text()
        except OSError:
            stamp = f"generation {gen}"
        out = await self.run(wd.refresh_shared, path, d, stamp, mine, nonce)
        return {"path": str(out), "generation": gen}

    async def check_shared(self, peer: Any, target: str, view: str, nonce: str) -> dict[str, Any]:
        """Whether this host can run in the shared working directory: it sees the directory the
        other host refreshed (``nonce``), and the view leads to its own copy here. ``why`` if not."""
        path, _ = self._served(target)
        mine = self.view_path(target)
        d = wd.shared_root(registry_home(), self.agent.pool, target)
        why = (
            await self.run(wd.sees_shared, d, nonce)
            or (f"its view of {target} is {mine}, not {view}" if str(mine) != view else "")
            or await self.run(wd.view_shows, mine, path)
        )
        return {"why": why and f"host {self.agent.index}: {why}"}

    def drop_views(self) -> None:
        """At stop: the views that lead to this host's copies (or to nothing) go, and their directory
        once empty; one another host of a shared temp directory points elsewhere is that host's."""
        for v in self.views:
            with contextlib.suppress(OSError):
                dest = os.readlink(v)
                if dest.startswith(str(self.store.root) + os.sep) or not os.path.exists(v):
                    os.unlink(v)
            remove_empty_dirs(v.parent, store_base()[0] / f"{self.agent.pool}-{pool_id(self.agent.key)}-views")

    async def where(self, peer: Any, target: str) -> dict[str, Any]:
        path = resolve_target(self.store, target)
        return {"path": str(path), "generation": self.store.current(path)}

    def stop(self) -> None:  # a stopped pool leaves no mounts, synced trees or chunks on the node
        for fw in self.sessions.values():
            fw.abort("the pool is stopping")  # its threads drain what is queued and end
        for m in self.mounts.values():
            m.stop()
        for p in self.made:
            if os.path.islink(p) and str(os.readlink(p)).startswith(str(self.store.root) + os.sep):
                os.unlink(p)
        self.drop_views()
        from .store import _rmtree

        for d in self.store.targets.glob("*/gen-*"):
            _rmtree(d)
        shutil.rmtree(self.store.root, ignore_errors=True)
        # the user's syncfs directory (and temp root), once no pool of theirs uses it
        remove_empty_dirs(self.store.root.parent, self.store.private_from)

    async def sweep_store(self) -> None:
        """Sweeps the chunk store every SWEEP_EVERY_S (chunks of syncs that never committed:
        aborted, or to new targets), and soon after a commit dropped a generation (at most once
        a minute), so that a commit's reply never waits for a sweep."""
        while True:
            try:
                await asyncio.wait_for(self.sweep_soon.wait(), SWEEP_EVERY_S)
                every = 60.0
            except asyncio.TimeoutError:
                every = 0.0
            self.sweep_soon.clear()
            try:
                await asyncio.get_running_loop().run_in_executor(None, self.store.sweep, every)
            except OSError as e:
                log.warning("syncfs: sweeping the chunk store failed: %s", e)


def setup(agent: AgentHost) -> None:
    agent.install(SyncfsModule(agent))
