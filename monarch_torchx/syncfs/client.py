"""The client side of ``monarch-torchx sync``: scan, send each host only what it lacks, commit.

Every host is fed in parallel over its own authenticated connection: first the list of chunk
hashes (the host answers with those it lacks), then the missing chunks in batches, then the
manifest, which the host commits as a new generation. A host that fails (dead, disk full) is
named in the report; the others still commit. A batch the host finds corrupted (its bytes do not
hash to their names) is sent again.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Sequence, cast

from ..errors import HostUnreachable, MonarchError
from ..registry import Registry, home
from ..wire import FileRegion, FileRegionError, Gathered
from . import replay, transfer
from .ignore import IgnoreRules
from .manifest import CDC, ChunkSource, HashCache, Manifest, scan_groups
from .store import ChunkCorrupt, manifest_digest

BATCH_BYTES = 8 << 20
STREAMS = 4  # parallel connections to a host while sending
QUEUED_BATCHES = 8  # batches read ahead of the senders (about 64 MiB)
RETRIES = 3
CHAIN_LENGTH = transfer.CHAIN_LENGTH


@dataclass
class HostResult:
    index: int
    ok: bool
    generation: int | None = None
    path: str = ""
    bytes_sent: int = 0
    error: str = ""  # "host N: why" (it names the host), empty when ok
    served_by: str = ""  # "fuse", or "symlink (why not FUSE)"


@dataclass
class SyncReport:
    """What `sync --json` prints."""

    files: int
    bytes: int
    bytes_sent: int
    bytes_skipped: int
    seconds: float
    generation: int | None
    hosts: list[HostResult] = field(default_factory=list)
    transfer: str = ""  # how the bytes went: "socket", or "rdma/<backend>" (as the first host pulled them)
    digest: str = ""  # the committed manifest's hash: the tree as synced

    @property
    def ok(self) -> bool:
        return all(h.ok for h in self.hosts)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


class BatchBuffers:
    """Memory for batches on their way, reused from one batch to the next: a fresh 8 MiB buffer
    per batch costs a page fault and a zeroing per page, about what reading the bytes into it
    costs. At most one buffer per batch in flight is kept."""

    def __init__(self, keep: int = QUEUED_BATCHES + STREAMS):
        self._free: list[bytearray] = []
        self._keep = keep
        self._lock = threading.Lock()

    def take(self, n: int) -> bytearray:
        with self._lock:
            for i, buf in enumerate(self._free):
                if len(buf) >= n:
                    return self._free.pop(i)
        return bytearray(max(n, BATCH_BYTES + CDC["max_size"]))  # any batch fits: it ends past BATCH_BYTES by < 1 chunk

    def give(self, buf: bytearray) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(buf)


def batch_parts(batch: list[str], sources: dict[str, ChunkSource]) -> tuple[list[tuple[str, int]], Gathered]:
    """A batch's chunks as the parts of one buffer that is never assembled here: a small file's
    bytes kept from hashing it, and each run of adjacent chunks of one file as a region of that
    file, which a plain socket sends from the page cache (``net.send_region``; over TLS it is
    read in slices, to be encrypted). The host gets one buffer, as from ``read_batch``."""
    index: list[tuple[str, int]] = []
    parts: list[Any] = []
    for h in batch:
        src = sources[h]
        index.append((h, src.size))
        data = src.data  # once: the scan loop may drop it meanwhile
        if data is not None and len(data) == src.size:
            parts.append(data)
            continue
        last = parts[-1] if parts else None
        if isinstance(last, FileRegion) and last.path == src.path and last.offset + last.size == src.offset:
            parts[-1] = FileRegion(src.path, last.offset, last.size + src.size)
        else:
            parts.append(FileRegion(src.path, src.offset, src.size))
    return index, Gathered(parts)


def read_batch(
    batch: list[str], sources: dict[str, ChunkSource], buffers: BatchBuffers | None = None
) -> tuple[list[tuple[str, int]], memoryview]:
    """A batch's chunks read straight into one buffer (for rdma, which reads from registered
    memory), which travels out of band: neither side copies it into or out of a pickle, and a
    host forwards the very buffer it received. The buffer comes from ``buffers`` (give it back
    once the batch is sent) or is new."""
    index = [(h, sources[h].size) for h in batch]
    total = sum(n for _, n in index)
    view, off = memoryview(buffers.take(total) if buffers else bytearray(total))[:total], 0
    for h, n in index:
        src = sources[h]
        data = src.data  # once: the scan loop may drop it meanwhile
        if data is not None and len(data) == n:
            view[off : off + n] = data
            off += n
            continue
        fd = os.open(src.path, os.O_RDONLY)
        try:
            got = 0
            while got < n:
                k = os.preadv(fd, [view[off + got : off + n]], src.offset + got)
                if k == 0:
                    raise MonarchError(f"{src.path} shrank while it was synced; nothing was committed: sync again")
                got += k
        finally:
            os.close(fd)
        off += n
    return index, view


class _Progress:
    """Calls ``say`` at most twice a second with files, bytes, rate and each host's state."""

    def __init__(self, say: Callable[[str], None], total: int, hosts: list[int]):
        self.say, self.total, self.start = say, total, time.time()
        self.sent = {i: 0 for i in hosts}
        self.state = {i: "checking" for i in hosts}
        self.last = 0.0
        self.client_bytes = 0  # what left this machine (a chain sends each byte once)
        self.files = 0  # read so far
        self.lock = threading.Lock()

    def update(self, i: int, sent: int = 0, state: str | None = None, force: bool = False) -> None:
        with self.lock:
            self.sent[i] += sent
            self.client_bytes += sent
            if state:
                self.state[i] = state
            now = time.time()
            if not force and now - self.last < 0.5:
                return
            self.last = now
            total = sum(self.sent.values())
            rate = total / max(now - self.start, 1e-6) / 1e6
            hosts = " ".join(f"h{i}:{s}" for i, s in sorted(self.state.items()))
            self.say(f"sync: {self.files} files read, {total / 1e6:.1f} MB sent, {rate:.0f} MB/s; {hosts}")


