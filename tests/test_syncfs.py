"""syncfs on a real 2-host monarch_local pool: content-addressed chunks, generations switched
atomically, and the faults the issue lists. Each test keeps the hosts' stores in its tmp dir."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from monarch_torchx import wire
from monarch_torchx.errors import MonarchError
from monarch_torchx.pool import PoolRequest, attach, ensure_pool, stop_pool
from monarch_torchx.syncfs import sync

from .conftest import BIN, cli_env, node_store, pids_running, wait_for

pytestmark = pytest.mark.integration

CLI = str(BIN / "monarch-torchx")


def syncfs_mounts(under: Path) -> list:
    with open("/proc/mounts") as f:
        return [line.split()[1] for line in f if "monarch-syncfs" in line and str(under) in line]


@pytest.fixture(autouse=True)
def no_mounts_left(home, tmp_path):
    """Every test: its pools stopped, the FUSE servers of agents it killed ended, no mount left."""
    yield
    from .conftest import stop_all_pools

    stop_all_pools(home)
    kill_orphans(tmp_path)
    wait_for(lambda: not syncfs_mounts(tmp_path), timeout=10, what="FUSE mounts to go")


@pytest.fixture
def pool(home, pool_name, tmp_path, monkeypatch):
    monkeypatch.setenv("MONARCH_TORCHX_SYNC_STORE", str(tmp_path / "node-stores"))
    return ensure_pool(PoolRequest("monarch_local", pool_name, {"hosts": 2, "preload": ""}))


def fuse_servers(store: Path) -> list:
    """The pids of syncfs FUSE servers of a store."""
    return pids_running("monarch_torchx.syncfs.fusefs", store)


def kill_orphans(store: Path) -> None:
    """Ends the FUSE servers of a store (of an agent a test killed they end by themselves)."""
    for pid in fuse_servers(store):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def make_tree(root: Path) -> Path:
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "pkg" / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "pkg" / "run.sh").chmod(0o755)
    (root / "pkg" / "sub" / "big.bin").write_bytes(os.urandom(5 << 20))
    (root / "zero").write_bytes(b"")
    (root / "ünïcødé ñame.txt").write_text("π\n")
    os.link(root / "pkg" / "run.sh", root / "hardlink.sh")
    (root / "link").symlink_to("pkg/run.sh")
    (root / "dangling").symlink_to("does/not/exist")
    return root


def sync_cli(home, *args, check=True) -> subprocess.CompletedProcess:
    res = subprocess.run([CLI, "sync", *args], env=cli_env(home), capture_output=True, text=True, timeout=300)
    if check and res.returncode != 0:
        raise AssertionError(f"sync failed ({res.returncode}): {res.stdout}\n{res.stderr}")
    return res


def assert_same_tree(src: Path, dst: Path) -> None:
    names = sorted(str(p.relative_to(src)) for p in src.rglob("*"))
    assert sorted(str(p.relative_to(dst)) for p in dst.rglob("*")) == names
    for rel in names:
        a, b = src / rel, dst / rel
        if a.is_symlink():
            assert b.is_symlink() and os.readlink(a) == os.readlink(b), rel
        elif a.is_dir():
            assert b.is_dir() and not b.is_symlink(), rel
        else:
            assert b.read_bytes() == a.read_bytes(), rel
            assert b.stat().st_mode & 0o555 == a.stat().st_mode & 0o555, rel  # exec bits kept
            assert b.stat().st_mode & 0o222 == 0, rel  # read-only
            assert b.stat().st_mtime_ns == a.stat().st_mtime_ns, rel  # kept (.pyc checks use it)


def test_sync_a_tree_to_every_host(pool, home, tmp_path):
    src = make_tree(tmp_path / "src")
    res = sync_cli(home, str(src), "--pool", pool.name, "--to", "work", "--json")
    report = json.loads(res.stdout)
    assert set(report) >= {"files", "bytes_sent", "bytes_skipped", "seconds", "generation", "hosts"}
    assert report["generation"] == 1 and len(report["hosts"]) == 2
    assert report["transfer"] == "socket"  # auto: no ibverbs device here, so not the rdma module
    # a chain: the client sent each byte once; host 0 passed it on to host 1
    assert 5 << 20 <= report["bytes_sent"] < (5 << 20) + (1 << 20)
    assert all(h["bytes_sent"] == report["bytes_sent"] for h in report["hosts"])
    for h in report["hosts"]:
        dst = Path(h["path"])
        assert h["ok"] and h["served_by"] == "fuse" and os.path.ismount(dst)
        assert_same_tree(src, dst)
        with pytest.raises(OSError, match="Read-only file system"):  # even for root
            (dst / "zero").write_text("no")
        assert os.stat(dst / "hardlink.sh").st_ino == os.stat(dst / "pkg" / "run.sh").st_ino  # hard link kept
    assert report["hosts"][0]["path"] != report["hosts"][1]["path"]  # each host its own store

    # a no-op resync sends nothing and commits nothing (the hosts already serve that tree)
    again = json.loads(sync_cli(home, str(src), "--pool", pool.name, "--to", "work", "--json").stdout)
    assert again["bytes_sent"] == 0 and again["generation"] == 1
    assert again["bytes_skipped"] == 2 * again["bytes"]
    # a change (a touched mtime is one) makes a new generation; only the newest two are kept
    for k in (2, 3):
        os.utime(src / "zero", ns=(k * 10**18, k * 10**18))
        text = sync_cli(home, str(src), "--pool", pool.name, "--to", "work").stdout
        assert f"host 0: generation {k}" in text and "sent 0.0 MB" in text
    gens = sorted(p.name for p in node_store(tmp_path / "node-stores", pool.name, 0).glob("targets/*/gen-*.manifest"))
    assert gens == ["gen-2.manifest", "gen-3.manifest"]


def test_a_known_tree_settles_hosts_that_serve_it_and_feeds_the_others(pool, tmp_path):
    # the hash cache knows the whole tree after the first sync, so the second asks every host by
    # the tree's digest first: host 0 already serves it, host 1 has nothing and is fed in full
    src = make_tree(tmp_path / "src")
    first = sync(pool, str(src), "known", hosts=[0])
    assert first.ok and first.generation == 1
    both = sync(pool, str(src), "known", hosts=[0, 1])
    assert both.ok and [h.generation for h in both.hosts] == [1, 1]
    assert both.hosts[0].bytes_sent == 0 and both.hosts[1].bytes_sent >= 5 << 20
    for h in both.hosts:
        assert_same_tree(src, Path(h.path))
    refused = sync(pool, str(src), "/etc/monarch-known", hosts=[0, 1])  # still checked before a byte moves
    assert not refused.ok and refused.bytes_sent == 0
    assert all("outside what this agent allows" in h.error for h in refused.hosts), refused.hosts


def test_an_edit_in_a_large_file_resends_only_nearby_chunks(pool, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    data = bytearray(os.urandom(48 << 20))
    (src / "weights.bin").write_bytes(data)
    first = sync(pool, str(src), "w", hosts=[0])
    assert first.ok and first.bytes_sent == 48 << 20
    data[24 << 20 : (24 << 20) + 100] = os.urandom(100)
    (src / "weights.bin").write_bytes(data)
    second = sync(pool, str(src), "w", hosts=[0])
    assert second.ok and 0 < second.bytes_sent <= 8 << 20, second.bytes_sent  # at most two 4 MiB chunks
    assert Path(second.hosts[0].path, "weights.bin").read_bytes() == bytes(data)


def test_open_files_of_the_old_generation_keep_working(pool, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "cfg.txt").write_text("v1\n")
    path = Path(sync(pool, str(src), "live", hosts=[0]).hosts[0].path)
    with open(path / "cfg.txt") as f:
        (src / "cfg.txt").write_text("v2 longer\n")
        r = sync(pool, str(src), "live", hosts=[0])
        assert r.generation == 2 and (path / "cfg.txt").read_text() == "v2 longer\n"
        assert f.read() == "v1\n"  # the reader that opened generation 1 still sees it


def test_a_corrupted_chunk_is_refused_and_sent_again(pool, tmp_path, monkeypatch):
    import blake3

    good = b"x" * 1000
    h = blake3.blake3(good).hexdigest()
    with pytest.raises(wire.RemoteError, match="does not match its hash"):
        pool.call(0, "syncfs.put", chunks=[(h, 1000)], data=b"y" * 1000)
    with pytest.raises(wire.RemoteError, match="does not hold the 1 chunk"):
        pool.call(0, "syncfs.put", chunks=[(h, 1000)], data=good + b"extra")
    assert pool.call(0, "syncfs.missing", hashes=[h]) == [h]  # nothing was stored

    from monarch_torchx.syncfs import client

    monkeypatch.setenv("MONARCH_TORCHX_SYNC_TRANSFER", "socket")  # batch_parts' path (rdma reads read_batch)
    real = client.batch_parts
    corrupted = []

    def flaky(batch, sources):  # the wire flips a byte, once
        index, data = real(batch, sources)
        if not corrupted:
            corrupted.append(1)
            first = data.parts[0]
            if isinstance(first, wire.FileRegion):
                with open(first.path, "rb") as f:
                    first = os.pread(f.fileno(), first.size, first.offset)
            flipped = bytearray(first)
            flipped[0] ^= 0xFF
            data = wire.Gathered([flipped, *data.parts[1:]])
        return index, data

    monkeypatch.setattr(client, "batch_parts", flaky)
    src = make_tree(tmp_path / "src")
    report = sync(pool, str(src), "fixed", hosts=[0])
    assert report.ok and corrupted
    assert_same_tree(src, Path(report.hosts[0].path))


def test_a_file_shorter_than_its_chunks_when_sent_fails_the_sync_in_one_line_and_commits_nothing(
    pool, tmp_path, monkeypatch
):
    from monarch_torchx.syncfs import client

    monkeypatch.setenv("MONARCH_TORCHX_SYNC_TRANSFER", "socket")
    real = client.batch_parts
    (tmp_path / "short").write_bytes(b"x")

    def shrunk(batch, sources):  # as if every file had shrunk to 1 byte after it was hashed
        index, data = real(batch, sources)
        return index, wire.Gathered([wire.FileRegion(str(tmp_path / "short"), 0, data.nbytes)])

    monkeypatch.setattr(client, "batch_parts", shrunk)
    report = sync(pool, str(make_tree(tmp_path / "src")), "shrinking", hosts=[0])
    assert not report.ok
    error = report.hosts[0].error
    assert error.startswith("host 0: ") and "byte(s) before the part being sent" in error
    assert "nothing was committed: sync again" in error and "\n" not in error
    assert pool.call(0, "syncfs.where", target="shrinking")["generation"] is None


def test_without_fuse_generations_are_trees_behind_a_symlink(home, pool_name, tmp_path, monkeypatch):
    monkeypatch.setenv("MONARCH_TORCHX_SYNC_STORE", str(tmp_path / "node-stores"))
    monkeypatch.setenv("MONARCH_TORCHX_SYNC_FUSE", "0")
    p = ensure_pool(PoolRequest("monarch_local", pool_name, {"hosts": 1, "preload": ""}))
    src = make_tree(tmp_path / "src")
    first = sync(p, str(src), "plain")
    dst = Path(first.hosts[0].path)
    assert first.hosts[0].served_by.startswith("symlink") and dst.is_symlink() and not os.path.ismount(dst)
    assert_same_tree(src, dst)
    with open(dst / "pkg" / "run.sh") as f:
        (src / "pkg" / "run.sh").write_text("#!/bin/sh\necho v2\n")
        second = sync(p, str(src), "plain")
        assert second.generation == 2 and "v2" in (dst / "pkg" / "run.sh").read_text()
        assert "echo hi" in f.read()  # opened in generation 1
    assert os.readlink(dst).endswith("gen-2")
    assert (
        os.stat(dst / "pkg" / "sub" / "big.bin").st_ino
        == os.stat(Path(os.readlink(dst)).parent / "gen-1" / "pkg" / "sub" / "big.bin").st_ino
    )  # unchanged: shared


def test_a_dead_host_is_named_and_the_others_complete(pool, home, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("one\n")
    first = sync(pool, str(src), "ws")
    old = Path(first.hosts[1].path)
    os.kill(pool.hosts[1].pid, signal.SIGKILL)
    (src / "a.txt").write_text("two\n")
    res = sync_cli(home, str(src), "--pool", pool.name, "--to", "ws", "--json", check=False)
    report = json.loads(res.stdout)
    assert res.returncode == 1
    assert report["hosts"][0]["ok"] and report["hosts"][0]["generation"] == 2
    assert not report["hosts"][1]["ok"] and "host 1" in report["hosts"][1]["error"]
    # its old generation is intact on its disk (its FUSE server ended with its agent)
    assert list(node_store(tmp_path / "node-stores", pool.name, 1).glob("targets/*/gen-1.manifest"))
    assert not list(node_store(tmp_path / "node-stores", pool.name, 1).glob("targets/*/gen-2.manifest"))

    # the host comes back (a new agent): it takes over its old mount and gets the new generation
    report = attach(pool.name) and sync(ensure_pool(PoolRequest("monarch_local", pool.name, {})), str(src), "ws")
    assert report.ok and (old / "a.txt").read_text() == "two\n"


def _kill_after_the_first_batch(monkeypatch, pool, victim: int) -> None:
    """The client's next sync kills host ``victim``'s agent once its first batch has been sent."""
    from monarch_torchx.syncfs import client

    real, calls = client._send, []

    def send_then_kill(*a, **kw):
        real(*a, **kw)
        calls.append(1)
        if len(calls) == 1:
            os.kill(pool.hosts[victim].pid, signal.SIGKILL)

    monkeypatch.setattr(client, "_send", send_then_kill)


def test_chain_reaches_every_host_and_routes_around_a_dead_one(home, pool_name, tmp_path, monkeypatch):
    monkeypatch.setenv("MONARCH_TORCHX_SYNC_STORE", str(tmp_path / "node-stores"))
    p = ensure_pool(PoolRequest("monarch_local", pool_name, {"hosts": 4, "preload": ""}))
    src = make_tree(tmp_path / "src")
    report = sync(p, str(src), "ws")
    assert report.ok and report.bytes_sent < (5 << 20) + (1 << 20)  # once, not 4 times
    for h in report.hosts:
        assert_same_tree(src, Path(h.path))
    star = sync(p, str(src), "ws2", hosts=[0, 1])
    assert star.ok
    assert sync(p, str(src), "ws3", hosts=[2, 3], fanout="star").bytes_sent == 0  # chunks already on both
    # several chains (here of 2 hosts each): each chunk leaves the client once per chain
    (src / "fresh.bin").write_bytes(os.urandom(3 << 20))
    two = sync(p, str(src), "ws4", chain_length=2)
    assert two.ok and 2 * (3 << 20) <= two.bytes_sent < 2 * ((3 << 20) + (1 << 20)), two.bytes_sent
    assert {h.bytes_sent for h in two.hosts} == {two.bytes_sent // 2}
    for h in two.hosts:
        assert_same_tree(src, Path(h.path))

    # a host in the middle of the chain dies while the chain is being fed: the hosts after it get
    # the data directly, the dead one is named
    (src / "more.bin").write_bytes(os.urandom(20 << 20))
    _kill_after_the_first_batch(monkeypatch, p, 1)
    report = sync(p, str(src), "ws")
    by = {h.index: h for h in report.hosts}
    assert not by[1].ok and "host 1" in by[1].error
    assert by[0].ok and by[2].ok and by[3].ok
    for i in (0, 2, 3):
        assert_same_tree(src, Path(by[i].path))


def test_a_big_group_is_fed_as_halves_and_a_dead_inner_host_is_routed_around(home, pool_name, tmp_path, monkeypatch):
    from monarch_torchx.syncfs import client, transfer

    # 9 hosts, chains of at most 2: the client feeds hosts 0 and 5; host 0 feeds 1 (then 2) and
    # 3 (then 4); host 5 feeds 6 (then 7) and 8
    assert transfer.downstream_groups(list(range(9)), 2) == [[0, 1, 2, 3, 4], [5, 6, 7, 8]]
    assert transfer.downstream_groups([1, 2, 3, 4], 2) == [[1, 2], [3, 4]]
    monkeypatch.setenv("MONARCH_TORCHX_SYNC_STORE", str(tmp_path / "node-stores"))
    p = ensure_pool(PoolRequest("monarch_local", pool_name, {"hosts": 9, "preload": ""}))
    src = make_tree(tmp_path / "src")
    size = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
    report = client.sync(p, str(src), "ws", chain_length=2)
    assert report.ok and len(report.hosts) == 9
    assert size <= report.bytes_sent <= 2 * size + (1 << 20)  # twice (two halves), not once per chain of 2
    for h in report.hosts:
        assert_same_tree(src, Path(h.path))
    # host 3 feeds host 4: killed while the tree is being fed, it is named and host 4 is fed directly
    (src / "more.bin").write_bytes(os.urandom(20 << 20))
    _kill_after_the_first_batch(monkeypatch, p, 3)
    report = client.sync(p, str(src), "ws", chain_length=2)
    by = {h.index: h for h in report.hosts}
    assert not by[3].ok and "host 3" in by[3].error
    assert all(by[i].ok for i in range(9) if i != 3), [(h.index, h.error) for h in report.hosts if not h.ok]
    for i in (0, 1, 2, 4, 5, 8):
        assert_same_tree(src, Path(by[i].path))


def test_a_client_killed_mid_sync_switches_no_host(pool, home, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("old\n")
    target = Path(sync(pool, str(src), "ws", hosts=[0]).hosts[0].path)
    (src / "big.bin").write_bytes(os.urandom(400 << 20))
    store = node_store(tmp_path / "node-stores", pool.name, 0) / "packs"
    before = sum(1 for _ in store.rglob("*"))
    proc = subprocess.Popen(
        [CLI, "sync", str(src), "--pool", pool.name, "--to", "ws", "--hosts", "0"],
        env=cli_env(home),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for(
        lambda: sum(1 for _ in store.rglob("*")) > before + 2, timeout=60, interval=0.01, what="some chunks to arrive"
    )
    proc.kill()
    proc.wait()
    assert pool.call(0, "syncfs.where", target="ws")["generation"] == 1 and not (target / "big.bin").exists()
    report = sync(pool, str(src), "ws", hosts=[0])  # and the next sync completes, sending only the rest
    assert report.ok and report.generation == 2 and report.bytes_sent < 400 << 20
    assert (target / "big.bin").stat().st_size == 400 << 20


def test_two_syncs_to_one_target_are_serialized_and_each_whole(pool, tmp_path):
    trees = []
    for n in range(2):
        t = tmp_path / f"src{n}"
        t.mkdir()
        for k in range(20):
            (t / f"f{k}.txt").write_text(f"tree {n} file {k}\n" * 1000)
        trees.append(t)
    reports = {}
    threads = [
        threading.Thread(target=lambda n=n: reports.__setitem__(n, sync(pool, str(trees[n]), "same", hosts=[0])))
        for n in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(r.ok for r in reports.values())
    assert sorted(r.generation for r in reports.values()) == [1, 2]
    last = max(reports, key=lambda n: reports[n].generation)
    assert_same_tree(trees[last], Path(reports[last].hosts[0].path))


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_disk_full_on_a_host_is_one_line_and_the_old_generation_stays(home, pool_name, tmp_path, monkeypatch):
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(small)], check=True)
    try:
        monkeypatch.setenv("MONARCH_TORCHX_SYNC_STORE", str(small))
        p = ensure_pool(PoolRequest("monarch_local", pool_name, {"hosts": 1, "preload": ""}))
        src = tmp_path / "src"
        src.mkdir()
        (src / "a.txt").write_text("fits\n")
        target = Path(sync(p, str(src), "ws").hosts[0].path)
        (src / "big.bin").write_bytes(os.urandom(8 << 20))
        used_before = shutil.disk_usage(small).used
        res = sync_cli(home, str(src), "--pool", pool_name, "--to", "ws", check=False)
        assert res.returncode == 1 and "disk full" in res.stdout and "Traceback" not in res.stdout + res.stderr
        assert (target / "a.txt").read_text() == "fits\n" and not (target / "big.bin").exists()
        # what the failed sync had stored is given back at once, not after the store's hour of grace
        assert shutil.disk_usage(small).used < used_before + (512 << 10), (used_before, shutil.disk_usage(small))
        small_file = src / "small.bin"  # so the next sync that fits goes through
        (src / "big.bin").unlink()
        small_file.write_bytes(os.urandom(1 << 20))
        assert sync(p, str(src), "ws").hosts[0].ok
        assert (target / "small.bin").read_bytes() == small_file.read_bytes()
        from monarch_torchx.pool import stop_pool

        stop_pool(pool_name)
    finally:
        deadline = time.time() + 10
        while subprocess.run(["umount", str(small)], capture_output=True).returncode != 0 and time.time() < deadline:
            time.sleep(0.2)


def test_bad_input_is_one_line(pool, home, tmp_path):
    src = make_tree(tmp_path / "src")
    cases = [
        ([str(tmp_path / "missing"), "--pool", pool.name, "--to", "w"], "does not exist"),
        ([str(src / "zero"), "--pool", pool.name, "--to", "w"], "is not a directory"),
        ([str(src), "--pool", "nosuchpool", "--to", "w"], "no pool named 'nosuchpool'"),
        ([str(src), "--pool", pool.name, "--to", "w", "--hosts", "7"], "has no host(s) [7]"),
    ]
    for args, expect in cases:
        res = sync_cli(home, *args, check=False)
        assert res.returncode != 0 and expect in res.stderr + res.stdout, (args, res.stderr)
        assert "Traceback" not in res.stderr
    res = sync_cli(home, str(src), "--pool", pool.name, "--to", "/etc/monarch-evil", check=False)
    assert res.returncode == 1 and "outside what this agent allows" in res.stdout
    assert "0.0 MB sent" in res.stdout.replace("sent 0.0 MB", "0.0 MB sent")  # refused before any byte moved
    res = sync_cli(home, str(src), "--pool", pool.name, "--to", "../../escape", check=False)
    assert res.returncode == 1 and "leaves the pool's sync area" in res.stdout
    assert not attach(pool.name).call(0, "syncfs.where", target="w")["generation"]
    # a manifest (from any authenticated peer) cannot name paths outside its tree
    import marshal

    for bad in ("../x", "/etc/x", "a/../../x", "a//b", "a/./b", "", "a/\0"):
        with pytest.raises(wire.RemoteError, match="unsafe path"):
            pool.call(0, "syncfs.commit", target="w", manifest=marshal.dumps([(bad, "d", 0o755, 0, 0, [], "")], 2))
    for junk in (b"not marshal", marshal.dumps([("a", "f", 0o644, 1, 0, [("x", "y")], "")], 2), [("a", "d")]):
        with pytest.raises(wire.RemoteError, match="malformed|must be"):
            pool.call(0, "syncfs.commit", target="w", manifest=junk)
    assert not attach(pool.name).call(0, "syncfs.where", target="w")["generation"]


def test_torchx_workspace_is_synced_to_the_pool_and_role_0_runs_in_it(pool, home, tmp_path):
    """`torchx run -cfg workspace_mount=...` (here from `.torchxconfig`): the real torchx CLI syncs
    the current directory (less `.torchxignore`) to each host of role 0, which runs in its copy;
    an edit reaches the next run as a new generation, and a bad mount starts nothing."""
    from .conftest import torchx

    ws = tmp_path / "proj"
    ws.mkdir()
    (ws / "train.py").write_text(
        "import os, sys\nprint('ran', open('version.txt').read().strip(), os.getcwd(), sys.argv[1], "
        "os.path.exists('secret.key'), os.access('.', os.W_OK), os.path.dirname(os.path.realpath('train.py')), "
        "open('out.txt').read().strip().replace(' ', '_') if os.path.exists('out.txt') else '-')\n"
        "tmp = f'out.txt.{os.getpid()}'\n"  # both hosts write it in the one directory they share: atomically
        "open(tmp, 'w').write('written by ' + open('version.txt').read())\nos.replace(tmp, 'out.txt')\n"
    )
    (ws / "version.txt").write_text("v1\n")
    (ws / "secret.key").write_text("not for the cluster\n")
    (ws / ".torchxignore").write_text("# local only\nsecret.key\n")
    (ws / ".torchxconfig").write_text(f"[monarch_local]\npool = {pool.name}\nworkspace_mount = proj\n")

    def run() -> list:
        res = torchx(
            home,
            "run",
            "-s",
            "monarch_local",
            "--wait",
            "--log",
            "utils.python",
            "--num_replicas",
            "2",
            "--script",
            "train.py",
            "--",
            "${img_root}",
            cwd=ws,
        )
        assert "workspace " in res.stderr and "on 2 host(s)" in res.stderr, res.stderr
        out = sorted(line.split(" ", 1)[1] for line in (res.stdout + res.stderr).splitlines() if " ran " in line)
        assert len(out) == 2, res.stdout + res.stderr
        return out

    first = run()
    assert len(first) == 2, first
    for k, line in enumerate(first):  # noqa: B007
        _, version, cwd, img_root, secret, writable, code_dir, before = line.split()
        # role 0 runs in one writable directory that all its hosts share, over the read-only synced copy
        assert version == "v1" and cwd == img_root == str(home / "workspaces" / pool.name / "proj" / "shared")
        assert code_dir in [str(node_store(tmp_path / "node-stores", pool.name, i) / "mounts" / "proj") for i in (0, 1)]
        assert os.path.ismount(code_dir)
        assert secret == "False" and writable == "True"  # .torchxignore honoured
        assert before in ("-", "written_by_v1")  # the other host's replica may have written it already
        assert (Path(cwd) / "out.txt").read_text() == "written by v1\n"
        assert os.stat(cwd).st_mode & 0o077 == 0  # private
    assert "-" in [line.split()[-1] for line in first]  # the first to look found nothing
    (ws / "version.txt").write_text("v2\n")
    second = run()
    assert [line.split()[1] for line in second] == ["v2", "v2"]
    assert "written_by_v1" in [line.split()[-1] for line in second]  # kept across the sync
    gens = attach(pool.name).call(0, "syncfs.where", target="proj")
    assert gens["generation"] == 2

    res = torchx(
        home, "run", "-s", "monarch_local", "-cfg", "workspace_mount=/etc/nope", "utils.echo", cwd=ws, check=False
    )
    assert res.returncode != 0 and "could not be synced to /etc/nope" in res.stderr
    assert "nothing was started" in res.stderr and "Traceback" not in res.stderr


def test_store_packs_each_batch_and_collects_what_no_generation_uses(tmp_path, monkeypatch):
    """The host's store on its own: a batch's chunks, large ones too, go to one pack, a restarted
    host finds them, and a sweep removes packs that no kept generation uses, rewrites a pack that
    is mostly unused with the chunks still used (one mostly used stays as it is), removes chunk
    files an earlier store left that nothing uses, and packs a crash left without an index."""
    import blake3

    from monarch_torchx.syncfs import store as st
    from monarch_torchx.syncfs.manifest import Entry, Manifest

    def chunk(data: bytes):
        return blake3.blake3(data).hexdigest(), data

    def manifest(*files):
        return Manifest([Entry(f"f{k}", "f", 0o644, len(d), 0, chunks=[(h, len(d))]) for k, (h, d) in enumerate(files)])

    s = st.ChunkStore(tmp_path / "store")
    old_small, kept_small, big = chunk(b"a" * 100), chunk(b"b" * 200), chunk(os.urandom(1 << 20))

    def put(chunks):
        s.put([(h, len(d)) for h, d in chunks], b"".join(d for _, d in chunks))

    put([old_small, kept_small, big])
    assert len(list(s.packs.glob("*.pack"))) == 1 and not s.chunks.exists()  # no file per chunk
    legacy = chunk(os.urandom(300 << 10))  # a chunk file of its own, as an earlier store wrote them
    s.chunk_path(legacy[0]).parent.mkdir(parents=True)
    s.chunk_path(legacy[0]).write_bytes(legacy[1])
    s = st.ChunkStore(s.root)  # the host's next agent: it finds both
    assert s.missing([old_small[0], kept_small[0], big[0], legacy[0], "0" * 64]) == ["0" * 64]

    target = tmp_path / "t"
    s.commit(target, manifest(old_small, big, legacy), fuse=False)
    assert [(target / f"f{k}").read_bytes() for k in range(3)] == [old_small[1], big[1], legacy[1]]
    lone = chunk(b"c" * 300)
    put([lone])  # a second pack, used by no generation
    mostly_used, unused = chunk(os.urandom(64 << 10)), chunk(b"d" * 100)
    put([mostly_used, unused])
    full = next(p for p in s.packs.glob("*.pack") if mostly_used[0] in {h for h, _, _ in s.index().rows[p.name]})
    (s.packs / "crashed.pack").write_bytes(b"x")  # written, but its index never was
    monkeypatch.setattr(st, "GC_GRACE_S", 0.0)
    for k in range(2):  # two newer generations: the first one (old_small, big, legacy) is dropped
        new = chunk(b"new" * (k + 1))
        put([new])
        s.commit(target, manifest(kept_small, new, mostly_used), fuse=False)
        s.swept = 0.0
        s.collect(target)
    assert [(target / f"f{k}").read_bytes() for k in (0, 2)] == [kept_small[1], mostly_used[1]]
    assert {old_small[0], big[0], legacy[0], lone[0]}.isdisjoint(s.present())
    assert not s.chunk_path(legacy[0]).exists() and not (s.packs / "crashed.pack").exists()
    assert full.exists() and unused[0] in s.present()  # mostly used: not rewritten
    packed = sum(p.stat().st_size for p in s.packs.glob("*.pack"))
    assert packed < 100 << 10  # the 1 MiB chunk's pack was rewritten with the 200 bytes still used
    fresh = st.ChunkStore(s.root)
    assert fresh.missing([kept_small[0], mostly_used[0], lone[0], big[0]]) == [lone[0], big[0]]
    f, at, n = fresh.open_chunk(kept_small[0])
    with f:
        f.seek(at)
        assert n == 200 and f.read(n) == kept_small[1]


def test_a_mostly_unused_pack_is_rewritten_under_a_served_tree(home, pool_name, tmp_path, monkeypatch):
    """On a real host: a small file that shared its first pack with a large one that has since
    changed twice keeps being served (through FUSE, where this machine has it) once the agent's
    sweep has rewritten that pack without the large file's old chunk, and the store shrinks."""
    monkeypatch.setenv("MONARCH_TORCHX_SYNC_STORE", str(tmp_path / "node-stores"))
    monkeypatch.setenv("MONARCH_TORCHX_SYNC_GC_GRACE_S", "0")
    p = ensure_pool(PoolRequest("monarch_local", pool_name, {"hosts": 1, "preload": ""}))
    src = tmp_path / "src"
    src.mkdir()
    (src / "kept.txt").write_text("kept across every generation\n")
    (src / "big.bin").write_bytes(os.urandom(2 << 20))
    first = sync(p, str(src), "ws")
    target = Path(first.hosts[0].path)
    assert (target / "big.bin").read_bytes() == (src / "big.bin").read_bytes()  # the first pack is open there now
    packs = node_store(tmp_path / "node-stores", pool_name, 0) / "packs"
    first_pack = {q.name for q in packs.glob("*.pack")}
    for _ in range(2):  # the first generation is dropped: its big chunks are used no more
        (src / "big.bin").write_bytes(os.urandom(2 << 20))
        assert sync(p, str(src), "ws").ok
    wait_for(lambda: not first_pack & {q.name for q in packs.glob("*.pack")}, timeout=30, what="the rewrite")
    assert (target / "kept.txt").read_text() == "kept across every generation\n"
    assert any(b"kept across every generation" in q.read_bytes() for q in packs.glob("*.pack"))  # moved, not lost
    assert (target / "big.bin").read_bytes() == (src / "big.bin").read_bytes()
    assert sum(q.stat().st_size for q in packs.glob("*.pack")) < 5 << 20  # two big files' chunks, not three
    # the FUSE server lets go of the packs deleted under it, so their space is freed
    servers = [
        int(d)
        for d in os.listdir("/proc")
        if d.isdigit()
        and b"monarch_torchx.syncfs.fusefs" in Path(f"/proc/{d}/cmdline").read_bytes()
        and str(tmp_path).encode() in Path(f"/proc/{d}/cmdline").read_bytes()
    ]
    assert first.hosts[0].served_by == "fuse" and servers
    held = [os.readlink(f"/proc/{pid}/fd/{fd}") for pid in servers for fd in os.listdir(f"/proc/{pid}/fd")]
    assert not [h for h in held if h.endswith(".pack (deleted)")], held
    stop_pool(p.name)


