"""Replica logs on disk, bounded per replica and per host (the host's share of the pool's limit).

Why bounded: the logs live in the pool's state dir, which on SLURM is the shared file system, and
they outlive the pool (for post-mortems). Unbounded, one chatty replica (400k lines a second)
filled it, and a full disk also stops the agents' heartbeats.

Each stream of a replica is a series of *segments*, in the order written: ``stdout.log``,
``stdout.log.1``, ``stdout.log.2``, ...; the highest is the one being written. A segment is only
ever appended to while it is the newest, and deleted when dropped: never renamed or rewritten.
So a reader that holds a path and an offset (``torchx log``, the telemetry indexer in a worker
thread) is never moved under: the segment it reads is there, whole, or it is gone.

A stream starts a new segment before a write would take its newest past 1/8 of the smaller
limit. The oldest segments are dropped: the replica's own as soon as a write takes it past its
limit (so it holds after every write, where a segment is larger than one read of the pipe: up
to 256 KiB of output and its timestamps); the host's, at each new segment and at a replica's
end, while it is over its share of the pool's limit, in this order: files that earlier agents
left here (an earlier pool of the same name), segments of ended replicas, older segments of
running ones (oldest first in each). The newest segment of a running stream is never dropped,
so the host's share is exceeded by less than one segment per running stream. What was dropped
is counted per stream, and ``torchx log`` says it in one line.

The agent reads the pipes and writes the files itself: a replica cannot outlive its agent (its
fork server ends it), so a writer process per replica would protect nothing and cost a process.
A write that fails (a full disk) loses its lines, which are counted; the error is reported in
``pool status``; the pipe is still read, so the replica never blocks or dies for it.
"""

from __future__ import annotations

import bisect
import contextlib
import heapq
import itertools
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

STREAMS = ("stdout", "stderr")
MIB = 1 << 20
# defaults of the run options log_max_mb and log_pool_max_mb (and of the agent's flags)
REPLICA_MAX_MB = 64.0
POOL_MAX_MB = 4096.0
SEGMENTS_PER_LIMIT = 8
MIN_SEGMENT_BYTES = 4096


def segment_path(directory: Path, stream: str, seq: int) -> Path:
    return directory / (f"{stream}.log" if seq == 0 else f"{stream}.log.{seq}")


def segments_on_disk(directory: Path, stream: str) -> list[tuple[int, Path]]:
    """(seq, path) of a stream's segments present in ``directory``, oldest first."""
    out = []
    for p in directory.glob(f"{stream}.log*"):
        rest = p.name[len(stream) + len(".log") :]
        if rest == "":
            out.append((0, p))
        elif rest[:1] == "." and rest[1:].isdigit():
            out.append((int(rest[1:]), p))
    return sorted(out)


def read_files(
    directory: Path,
    names: Sequence[str],
    since: float | None = None,
    until: float | None = None,
    regex: str | None = None,
) -> Iterator[str]:
    """A replica's lines from its files alone, streams merged by time, each ending in a newline:
    ``torchx log`` of a replica whose agent is gone (its pool idled out, was stopped or lost its
    allocation). Its first line says so when the oldest output was already dropped (the limits)."""
    pattern = re.compile(regex) if regex else None
    present = {n: segments_on_disk(directory, n) for n in names}
    if any(segs and segs[0][0] > 0 for segs in present.values()):
        yield (
            f"[monarch-torchx: the oldest part of {'this replica' if len(names) > 1 else names[0]}'s "
            "output was dropped (log limits); what is left follows]\n"
        )

    def lines(segs: list[tuple[int, Path]]) -> Iterator[tuple[float, str]]:
        for _, path in segs:
            try:
                with open(path, "rb") as f:
                    for raw in f:
                        if raw.endswith(b"\n"):  # (a line cut by a full disk is not whole: skipped)
                            yield parse_line(raw[:-1])
            except FileNotFoundError:
                continue

    merged = heapq.merge(*(lines(segs) for segs in present.values()), key=lambda x: x[0])
    for ts, line in merged:
        if (
            (since is None or ts >= since)
            and (until is None or ts <= until)
            and (pattern is None or pattern.search(line))
        ):
            yield line + "\n"


def parse_line(raw: bytes) -> tuple[float, str]:
    """A stored line: its time (as the agent read it) and its text."""
    ts, _, line = raw.partition(b" ")
    try:
        t = float(ts)
    except ValueError:
        t = 0.0
    return t, line.decode("utf-8", errors="replace")