def _cache_for(src: str) -> HashCache:
    key = hashlib.sha256(os.path.realpath(src).encode()).hexdigest()[:24]
    return HashCache(home() / "syncfs-cache" / f"{key}.cache")


def sync(
    pool: Any,
    src: str,
    target: str,
    hosts: list[int] | None = None,
    progress: Callable[[str], None] = lambda _m: None,
    timeout: float = 600.0,
    fanout: str = "chain",
    exclude: Sequence[str] = (),
    chain_length: int = CHAIN_LENGTH,
    remember: bool = True,
) -> SyncReport:
    """Syncs directory ``src`` to ``target`` on every host of ``pool`` (or ``hosts``).

    ``fanout="chain"``: the client sends each missing chunk once, to the first host, which
    stores it and passes it on down a pipelined chain, so N hosts take about as long as one;
    hosts a broken chain did not reach are then fed directly. More than ``chain_length`` hosts
    are split in two halves, and so is any half that is still longer, at the client and at each
    host that feeds one (``transfer.downstream_groups``): no machine sends a chunk more than
    twice, and a chain's fill time and a failure's reach stay bounded. ``"star"``: the client
    feeds every host itself. Paths matching ``src/.torchxignore`` (TorchX's workspace rules) or
    ``exclude`` (the same ``fnmatch`` syntax) are left out. ``remember``: a sync some host
    committed is remembered in the pool's state dir, for hosts that join later (``replay.py``).
    """
    t0 = time.time()
    if not os.path.exists(src):
        raise MonarchError(f"sync source {src!r} does not exist")
    if not os.path.isdir(src):
        raise MonarchError(f"sync source {src!r} is not a directory (sync a directory holding it)")
    if not target:
        raise MonarchError("no target: pass --to PATH (relative paths land in the pool's own sync area)")
    if fanout not in ("chain", "star"):
        raise MonarchError(f"fanout={fanout!r}: use chain or star")
    if chain_length < 1:
        raise MonarchError(f"chain_length={chain_length}: a chain holds at least one host")
    indices = list(range(len(pool.hosts))) if hosts is None else hosts
    bad = [i for i in indices if not 0 <= i < len(pool.hosts)]
    if bad:
        raise MonarchError(f"pool {pool.name!r} has no host(s) {bad} (it has {len(pool.hosts)})")
    transfer.requested_mode()  # a bad setting is an error even when nothing needs sending
    cache = _cache_for(src)
    ignore = IgnoreRules.for_tree(src, list(exclude))
    meter = _Progress(progress, 0, indices)
    results = {i: HostResult(i, False) for i in indices}
    conns: dict[int, Any] = {}
    entries: list[Any] = []
    sources: dict[str, ChunkSource] = {}
    sizes: dict[str, int] = {}

    def fail(i: int, why: str) -> None:
        """Records host ``i``'s first error, naming the host (a report lists many)."""
        if not results[i].error:
            results[i].error = f"host {i}: {why}"

    def each(fn: Callable[[int], Any], which: list[int]) -> dict[int, Any]:
        out: dict[int, Any] = {}

        def guarded(i: int) -> None:
            try:
                out[i] = fn(i)
            except Exception as e:  # one host's failure is reported, the others carry on
                fail(i, str(e) or type(e).__name__)
                meter.update(i, state="FAILED")

        with ThreadPoolExecutor(max_workers=min(16, max(1, len(which)))) as ex:
            list(ex.map(guarded, which))
        return out

    def connect(i: int) -> Any:
        c = pool.connect(i, timeout=10.0)
        c.settimeout(timeout)
        return c

    def ask(op: str, which: list[int], **args: Any) -> dict[int, Any]:
        """``op`` on each host of ``which``, through the pool's relay tree from 32 hosts on (the
        client opens a few connections, not one per host); the values by host. A host's failure
        is recorded, naming it; the others carry on."""
        out: dict[int, Any] = {}
        again: list[int] = []
        for i, value, err in pool.ask(op, which, timeout=timeout, **args) if which else []:
            if isinstance(err, HostUnreachable):  # not reached (a relay could not, in its dial time)
                again.append(i)
            elif err is not None:
                fail(i, str(err) or type(err).__name__)
                meter.update(i, state="FAILED")
            else:
                out[i] = value

        def patiently(i: int) -> Any:  # every step may run twice: a commit done already says unchanged
            with connect(i) as c:
                return c.call(op, **args)

        out.update(each(patiently, again))
        return out

    def lacking(group: list[int], hashes: list[str]) -> set:
        """The chunks some host of ``group`` lacks (a relay answers with its subtree's union)."""
        got = ask("syncfs.missing", ok(group), hashes=hashes)
        return set().union(*(v for v in got.values() if v is not None))  # None: in another host's answer

    def head(i: int) -> Any:
        """The client's own connection to host ``i`` (a chain's head): for its flush."""
        if i not in conns:
            conns[i] = connect(i)
        return conns[i]

    vias: list[str] = []
    how = {"mode": "socket", "pool": pool.name, "bind": "", "vias": vias, "buffers": BatchBuffers()}

    def ok(which: list[int]) -> list[int]:
        return [i for i in which if not results[i].error]

    def give_back(which: list[int]) -> None:
        """Hosts where this sync failed (or all, when it fails as a whole) free what it stored
        there now, not after the store's grace (best effort: a host that cannot be asked keeps
        them until its sweep)."""
        if which and how.get("session"):
            with contextlib.suppress(MonarchError):
                pool.ask("syncfs.give_back", which, timeout=10.0, session=how["session"])

    def sender(i: int, **extra: Any) -> transfer.Pump:
        """Feeds host ``i`` (a chain's head, or a host fed directly): the queue carries on from one
        group of the tree to the next without a pause."""

        def send(conn: Any, batch: list[str]) -> None:
            _send(conn, batch, sources, how, **extra)
            meter.update(i, sum(sizes[h] for h in batch))

        return transfer.Pump(lambda: connect(i), send, QUEUED_BATCHES, STREAMS, "syncfs-send")

    def submit(pump: transfer.Pump, hashes: list[str]) -> None:
        for batch in _batches(hashes, sizes):
            pump.put(batch)

    def finish(senders: dict[int, transfer.Pump]) -> dict[int, int]:
        """Waits for the senders; the bytes each host was sent (by the client)."""
        for i, pump in senders.items():
            if pump.finish():
                fail(i, pump.error)
                meter.update(i, state="FAILED")
        return {i: meter.sent[i] for i in senders}

    digest = ""
    try:
        groups = _read_errors_are_one_line(src, _prefetch(scan_groups(src, cache, ignore=ignore)))
        known, whole = _read_while_cached(groups, cache)
        settled: dict[int, Any] = {}
        if whole:
            # the hash cache knew the whole tree, so its digest is at hand before any host is asked:
            # one request settles each host whose target already serves it (a no-op resync), and
            # checks the target of the others
            data = Manifest([e for g, _ in known for e in g]).dumps()
            digest = manifest_digest(data)
            settled = _already_serving(ask("syncfs.prepare", indices, target=target, digest=digest))
        else:
            ask(
                "syncfs.missing", indices, hashes=[], target=target
            )  # does each accept the target? (before a byte moves)
        live = [i for i in ok(indices) if i not in settled]
        if live:
            how["bind"] = head(live[0]).local_address
            how["mode"] = transfer.choose(how["bind"])
        chained = fanout == "chain" and len(live) > 1
        chains = transfer.downstream_groups(live, chain_length) if chained else [[i] for i in live]
        session = how["session"] = uuid.uuid4().hex
        for i in live:
            meter.update(i, state="chain" if chained else "sending")
        addrs = pool.hosts
        # one sender per chain head (or per host fed directly), each with STREAMS connections of its own
        senders = {
            c[0]: sender(
                c[0],
                session=session,
                chain_length=chain_length,
                chain=[
                    {
                        "index": i,
                        "host": addrs[i].host,
                        "port": addrs[i].port,
                        "identity": addrs[i].identity(pool.name).decode(),
                    }
                    for i in c[1:]
                ],
            )
            if chained
            else sender(c[0], session=session)
            for c in chains
        }
        recent: list[list[str]] = []
        try:
            # the tree is read and hashed group by group in a thread; each group's batches are queued
            # to the senders and the loop moves on, so the links stay busy from one group to the next
            for group, found in itertools.chain(known, groups):
                entries += group
                meter.files += len(group)
                new = [h for h in found if h not in sizes]
                for h in new:
                    sizes[h] = found[h].size
                    sources[h] = found[h]
                if not new:
                    continue
                for c in chains:
                    if not results[c[0]].error and not senders[c[0]].error:
                        wanted = lacking(c, new)
                        submit(senders[c[0]], [h for h in new if h in wanted])
                recent.append(new)
                if len(recent) > 2:  # long since read by the senders: a later resend reads the files
                    for h in recent.pop(0):
                        sources[h].data = None
            # the whole tree is read: while its last batches are still on the way, each host checks
            # the manifest and starts the target's FUSE server, so the commit after them is short
            if not whole:
                data = Manifest(entries).dumps()
                digest = manifest_digest(data)
            ready = ask("syncfs.prepare", ok(live), target=target, digest=digest)
            ask(
                "syncfs.prepare",
                [i for i, r in ready.items() if not r["unchanged"] and not r["prepared"]],
                target=target,
                digest=digest,
                manifest=data,
            )
        except BaseException:
            for pump in senders.values():  # the sync is over: drop what is queued
                pump.abort("cancelled")
            give_back(live)
            raise
        finally:
            sent = finish(senders)
        feed: list[int] = []
        for c in chains:
            first, rest = c[0], c[1:]
            down: dict[str, Any] = {"failed": {}, "unreached": rest}
            if chained and not results[first].error:
                try:
                    down = head(first).call("syncfs.flush", session=session)
                except Exception as e:
                    fail(first, str(e) or type(e).__name__)
            for k, why in down["failed"].items():
                fail(int(k), why)
            for i in c:
                if i not in down["unreached"] and not results[i].error:
                    results[i].bytes_sent = sent[first]
            feed += [i for i in down["unreached"] if not results[i].error]  # a broken chain: fed directly
        if feed:  # each host the chain did not reach is fed what it lacks of the whole tree
            own = each(lambda i: pool.call(i, "syncfs.missing", timeout=timeout, hashes=list(sizes)), feed)
            direct = {i: sender(i) for i in own}
            for i, pump in direct.items():
                submit(pump, own[i])
            for i, n in finish(direct).items():
                results[i].bytes_sent = n
        cache.save()

        # a host whose target already serves this tree said so at prepare, with what a commit answers
        done = {i: r for i, r in _already_serving(ready).items() if not results[i].error}
        done.update(settled)
        for i in ok(live):
            meter.update(i, state="committing")
        done.update(ask("syncfs.commit", [i for i in ok(live) if i not in done], target=target, digest=digest))
        again = [i for i, out in done.items() if not out["committed"]]  # nothing prepared (restarted?)
        for i in again:
            del done[i]
        done.update(ask("syncfs.commit", again, target=target, manifest=data))  # so: with the manifest
        give_back([i for i in live if results[i].error])
        for i, out in done.items():
            results[i].ok, results[i].generation, results[i].path = True, out["generation"], out["path"]
            results[i].served_by = out.get("served_by", "")
            meter.update(i, state=f"gen {out['generation']}")
    finally:
        for c in conns.values():
            c.close()
    meter.update(indices[0] if indices else 0, force=True)
    per_host = [results[i] for i in indices]
    delivered = sum(r.bytes_sent for r in per_host)
    total = sum(e.size for e in entries if e.kind == "f")
    gens = {cast(int, r.generation) for r in per_host if r.ok}  # an ok host has the generation it committed
    if remember and gens:
        replay.remember(pool.record.state_dir, replay.SyncRecord(os.path.abspath(src), target, list(exclude), digest))
        _to_successors(pool, src, target, indices, exclude, progress)
    return SyncReport(
        files=sum(1 for e in entries if e.kind in ("f", "h", "l")),
        bytes=total,
        bytes_sent=meter.client_bytes,
        bytes_skipped=max(0, total * len(indices) - delivered),
        seconds=round(time.time() - t0, 3),
        generation=max(gens) if gens else None,
        hosts=per_host,
        transfer=vias[0] if vias else how["mode"],
        digest=digest,
    )