@pytest.mark.parametrize("meanwhile", ["a sync is promised the chunk", "a generation is committed"])
def test_a_pack_rewrite_is_undone_when_what_it_read_changed_under_it(tmp_path, meanwhile):
    """Between reading which chunks are used and swapping packs, a sync may be told a chunk left
    out is here (which pins it), or a generation using it may be committed (its pins then go):
    either way the rewrite is dropped, the old pack stays whole, and the chunk stays stored. The
    moment is made certain by acting between the new pack's write and the swap."""
    import blake3

    from monarch_torchx.syncfs import store as st

    s = st.ChunkStore(tmp_path / "store")
    used, other = b"u" * 100, os.urandom(1 << 20)
    hu, ho = blake3.blake3(used).hexdigest(), blake3.blake3(other).hexdigest()
    s.put([(hu, len(used)), (ho, len(other))], used + other)
    pack = next(iter(s.index().rows))
    epoch = s.commits  # what the sweep saw before it read the manifests
    write = s._write_pack

    def write_then_a_sync_acts(chunks, durable=False):
        out = write(chunks, durable)
        assert s.missing([ho]) == []  # the sync is told the chunk is here: it will not send it
        if meanwhile == "a generation is committed":
            s.committed([ho])
        return out

    s._write_pack = write_then_a_sync_acts
    s._compact(pack, {hu}, epoch)
    assert [p.name for p in s.packs.glob("*.pack")] == [pack] and list(s.index().rows) == [pack]
    f, at, n = s.open_chunk(ho)
    with f:
        f.seek(at)
        assert n == len(other) and f.read(n) == other