def mib(n: int) -> str:
    """A size as people read it: 64 MiB, 20.03 MiB, 256 KiB."""
    if n < MIB:
        return f"{round(n / 1024):,} KiB"
    return f"{n / MIB:,.2f}".rstrip("0").rstrip(".") + " MiB"


@dataclass(frozen=True)
class LogLimits:
    """How many bytes of output one replica, and all replicas of this host together, keep on disk."""

    replica_bytes: int = int(REPLICA_MAX_MB * MIB)
    host_bytes: int = int(POOL_MAX_MB * MIB)

    @staticmethod
    def from_mb(replica_mb: float, host_mb: float) -> LogLimits:
        if not replica_mb > 0 or not host_mb > 0:
            raise ValueError(f"log limits must be positive (got {replica_mb} MiB per replica, {host_mb} MiB per host)")
        return LogLimits(int(replica_mb * MIB), int(host_mb * MIB))

    @property
    def segment_bytes(self) -> int:
        return max(MIN_SEGMENT_BYTES, min(self.replica_bytes, self.host_bytes) // SEGMENTS_PER_LIMIT)

    def replica_reason(self) -> str:
        return f"log limit {mib(self.replica_bytes)} per replica (-cfg log_max_mb)"

    def host_reason(self) -> str:
        return f"pool's log limit, {mib(self.host_bytes)} on this host (-cfg log_pool_max_mb)"


@dataclass
class Segment:
    """One file of a stream; ``lines_before``/``bytes_before``: the stream's output before it."""

    seq: int
    path: Path
    lines_before: int = 0
    bytes_before: int = 0
    size: int = 0  # bytes on disk, whole lines only
    lines: int = 0
    closed_at: float = 0.0  # when it stopped growing; 0 while it may still grow


@dataclass
class DropCount:
    """Output of a replica (or one stream of it) that is no longer on disk, or never got there."""

    lines: int = 0
    bytes: int = 0
    until: float = 0.0  # when the newest of it was written
    reason: str = ""

    def add(self, other: DropCount) -> None:
        self.lines += other.lines
        self.bytes += other.bytes
        self.until = max(self.until, other.until)
        if other.reason and other.reason not in self.reason:
            self.reason = f"{self.reason}; {other.reason}" if self.reason else other.reason


class StreamLog:
    """One stream of one replica: its segments (oldest first, the last one being written)."""

    def __init__(self, directory: Path, name: str, owner: ReplicaLog):
        self.name = name
        self.owner = owner
        first = _next_seq(directory, name)  # segments an earlier agent left here are not this replica's
        self.segments: list[Segment] = [Segment(first, segment_path(directory, name, first))]
        self.dropped_until = 0.0
        self.reason = ""  # why segments were dropped (the limit that was exceeded)
        self.failed = DropCount()  # lines whose write failed
        self.writers = 0  # pipes writing to it now (one per live attempt)
        self._fd = -1

    def segment(self, seq: int) -> Segment | None:
        """The live segment ``seq``, or None (dropped, or not begun)."""
        segs = self.segments
        i = seq - segs[0].seq
        return segs[i] if 0 <= i < len(segs) else None

    @property
    def written(self) -> int:
        """Bytes written to this stream ever (dropped ones too)."""
        last = self.segments[-1]
        return last.bytes_before + last.size

    def dropped(self) -> DropCount:
        first = self.segments[0]
        return DropCount(first.lines_before, first.bytes_before, self.dropped_until, self.reason)

    def write(self, data: bytes, lines: int) -> None:
        """Appends whole lines; a failed write loses them (counted), the replica goes on. Past
        the replica's limit, its oldest segments go at once: the limit holds after every write."""
        owner, store = self.owner, self.owner.store
        seg = self.segments[-1]
        rotated = bool(seg.size) and seg.size + len(data) > store.limits.segment_bytes
        if rotated:
            seg = self._rotate()
        try:
            if self._fd < 0:
                self._fd = os.open(seg.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            _write_all(self._fd, data)
        except OSError as e:
            if self._fd >= 0:  # a part written: cut back to whole lines, and open afresh at the next write
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, seg.size)
            self.close_file()
            self.failed.add(DropCount(lines, len(data), time.time(), e.strerror or type(e).__name__))
            store.write_failed(seg.path, e, lines)
            return
        seg.size += len(data)
        seg.lines += lines
        owner.size += len(data)
        store.total += len(data)
        if owner.size > store.limits.replica_bytes or (rotated and store.total > store.limits.host_bytes):
            store.enforce(owner)

    def _rotate(self) -> Segment:
        """Closes the newest segment and begins the next (its file is made at its first write)."""
        self.close_file()
        seg = self.segments[-1]
        seg.closed_at = time.time()
        nxt = Segment(
            seg.seq + 1,
            segment_path(seg.path.parent, self.name, seg.seq + 1),
            seg.lines_before + seg.lines,
            seg.bytes_before + seg.size,
        )
        self.segments.append(nxt)
        return nxt

    def close_file(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1

    def droppable(self) -> Segment | None:
        """The oldest segment, if it may go: a closed one, or the last one of a stream no one writes."""
        seg = self.segments[0]
        if len(self.segments) > 1:
            return seg
        return seg if seg.size and seg.closed_at and not self.writers else None

    def drop_oldest(self, reason: str) -> int:
        """Deletes the oldest segment (``droppable``); returns the bytes freed."""
        seg = self.droppable()
        if seg is None:
            return 0
        if len(self.segments) == 1:  # the stream's only one: later output starts the next
            self.segments.append(
                Segment(
                    seg.seq + 1,
                    segment_path(seg.path.parent, self.name, seg.seq + 1),
                    seg.lines_before + seg.lines,
                    seg.bytes_before + seg.size,
                )
            )
        self.segments.pop(0)
        self.dropped_until = max(self.dropped_until, seg.closed_at)
        self.reason = reason
        self.owner.size -= seg.size
        with contextlib.suppress(FileNotFoundError):
            seg.path.unlink()
        return seg.size


class ReplicaLog:
    """The streams of one replica (kept across its attempts)."""

    def __init__(self, directory: Path, store: LogStore):
        self.directory = directory
        self.store = store
        self.streams: dict[str, StreamLog] = {n: StreamLog(directory, n, self) for n in STREAMS}
        self.finished = False
        self.size = 0  # bytes of its segments on disk (kept as they change: checked at every write)

    def files(self) -> list[tuple[str, Path, int]]:
        """(stream, path, size) of each segment on disk, oldest first per stream: sizes as written
        (whole lines), so a reader in another thread needs no stat and reads no partial line."""
        return [(name, seg.path, seg.size) for name, s in self.streams.items() for seg in list(s.segments) if seg.size]

    def dropped(self, names: Iterable[str]) -> DropCount:
        out = DropCount()
        for n in names:
            out.add(self.streams[n].dropped())
        return out

    def failed(self, names: Iterable[str]) -> DropCount:
        out = DropCount()
        for n in names:
            out.add(self.streams[n].failed)
        return out

    def restart(self) -> None:
        """The replica is started again (a relaunch of the same replica): its log goes on."""
        self.finished = False
        for s in self.streams.values():
            s.segments[-1].closed_at = 0.0
        self.store.track(self)

    def finish(self) -> None:
        """The replica ended; once no pipe writes to it, its newest segments may be dropped too."""
        self.finished = True
        self.settle()

    def settle(self) -> None:
        if not self.finished or any(s.writers for s in self.streams.values()):
            return
        now = time.time()
        for s in self.streams.values():
            s.close_file()
            if not s.segments[-1].closed_at:
                s.segments[-1].closed_at = now
        if self.size:
            self.store.enforce(None)
        else:  # nothing on disk to count (its Replica keeps what it dropped)
            self.store.untrack(self)


FAILURE_SHOWN_S = 600.0


class LogStore:
    """Every replica log of this host, and the files earlier agents left under its root: what
    the host's share of the pool's log limit counts."""

    def __init__(self, root: Path, limits: LogLimits):
        self.root = root
        self.limits = limits
        self.replicas: list[ReplicaLog] = []
        self.leftovers = _scan(root)  # (mtime, path, size), oldest first
        self.total = sum(size for _, _, size in self.leftovers)
        self.last_failure: tuple[float, str, int] | None = None  # (when, why, lines lost since the first)
        self.enforce(None)

    def open(self, directory: Path) -> ReplicaLog:
        log = ReplicaLog(directory, self)
        self.replicas.append(log)
        return log

    def track(self, log: ReplicaLog) -> None:
        if log not in self.replicas:
            self.replicas.append(log)

    def untrack(self, log: ReplicaLog) -> None:
        with contextlib.suppress(ValueError):
            self.replicas.remove(log)

    def write_failed(self, path: Path, e: OSError, lines: int) -> None:
        lost = lines + (self.last_failure[2] if self.last_failure else 0)
        self.last_failure = (time.time(), f"cannot write replica logs in {path.parent}: {e.strerror or e}", lost)

    def warning(self, now: float | None = None) -> str:
        """What `pool status` shows: the last failed write, for ``FAILURE_SHOWN_S`` after it.

        Kept after a later write succeeds (a full disk frees a little and fills again), so whoever
        looks after the lines went missing still learns why."""
        if self.last_failure is None:
            return ""
        when, why, lost = self.last_failure
        age = (time.time() if now is None else now) - when
        if age > FAILURE_SHOWN_S:
            return ""
        return f"{why} ({lost:,} lines lost, the last {age:.0f}s ago)"

    def enforce(self, log: ReplicaLog | None) -> None:
        """Drops the oldest output until ``log`` (if given) is within the per-replica limit and the
        host within its share (see the module's docstring for the order)."""
        if log is not None and log.size > self.limits.replica_bytes:
            reason = self.limits.replica_reason()
            while log.size > self.limits.replica_bytes:
                oldest = min(
                    (s for s in log.streams.values() if s.droppable()),
                    key=lambda s: (s.segments[0].closed_at, s.segments[0].seq),
                    default=None,
                )
                if oldest is None:
                    break
                self.total -= oldest.drop_oldest(reason)
        if self.total > self.limits.host_bytes:
            self._enforce_host()

    def forget(self, log: ReplicaLog) -> None:
        """The agent forgot the replica (its history is bounded): its files stay on disk, counted
        as leftovers, at their age."""
        self.untrack(log)
        for s in log.streams.values():
            s.close_file()
            for seg in s.segments:
                if seg.size:
                    bisect.insort(self.leftovers, (seg.closed_at or time.time(), seg.path, seg.size))
            s.segments = [Segment(s.segments[-1].seq + 1, segment_path(log.directory, s.name, s.segments[-1].seq + 1))]
        log.size = 0

    def _enforce_host(self) -> None:
        if self.leftovers:
            keep = {p for r in self.replicas for p in (r.directory, *r.directory.parents)}
            while self.leftovers and self.total > self.limits.host_bytes:
                _, path, size = self.leftovers.pop(0)
                _remove(path, self.root, keep)
                self.total -= size
        reason = self.limits.host_reason()
        order = itertools.count()
        heap: list[tuple[int, float, int, int, StreamLog]] = []

        def push(s: StreamLog) -> None:
            seg = s.droppable()
            if seg is not None:
                heapq.heappush(heap, (0 if s.owner.finished else 1, seg.closed_at, seg.seq, next(order), s))

        for log in self.replicas:
            for s in log.streams.values():
                push(s)
        while heap and self.total > self.limits.host_bytes:
            s = heapq.heappop(heap)[-1]
            self.total -= s.drop_oldest(reason)
            push(s)
        # an ended replica with nothing left on disk needs no accounting (its Replica keeps its counts)
        self.replicas = [r for r in self.replicas if not r.finished or r.size]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _next_seq(directory: Path, stream: str) -> int:
    """0, or past the segments of this stream already in ``directory`` (an earlier agent's)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return 0
    seqs = [
        0 if n == f"{stream}.log" else int(n.rsplit(".", 1)[1])
        for n in names
        if n == f"{stream}.log" or (n.startswith(f"{stream}.log.") and n.rsplit(".", 1)[1].isdigit())
    ]
    return max(seqs) + 1 if seqs else 0


def _scan(root: Path) -> list[tuple[float, Path, int]]:
    """The files under ``root`` (left by earlier agents of this host), oldest first."""
    found = []
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            with contextlib.suppress(OSError):
                st = p.lstat()
                found.append((st.st_mtime, p, st.st_size))
    found.sort(key=lambda x: x[0])
    return found


def _remove(path: Path, root: Path, keep: set[Path]) -> None:
    """Deletes a leftover file and the directories it leaves empty, up to ``root`` (not those of
    live replicas, ``keep``: their next segment is created there)."""
    with contextlib.suppress(OSError):
        path.unlink()
    parent = path.parent
    while parent != root and root in parent.parents and parent not in keep:
        try:
            parent.rmdir()
        except OSError:
            return
        parent = parent.parent