def _to_successors(
    pool: Any, src: str, target: str, indices: list[int], exclude: Sequence[str], progress: Callable[[str], None]
) -> None:
    """The same sync to the successors waiting on standby to take some of ``indices`` over (a
    SLURM pool's renewal, ``agent/handover.py``): they were given what was synced before they
    started, and take this one with them too."""
    waiting = list(Registry.standby_hosts(pool.record.state_dir, indices))
    if not waiting:
        return
    report = sync(pool.successors(waiting), src, target, hosts=waiting, exclude=exclude, remember=False)
    missed = [h.error for h in report.hosts if not h.ok]
    not_reached = f"; not reached: {'; '.join(missed)} (sync again once they took their hosts over)" if missed else ""
    progress(f"also synced to the successor(s) waiting to take host(s) {waiting} over{not_reached}")


def _read_while_cached(
    groups: Iterator[tuple[list[Any], dict[str, ChunkSource]]], cache: HashCache
) -> tuple[list[tuple[list[Any], dict[str, ChunkSource]]], bool]:
    """The tree's first groups, taken while every file in them came from the hash cache (nothing
    read, so nothing held), and whether they are the whole tree. The first group with a file to
    read ends it (the scan runs a group or two ahead, so it may end one group early): that one is
    taken too, and the sync goes on pipelined from there."""
    taken = []
    for item in groups:
        taken.append(item)
        if cache.misses:
            return taken, False
    return taken, True