def test_a_pack_rewrite_leaves_out_a_used_chunk_whose_bytes_went_bad(tmp_path):
    """The rewrite hashes what it copies: a used chunk damaged on disk is not carried into the
    new pack, counts as missing, and is sent again; its good neighbour is kept and trusted."""
    import blake3

    from monarch_torchx.syncfs import store as st

    s = st.ChunkStore(tmp_path / "store")
    good, bad, dead = b"g" * 100, b"b" * 100, os.urandom(1 << 20)
    hg, hb, hd = (blake3.blake3(d).hexdigest() for d in (good, bad, dead))
    s.put([(hg, 100), (hb, 100), (hd, len(dead))], good + bad + dead)
    pack = next(iter(s.index().rows))
    raw = bytearray((s.packs / pack).read_bytes())
    raw[100:200] = b"x" * 100
    (s.packs / pack).write_bytes(bytes(raw))
    s._compact(pack, {hg, hb}, s.commits)
    assert not (s.packs / pack).exists() and s.missing([hg, hb, hd]) == [hb, hd]
    f, at, n = s.open_chunk(hg)
    with f:
        f.seek(at)
        assert f.read(n) == good


def test_a_second_copy_of_a_chunk_keeps_nothing_alive_and_a_bad_one_is_forgotten_everywhere(tmp_path):
    """A rewrite that died before deleting its old pack leaves a chunk in two packs: the copy it
    is served from counts, the other one is collected. A chunk found bad loses every copy, so the
    one sent again is the one served."""
    import blake3

    from monarch_torchx.syncfs import store as st

    s = st.ChunkStore(tmp_path / "store")
    data = os.urandom(1 << 20)
    h = blake3.blake3(data).hexdigest()
    first, _ = s._write_pack({h: data})
    second, _ = s._write_pack({h: data})  # the copy a dead rewrite left
    old = time.time() - 2 * st.GC_GRACE_S
    for name in (first, second):
        os.utime(s.packs / name, (old, old))
    s.pins[h] = time.time()
    s.sweep()
    assert [p.name for p in s.packs.glob("*.pack")] == [first] and h in s.present()
    s._write_pack({h: data})
    s.index().forget(h)
    assert all(h not in {r[0] for r in rows} for rows in s.index().rows.values())
    assert h not in s.index().remove([])


