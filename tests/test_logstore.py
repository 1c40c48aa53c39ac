"""Replica logs on disk, bounded (``agent/logstore.py``): without an agent, what the limits drop,
in which order, what a reader is told, a failed write; with one, a full disk (a small tmpfs).
The limits through a real pool and the TorchX runner: ``tests/test_local_runner.py``."""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path

import pytest

from monarch_torchx.agent.logstore import LogLimits, LogStore, ReplicaLog
from monarch_torchx.agent.procs import ProcTable, Replica
from monarch_torchx.specs import RUNNING, SUCCEEDED, LaunchSpec

from .conftest import agent_pids, torchx, wait_for
from .test_shared_node import small_disk  # noqa: F401  (a 4 MiB tmpfs, as a fixture)

pytestmark = pytest.mark.integration

KIB = 1024


def _write(log: ReplicaLog, stream: str, start: int, n: int) -> None:
    """Lines ``line START`` .. as the agent stores them (``TS LINE``), one write per line."""
    for i in range(start, start + n):
        log.streams[stream].write(b"%.6f line %d\n" % (1000.0 + i, i), 1)


def _on_disk(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _replica(table: ProcTable, tmp_path: Path, name: str) -> Replica:
    d = tmp_path / "logs" / name
    d.mkdir(parents=True)
    rep = Replica(LaunchSpec(app_id=name, role="r", replica_id=0, argv=["x"]), d, table.log_store.open(d))
    rep.state = RUNNING
    return rep


def _read(table: ProcTable, rep: Replica, streams: str = "stdout") -> list[str]:
    async def drain() -> list[str]:
        return [line async for batch in table.logs(rep, streams, None, None, None, False) for line in batch]

    return asyncio.run(drain())


def test_a_replica_keeps_its_latest_lines_within_its_limit_and_a_reader_is_told_what_went(tmp_path):
    table = ProcTable(None, tmp_path / "logs", {}, LogLimits(replica_bytes=16 * KIB, host_bytes=1 << 30))
    rep = _replica(table, tmp_path, "a")
    _write(rep.log, "stdout", 0, 5000)
    assert rep.log.size <= 16 * KIB and _on_disk(tmp_path / "logs") == rep.log.size
    lines = _read(table, rep)
    m = re.fullmatch(
        r"\[monarch-torchx: ([\d,]+) earlier lines \(.+\) of this replica's stdout were dropped: "
        r"over the log limit 16 KiB per replica \(-cfg log_max_mb\)\]\n",
        lines[0],
    )
    assert m, lines[0]
    dropped = int(m.group(1).replace(",", ""))
    assert lines[1:] == [f"line {i}\n" for i in range(dropped, 5000)]  # the latest, none missing


def test_a_reader_that_falls_behind_is_told_how_many_lines_went_before_it_read_them(tmp_path):
    table = ProcTable(None, tmp_path / "logs", {}, LogLimits(replica_bytes=16 * KIB, host_bytes=1 << 30))
    rep = _replica(table, tmp_path, "a")

    async def follow() -> list[str]:
        got: list[str] = []
        it = table.logs(rep, "stdout", None, None, None, True).__aiter__()
        _write(rep.log, "stdout", 0, 10)
        got += await it.__anext__()  # the first ten, read
        _write(rep.log, "stdout", 10, 5000)  # many more while the reader waits: the oldest go unread
        rep.state = SUCCEEDED
        async for batch in it:
            got += batch
        return got

    lines = asyncio.run(follow())
    assert lines[:10] == [f"line {i}\n" for i in range(10)]
    m = re.fullmatch(
        r"\[monarch-torchx: ([\d,]+) lines here \(.+\) of this replica's stdout were dropped: .*\]\n", lines[10]
    )
    assert m, lines[10]
    resumed = 10 + int(m.group(1).replace(",", ""))
    assert lines[11] == f"line {resumed}\n" and lines[-1] == "line 5009\n"


def test_the_host_limit_drops_what_earlier_agents_left_then_ended_replicas_oldest_first(tmp_path):
    root = tmp_path / "logs"
    old = root / "old-app" / "r" / "0"
    old.mkdir(parents=True)
    (old / "stdout.log").write_bytes(b"x" * 20 * KIB)
    os.utime(old / "stdout.log", (1, 1))
    table = ProcTable(None, root, {}, LogLimits(replica_bytes=16 * KIB, host_bytes=40 * KIB))
    assert table.log_store.total == 20 * KIB  # counted, not dropped: within the limit
    first, second, running = (_replica(table, tmp_path, n) for n in ("first", "second", "running"))
    for rep in (first, second):
        _write(rep.log, "stdout", 0, 700)
        rep.state = SUCCEEDED
        rep.log.finish()
    assert not old.exists() and (root / "old-app").exists() is False  # the leftover went first, with its dirs
    _write(running.log, "stdout", 0, 700)
    assert _on_disk(root) <= 40 * KIB and table.log_store.total == _on_disk(root)
    assert _read(table, first)[0].startswith("[monarch-torchx:") and "log_pool_max_mb" in _read(table, first)[0]
    assert (
        _read(table, running)[-1] == "line 699\n"
        and first.log.dropped(["stdout"]).lines > second.log.dropped(["stdout"]).lines
    )  # the older ended replica lost more


def test_a_write_that_fails_loses_its_lines_counted_and_the_next_one_goes_on(tmp_path):
    store = LogStore(tmp_path / "logs", LogLimits())
    d = tmp_path / "logs" / "a"
    d.mkdir(parents=True)
    log = store.open(d)
    os.symlink("/dev/full", d / "stdout.log")  # every write: ENOSPC, as on a full disk
    _write(log, "stdout", 0, 3)
    assert (
        log.failed(["stdout"]).lines == 3 and "No space left" in store.warning() and "3 lines lost" in store.warning()
    )
    (d / "stdout.log").unlink()
    _write(log, "stdout", 3, 2)
    assert (d / "stdout.log").read_text().splitlines() == ["1003.000000 line 3", "1004.000000 line 4"]
    assert "3 lines lost" in store.warning() and log.failed(["stdout"]).lines == 3  # still said, after a success
    assert store.warning(now=time.time() + 3600) == ""  # and no longer, an hour on


def test_a_full_disk_loses_log_lines_counted_never_the_replica_and_pool_status_says_it(
    small_disk,  # noqa: F811  (the fixture imported above)
    pool_name,
    monkeypatch,
):
    """Issue 37: a write error in the capture was an exception in the agent's loop, logged for
    every chunk of output (to a full disk), and the lines went silently. Now they are counted,
    `torchx log` says so, `pool status` shows why, and the replica goes on as before."""
    from torchx.runner import get_runner
    from torchx.specs import AppDef, AppState, Role

    home = small_disk / "home"
    monkeypatch.setenv("MONARCH_TORCHX_HOME", str(home))
    try:
        torchx(home, "pool", "create", pool_name, "-cfg", "hosts=1,preload=none")
        with open(small_disk / "filler", "wb") as f:  # fills the disk, then leaves room for the app's record
            try:
                while True:
                    f.write(b"x" * (1 << 16))
                    f.flush()
            except OSError:
                pass
            f.truncate(f.tell() - (64 << 10))
        code = "for i in range(50000): print('line', i)\nprint('done', flush=True)"
        with get_runner() as runner:
            h = runner.run(
                AppDef("chatty", roles=[Role("chatty", image=".", entrypoint="python", args=["-c", code])]),
                "monarch_local",
                {"pool": pool_name},
            )
            "".join(runner.log_lines(h, "chatty", 0, should_tail=True))  # (waits for the end of its output)
            assert runner.status(h).state == AppState.SUCCEEDED, runner.status(h)
            shown = "".join(runner.log_lines(h, "chatty", 0))
        assert re.search(
            r"\[monarch-torchx: [\d,]+ lines \(.+\) of this replica's output could not be written "
            r"\(No space left on device\) and are lost\]",
            shown,
        ), shown[:500]
        out = torchx(home, "pool", "status", pool_name).stdout
        assert "warning: cannot write replica logs" in out and "No space left" in out, out
    finally:
        (small_disk / "filler").unlink(missing_ok=True)
        torchx(home, "pool", "stop", pool_name, check=False)
        wait_for(lambda: not agent_pids(home), what="the agent to exit")