def _already_serving(answers: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The hosts whose ``syncfs.prepare`` said their target already serves the tree, each with
    what a commit would have answered."""
    return {i: {**r, "committed": True} for i, r in answers.items() if r["unchanged"] and "generation" in r}


def _read_errors_are_one_line(src: str, groups: Any) -> Any:
    try:
        yield from groups
    except OSError as e:  # a file vanished or became unreadable while the tree was read
        raise MonarchError(f"reading {src}: {e.strerror or e} ({e.filename}); nothing was committed") from None


def _prefetch(groups: Any, depth: int = 2) -> Any:
    """Runs a generator in a thread, ``depth`` items ahead of its consumer."""
    import queue

    q: queue.Queue[Any] = queue.Queue(depth)
    done = object()
    stop = threading.Event()  # the consumer left early (an error): the reader stops too

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for g in groups:
                if not put(g):
                    return
        except BaseException as e:  # handed to the consumer
            put(e)
        put(done)

    threading.Thread(target=produce, name="syncfs-scan", daemon=True).start()
    try:
        while True:
            item = q.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


def _batches(todo: list[str], sizes: dict[str, int]) -> list[list[str]]:
    out: list[list[str]] = [[]]
    size = 0
    for h in todo:
        if size >= BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append(h)
        size += sizes[h]
    return [b for b in out if b]


def _send(client: Any, batch: list[str], sources: dict[str, ChunkSource], how: dict[str, Any], **extra: Any) -> None:
    from ..wire import RemoteError

    buffers: BatchBuffers = how["buffers"]
    for attempt in range(RETRIES):
        blob: memoryview | None = None
        if how["mode"] == "socket":  # sent from the files themselves
            index, parts = batch_parts(batch, sources)
            args: dict[str, Any] = {"data": parts}
            release: Callable[[], object] = lambda: None  # noqa: E731
        else:  # rdma reads from one registered buffer
            index, blob = read_batch(batch, sources, buffers)
            args, release = transfer.outgoing(how["mode"], how["pool"], how["bind"], blob)
        answered = False
        try:
            out = client.call("syncfs.put", chunks=index, **args, **extra)
            answered = True
            if not how["vias"]:
                how["vias"].append(out["via"])
            return
        except FileRegionError as e:
            raise MonarchError(f"{e}; nothing was committed: sync again") from None
        except RemoteError as e:
            answered = True
            if not e.raised(ChunkCorrupt) or attempt == RETRIES - 1:
                raise
        finally:
            release()
            # the host has its own copy; after a timeout it might still be pulling from this one
            if answered and blob is not None:
                buffers.give(cast(bytearray, blob.obj))  # read_batch's view of a buffer it took