def test_a_pack_rewrite_on_a_full_disk_leaves_the_pack_whole_and_the_sweep_quiet(tmp_path):
    """A sweep runs after a commit: a rewrite that cannot write its new pack (disk full) must not
    fail the commit that called it, nor lose the chunks still used."""
    import blake3

    from monarch_torchx.syncfs import store as st

    s = st.ChunkStore(tmp_path / "store")
    used, other = b"u" * 100, os.urandom(1 << 20)
    hu, ho = blake3.blake3(used).hexdigest(), blake3.blake3(other).hexdigest()
    s.put([(hu, len(used)), (ho, len(other))], used + other)
    pack = next(iter(s.index().rows))

    def full(chunks, durable=False):
        raise st.StoreError("disk full while storing 1 chunk(s); the previous generation is intact")

    s._write_pack = full
    old = time.time() - 2 * st.GC_GRACE_S
    os.utime(s.packs / pack, (old, old))  # past the grace period
    s.pins[hu] = time.time()  # a sync relies on it: used, where its neighbour is not
    s.sweep()
    assert (s.packs / pack).exists() and {hu, ho} <= s.present()


def test_a_chunk_found_on_disk_is_hashed_before_it_is_trusted(tmp_path):
    """A store an earlier agent left is not taken on its word: a packed chunk (or a chunk file,
    as an earlier version of the store wrote them) whose bytes do not hash to its name counts as
    missing, is not served, and is sent again; good ones are kept."""
    import blake3

    from monarch_torchx.syncfs import store as st

    s = st.ChunkStore(tmp_path / "store")
    good, bad = os.urandom(300 << 10), os.urandom(300 << 10)
    small_good, small_bad = b"s" * 100, b"t" * 100
    hg, hb = blake3.blake3(good).hexdigest(), blake3.blake3(bad).hexdigest()
    hsg, hsb = blake3.blake3(small_good).hexdigest(), blake3.blake3(small_bad).hexdigest()
    s.put([(hsg, 100), (hsb, 100)], small_good + small_bad)
    for h, data in ((hg, good), (hb, b"planted" + bad[7:])):  # same size, other bytes
        s.chunk_path(h).parent.mkdir(parents=True, exist_ok=True)
        s.chunk_path(h).write_bytes(data)
    pack = next(s.packs.glob("*.pack"))
    data = bytearray(pack.read_bytes())
    off = data.find(small_bad)
    data[off : off + 100] = b"u" * 100
    pack.write_bytes(bytes(data))
    later = st.ChunkStore(s.root)  # the next agent of the pool opens the same store
    assert sorted(later.missing([hg, hb, hsg, hsb])) == sorted([hb, hsb])
    assert not later.chunk_path(hb).exists()
    assert later.missing([hg, hsg]) == []  # hashed once, then trusted
    later.put([(hb, len(bad)), (hsb, 100)], bad + small_bad)  # sent again: stored and served
    later.index().remove([])  # a sweep's rebuild of the index does not bring the bad copy back
    for h, want in ((hsb, small_bad), (hb, bad), (hg, good)):
        f, at, _ = later.open_chunk(h)
        with f:
            f.seek(at)
            assert f.read(len(want)) == want


def test_chunks_of_a_sync_that_never_committed_are_collected(home, pool_name, tmp_path, monkeypatch):
    """Chunks stored for a sync that was aborted before its commit (here: put to a new target,
    never committed) are swept by the agent on its own, once older than the grace period."""
    import blake3

    monkeypatch.setenv("MONARCH_TORCHX_SYNC_STORE", str(tmp_path / "node-stores"))
    monkeypatch.setenv("MONARCH_TORCHX_SYNC_GC_GRACE_S", "1")
    monkeypatch.setenv("MONARCH_TORCHX_SYNC_SWEEP_S", "0.5")
    p = ensure_pool(PoolRequest("monarch_local", pool_name, {"hosts": 1, "preload": ""}))
    kept = make_tree(tmp_path / "src")
    assert sync(p, str(kept), "ws").ok  # a committed tree: its chunks stay
    data = [os.urandom(300_000), b"x" * 1000]
    chunks = [(blake3.blake3(d).hexdigest(), len(d)) for d in data]
    assert p.call(0, "syncfs.missing", hashes=[h for h, _ in chunks], target="never") == [h for h, _ in chunks]
    p.call(0, "syncfs.put", chunks=chunks, data=b"".join(data))
    store = node_store(tmp_path / "node-stores", pool_name, 0)  # (asking `missing` would pin them)
    packs = set((store / "packs").glob("*.pack"))
    assert len(packs) == 2  # the tree's pack and the aborted sync's
    wait_for(lambda: len(set((store / "packs").glob("*.pack"))) == 1, timeout=30, what="the sweep")
    assert p.call(0, "syncfs.missing", hashes=[h for h, _ in chunks]) == [h for h, _ in chunks]
    report = sync(p, str(kept), "ws")  # the committed tree's chunks were kept: nothing to send
    assert report.ok and report.bytes_sent < 100_000


@pytest.mark.parametrize("backend", ["cma", "tcp"])
def test_bulk_bytes_over_the_rdma_module(home, pool_name, tmp_path, monkeypatch, backend):
    """MONARCH_TORCHX_SYNC_TRANSFER=rdma: each put carries an RDMABuffer handle and the host pulls
    the batch with the rdma module (here cma, same host; or its TCP data plane, forced as
    MONARCH_TORCHX_RDMA=tcp), then forwards it down the chain the same way. ibverbs, which
    `auto` picks, takes this same path with a device (none here)."""
    from monarch_torchx.errors import MonarchError

    monkeypatch.setenv("MONARCH_TORCHX_SYNC_STORE", str(tmp_path / "node-stores"))
    monkeypatch.setenv("MONARCH_TORCHX_SYNC_TRANSFER", "rdma")
    if backend == "tcp":
        monkeypatch.setenv("MONARCH_TORCHX_RDMA", "tcp")  # the client's and (inherited) the agents'
    p = ensure_pool(PoolRequest("monarch_local", pool_name, {"hosts": 3, "preload": ""}))
    src = make_tree(tmp_path / "src")
    report = sync(p, str(src), "ws")
    assert report.ok and report.transfer == f"rdma/{backend}"
    assert (5 << 20) <= report.bytes_sent < (6 << 20)  # still once: hosts 1 and 2 got it down the chain
    for h in report.hosts:
        assert_same_tree(src, Path(h.path))
    monkeypatch.setenv("MONARCH_TORCHX_SYNC_TRANSFER", "carrier-pigeon")
    with pytest.raises(MonarchError, match="use auto, socket or rdma"):
        sync(p, str(src), "ws")


def test_fuse_server_finds_a_chunk_that_was_collected_and_sent_again(tmp_path, monkeypatch):
    """The FUSE server's own pack index: after a sweep removed the pack it knew for a chunk and a
    later sync brought the chunk again in a new pack, reads are served from the new pack."""
    import blake3

    from monarch_torchx.syncfs import store as st
    from monarch_torchx.syncfs.fusefs import SyncFS
    from monarch_torchx.syncfs.manifest import Entry, Manifest

    s = st.ChunkStore(tmp_path / "store")
    data = b"reverted later" * 10
    h = blake3.blake3(data).hexdigest()
    s.put([(h, len(data))], data)
    target = tmp_path / "mnt"
    s.commit(target, Manifest([Entry("f", "f", 0o644, len(data), 0, [(h, len(data))])]), fuse=True)
    fs = SyncFS(str(s.target_dir(target)), str(s.root))
    fd, off = fs._where(h, len(data))
    assert os.pread(fd, len(data), off) == data
    monkeypatch.setattr(st, "GC_GRACE_S", 0.0)
    for k in range(2):  # two generations without the chunk: its pack is collected
        other = f"other {k}".encode()
        oh = blake3.blake3(other).hexdigest()
        s.put([(oh, len(other))], other)
        s.commit(target, Manifest([Entry("g", "f", 0o644, len(other), 0, [(oh, len(other))])]), fuse=True)
        s.swept = 0.0
        s.collect(target)
    assert h not in s.present()
    s.put([(h, len(data))], data)  # sent again: a new pack
    fd, off = fs._where(h, len(data))
    assert os.pread(fd, len(data), off) == data


def test_a_target_whose_fuse_server_died_is_mounted_again_by_the_next_sync(pool, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello\n")
    first = sync(pool, str(src), "ws", hosts=[0])
    path = Path(first.hosts[0].path)
    assert (path / "a.txt").read_text() == "hello\n"
    store = node_store(tmp_path / "node-stores", pool.name, 0)
    kill_orphans(store)  # the server goes away; the mount with it

    wait_for(lambda: not os.path.ismount(path) and not fuse_servers(store), timeout=10, what="the FUSE server to go")
    again = sync(pool, str(src), "ws", hosts=[0])  # the same tree: not "unchanged", since nothing serves it
    assert again.ok and again.generation == first.generation + 1 and again.hosts[0].served_by == "fuse"
    assert os.path.ismount(path) and (path / "a.txt").read_text() == "hello\n"


def _as_nobody(*cmd: str) -> subprocess.CompletedProcess:
    """Runs a command as another local user (uid 65534): what a stranger on a shared node can do."""
    return subprocess.run(
        ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", *cmd], capture_output=True, text=True
    )


def test_the_store_is_private_and_a_planted_root_is_refused(home, pool_name, tmp_path, monkeypatch):
    """Another local user can neither read what is synced (a 0600 `.env` included) nor plant a chunk:
    the store's root is made 0700 and checked; a root someone else made first is refused."""
    shared = tmp_path / "shared-tmp"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o1777)  # like /tmp
    monkeypatch.setenv("TMPDIR", str(shared))  # the default store root is $TMPDIR/monarch_torchx-UID
    monkeypatch.delenv("MONARCH_TORCHX_SYNC_STORE", raising=False)
    pool = ensure_pool(PoolRequest("monarch_local", pool_name, {"hosts": 1, "preload": ""}))
    src = tmp_path / "src"
    src.mkdir()
    (src / "main.py").write_text("print('mine')\n")
    (src / ".env").write_text("TOKEN=secret\n")
    os.chmod(src / ".env", 0o600)
    report = sync(pool, str(src), "ws")
    assert report.ok, report
    root = shared / f"monarch_torchx-{os.getuid()}"
    store = node_store(root / "syncfs", pool_name, 0)
    for d in (root, root / "syncfs", store):
        assert os.stat(d).st_mode & 0o777 == 0o700, d
    files = [p for p in store.rglob("*") if p.is_file() and "mounts" not in p.parts]
    assert files and not [(p.relative_to(store), oct(os.stat(p).st_mode)) for p in files if os.stat(p).st_mode & 0o077]
    os.chmod(tmp_path, 0o755)  # (pytest's tmp dirs are 0700: let the stranger reach shared-tmp at all)
    os.chmod(tmp_path.parent, 0o755)
    res = _as_nobody("cat", *map(str, files))
    assert res.returncode != 0 and "Permission denied" in res.stderr and "secret" not in res.stdout
    res = _as_nobody("touch", str(store / "chunks" / "planted"))
    assert res.returncode != 0
    stop_pool(pool_name)
    assert not root.exists()  # nothing left in the node's temp dir

    # a stranger made the root first (theirs, or open to all): the pool's agents refuse to start
    # there, in one line (before, the pool read healthy and each sync was refused)
    other = pool_name + "x"
    root.mkdir(mode=0o777)
    os.chmod(root, 0o777)
    with pytest.raises(MonarchError, match=r"did not start: .*monarch_torchx-\d+ is open to other users .*chmod 700"):
        ensure_pool(PoolRequest("monarch_local", other, {"hosts": 1, "preload": ""}))
    assert not list(root.iterdir())  # nothing written there


def test_two_pools_of_one_name_in_two_homes_keep_their_own_stores(pool_name, tmp_path, monkeypatch):
    from monarch_torchx.registry import Registry

    monkeypatch.setenv("MONARCH_TORCHX_SYNC_STORE", str(tmp_path / "node-stores"))
    pools = []
    for n in (1, 2):
        home = tmp_path / f"home{n}"
        src = tmp_path / f"src{n}"
        src.mkdir()
        (src / "who.txt").write_text(f"pool in home{n}\n")
        reg = Registry(home)
        pool = ensure_pool(PoolRequest("monarch_local", pool_name, {"hosts": 1, "preload": ""}), reg)
        pools.append((pool, reg, src))
    paths = [Path(sync(pool, str(src), "ws").hosts[0].path) for pool, _, src in pools]
    assert paths[0] != paths[1]
    assert [(p / "who.txt").read_text() for p in paths] == ["pool in home1\n", "pool in home2\n"]
    for pool, reg, _ in pools:  # noqa: B007
        stop_pool(pool_name, reg)


def test_a_killed_agent_leaves_no_fuse_server_or_mount(pool, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello\n")
    path = Path(sync(pool, str(src), "ws", hosts=[0]).hosts[0].path)
    store = node_store(tmp_path / "node-stores", pool.name, 0)
    assert os.path.ismount(path) and fuse_servers(store)
    os.kill(pool.hosts[0].pid, signal.SIGKILL)
    wait_for(
        lambda: not fuse_servers(store) and not os.path.ismount(path),
        timeout=15,
        what="the FUSE server to end with its agent, and its mount with it",
    )


def test_pool_stop_ends_what_a_killed_agent_left(home, pool_name, tmp_path, monkeypatch):
    """An agent SIGKILLed with its FUSE server (as an OOM kill takes both) leaves a mount and a
    sync store; `pool stop` finds and ends them, and says so."""
    monkeypatch.setenv("MONARCH_TORCHX_SYNC_STORE", str(tmp_path / "node-stores"))
    pool = ensure_pool(PoolRequest("monarch_local", pool_name, {"hosts": 2, "preload": ""}))
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello\n")
    path = sync(pool, str(src), "ws").hosts[1].path
    store = node_store(tmp_path / "node-stores", pool_name, 1)
    for pid in [pool.hosts[1].pid, *fuse_servers(store)]:
        os.kill(pid, signal.SIGKILL)
    assert path in syncfs_mounts(tmp_path) and store.is_dir()  # (a dead FUSE mount: stat fails, /proc/mounts knows)
    left = stop_pool(pool_name)
    assert f"host 1: sync store {store}" in left and f"host 1: mount {path}" in left
    assert not store.exists() and not syncfs_mounts(tmp_path)
    assert not list((tmp_path / "node-stores").glob(f"{pool_name}-*"))


def test_an_abandoned_chained_sync_leaves_no_forwarder(home, pool_name, tmp_path, monkeypatch):
    """A client that stops mid-sync (killed, interrupted) never flushes: the first host of the
    chain drops its forwarding (threads, connections) after the idle limit, and a late flush says so."""
    import blake3

    monkeypatch.setenv("MONARCH_TORCHX_SYNC_STORE", str(tmp_path / "node-stores"))
    monkeypatch.setenv("MONARCH_TORCHX_SYNC_SESSION_IDLE_S", "1")
    pool = ensure_pool(PoolRequest("monarch_local", pool_name, {"hosts": 2, "preload": ""}))
    data = os.urandom(1000)
    h = blake3.blake3(data).hexdigest()
    nxt = pool.hosts[1]
    chain = [{"host": nxt.host, "port": nxt.port, "identity": nxt.identity(pool_name).decode(), "index": 1}]
    pool.call(0, "syncfs.put", chunks=[(h, len(data))], data=data, session="s" * 32, chain=chain)
    assert [s["session"] for s in pool.call(0, "syncfs.sessions")] == ["s" * 32]
    wait_for(lambda: not pool.call(0, "syncfs.sessions"), timeout=10, what="the abandoned forwarder to go")
    late = pool.call(0, "syncfs.flush", session="s" * 32)
    assert "stalled" in late["failed"][1]
