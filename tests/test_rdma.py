"""RDMABuffer on a real warm pool: cma (same host) and tcp backends, batching, faults.

ibverbs needs an RDMA device: its transfer test runs only where pyverbs lists one; everywhere
else the "no device" behaviour is what is tested.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from monarch_torchx import attach
from monarch_torchx.rdma import RDMAAction, RDMABuffer, RDMAError, get_rdma_backend, ibverbs
from tests.conftest import module_pool
from tests.fixtures.rdma_actors import Weights

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("test_rdma")]  # (its module-wide pool: one worker)

REPO = Path(__file__).resolve().parents[1]
N = 1 << 20  # floats per buffer


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with module_pool(tmp_path_factory, "rdma", 2) as (name, _home):
        yield name


@pytest.fixture
def weights(pool):
    procs = attach(pool).spawn_procs(per_host={"procs": 1})
    yield procs.spawn("w", Weights, N)
    procs.stop().get()


def as_bytes(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("backend", ["cma", "tcp"])
def test_read_and_write_one_sided(weights, backend, monkeypatch):
    monkeypatch.setenv("MONARCH_TORCHX_RDMA", backend)
    w0 = weights.slice(hosts=0)
    buf = w0.handle.call_one().get()
    assert buf.size() == 4 * N and buf.backend == backend and "w[0]" in buf.owner
    dst = torch.zeros(N, dtype=torch.float32)
    buf.read_into(as_bytes(dst)).get()
    assert torch.equal(dst, torch.arange(N, dtype=torch.float32))
    buf.write_from(as_bytes(torch.full((3,), -1.0)), offset=8).get()  # floats 2..4
    assert w0.head.call_one(6).get() == [0.0, 1.0, -1.0, -1.0, -1.0, 5.0]
    part = bytearray(4 * N - 16)
    buf.read_into(part, offset=16).get()  # from float 4 on, into a bytearray
    assert torch.frombuffer(part, dtype=torch.float32)[:2].tolist() == [-1.0, 5.0]


def test_large_tcp_transfer_uses_parallel_streams(pool, monkeypatch):
    monkeypatch.setenv("MONARCH_TORCHX_RDMA", "tcp")
    procs = attach(pool).spawn_procs(per_host={"procs": 1})
    try:
        w = procs.spawn("big", Weights, 16 << 20)  # 64 MiB: split over several connections
        buf = w.slice(hosts=1).handle.call_one().get()
        dst = torch.empty(16 << 20, dtype=torch.float32)
        buf.read_into(as_bytes(dst)).get()
        assert torch.equal(dst, torch.arange(16 << 20, dtype=torch.float32))
        src = torch.randn(16 << 20)
        buf.write_from(as_bytes(src)).get()
        assert w.slice(hosts=1).checksum.call_one().get() == pytest.approx(float(src.double().sum()))
    finally:
        procs.stop().get()


def test_proc_to_proc_and_batches(weights):
    b0 = weights.slice(hosts=0).handle.call_one().get()
    b1 = weights.slice(hosts=1).handle.call_one().get()
    expect = float(torch.arange(N, dtype=torch.float64).sum())
    assert weights.slice(hosts=1).read_from.call_one(b0, N).get() == expect  # an actor pulls another's memory
    d0, d1 = torch.empty(N), torch.empty(N - 2)
    # one batch, run concurrently: two reads and a write to a region the reads do not cover
    RDMAAction().read_remote(as_bytes(d0), b0).read_remote(as_bytes(d1), b1, offset=8).write_remote(
        b1, as_bytes(torch.full((2,), 7.0))
    ).submit(timeout=30).get()
    assert float(d0.double().sum()) == expect and float(d1.double().sum()) == expect - 1
    assert weights.slice(hosts=1).head.call_one(3).get() == [7.0, 7.0, 2.0]


def test_owned_by_the_controller(pool, weights):
    """A buffer of the controller's own memory, read by an actor (and by the controller itself)."""
    mine = torch.arange(N, dtype=torch.float32)
    buf = RDMABuffer(as_bytes(mine))
    assert weights.slice(hosts=0).read_from.call_one(buf, N).get() == float(mine.double().sum())
    back = torch.empty(N)
    buf.read_into(as_bytes(back)).get()
    assert torch.equal(back, mine)
    buf.drop().get()


def test_bad_input(pool, weights):
    with pytest.raises(RDMAError, match="not contiguous"):
        RDMABuffer(torch.arange(10.0).reshape(2, 5).t())
    with pytest.raises(ValueError, match="size 0"):
        RDMABuffer(torch.empty(0))
    with pytest.raises(RDMAError, match="expected a torch tensor"):
        RDMABuffer([1, 2, 3])
    buf = weights.slice(hosts=0).handle.call_one().get()
    with pytest.raises(ValueError, match=f"dst has 16 bytes but the buffer has {4 * N} to read"):
        buf.read_into(bytearray(16))
    with pytest.raises(ValueError, match="src has .* bytes but the buffer has"):
        buf.write_from(bytearray(4 * N + 1))
    with pytest.raises(ValueError, match="offset .* is outside"):
        buf.read_into(bytearray(4 * N), offset=4 * N)
    with pytest.raises(RDMAError, match="read-only"):
        buf.read_into(bytes(4 * N))
    ro = RDMABuffer(bytes(64))  # read-only memory can be read, not written
    with pytest.raises(RDMAError, match="read-only"):
        ro.write_from(bytearray(8))


@pytest.mark.parametrize("backend", ["cma", "tcp"])
def test_read_after_drop(weights, backend, monkeypatch):
    monkeypatch.setenv("MONARCH_TORCHX_RDMA", backend)
    w0 = weights.slice(hosts=0)
    buf = w0.handle.call_one().get()
    w0.drop.call_one().get()  # the owner drops it
    dst = torch.zeros(N)
    with pytest.raises(RDMAError, match="dropped by its owner"):
        buf.read_into(as_bytes(dst)).get(timeout=30)
    assert float(dst.sum()) == 0.0  # untouched
    buf2 = w0.handle.call_one().get()
    buf2.drop().get()  # a holder drops it
    with pytest.raises(RDMAError, match="was dropped"):
        buf2.read_into(as_bytes(dst))
    with pytest.raises(RDMAError, match="dropped by its owner"):
        RDMABuffer._from_handle(buf2._h).read_into(as_bytes(dst)).get(timeout=30)


def test_owner_killed_mid_transfer_fails_the_future(pool, monkeypatch):
    monkeypatch.setenv("MONARCH_TORCHX_RDMA", "tcp")
    procs = attach(pool).spawn_procs(per_host={"procs": 1})
    try:
        w = procs.spawn("big", Weights, 128 << 20).slice(hosts=1)  # 512 MiB
        buf = w.handle.call_one().get()
        pid = w.pid.call_one().get()
        dst = torch.empty(128 << 20)
        t0 = time.time()
        fut = buf.read_into(as_bytes(dst), timeout=30)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RDMAError, match="owner"):
            fut.get(timeout=40)
        assert time.time() - t0 < 30
        monkeypatch.setenv("MONARCH_TORCHX_RDMA", "cma")  # same host, owner gone: refused up front
        with pytest.raises(RDMAError, match="has exited"):
            buf.read_into(as_bytes(dst)).get(timeout=10)
    finally:
        procs.stop().get()


def test_backend_selection_and_forced_ibverbs_without_a_device(monkeypatch):
    if ibverbs.available():
        pytest.skip("this machine has an RDMA device")
    monkeypatch.delenv("MONARCH_TORCHX_RDMA", raising=False)
    assert get_rdma_backend() == "tcp"
    monkeypatch.setenv("MONARCH_TORCHX_RDMA", "ibverbs")
    with pytest.raises(RDMAError, match="MONARCH_TORCHX_RDMA=ibverbs, but .*unset it to use tcp/cma") as ei:
        RDMABuffer(torch.ones(4))
    assert "\n" not in str(ei.value)
    monkeypatch.setenv("MONARCH_TORCHX_RDMA", "infiniband")
    with pytest.raises(RDMAError, match="is not a backend: use ibverbs, tcp or cma"):
        get_rdma_backend()


@pytest.mark.skipif(not ibverbs.available(), reason=f"ibverbs not exercised here: {ibverbs.devices()[1]}")
def test_ibverbs_read_and_write(weights, monkeypatch):
    monkeypatch.setenv("MONARCH_TORCHX_RDMA", "ibverbs")
    procs = attach(weights.pool).spawn_procs(per_host={"procs": 1})
    try:
        w = procs.spawn("ib", Weights, N).slice(hosts=1)
        buf = w.handle.call_one().get()
        assert buf.backend == "ibverbs"
        dst = torch.empty(N)
        buf.read_into(as_bytes(dst)).get()
        assert torch.equal(dst, torch.arange(N, dtype=torch.float32))
        buf.write_from(as_bytes(torch.zeros(1))).get()
        assert w.head.call_one(2).get() == [0.0, 1.0]
    finally:
        procs.stop().get()


def test_batch_refuses_overlapping_writes(weights):
    buf = weights.slice(hosts=0).handle.call_one().get()
    a, b = torch.empty(N), torch.zeros(4)
    with pytest.raises(ValueError, match="write and use the same bytes of one buffer"):
        RDMAAction().read_remote(as_bytes(a), buf).write_remote(buf, as_bytes(b)).submit()
    with pytest.raises(ValueError, match="same local memory"):
        RDMAAction().read_remote(as_bytes(a), buf).read_remote(as_bytes(a), buf).submit()
    RDMAAction().read_remote(as_bytes(a), buf).read_remote(
        as_bytes(torch.empty(N)), buf
    ).submit().get()  # reads may share


def test_forked_child_gets_its_own_connections(weights, monkeypatch):
    """A child forked after transfers must not share the parent's data-plane sockets or threads."""
    import multiprocessing as mp

    monkeypatch.setenv("MONARCH_TORCHX_RDMA", "tcp")
    buf = weights.slice(hosts=1).handle.call_one().get()
    dst = torch.empty(N)
    buf.read_into(as_bytes(dst)).get()  # the parent now holds idle connections and worker threads

    def child(conn):  # no torch ops here: torch's own thread pool does not survive a fork
        d = bytearray(4 * N)
        try:
            buf.read_into(d).get(timeout=30)
            conn.send(hashlib.sha256(d).hexdigest())
        except Exception as e:
            conn.send(repr(e))

    parent_end, child_end = mp.get_context("fork").Pipe()
    p = mp.get_context("fork").Process(target=child, args=(child_end,))
    p.start()
    assert parent_end.poll(60) and parent_end.recv() == hashlib.sha256(dst.numpy().tobytes()).hexdigest()
    p.join(10)
    buf.read_into(as_bytes(dst)).get(timeout=30)  # the parent's own connections are still in step
    assert torch.equal(dst, torch.arange(N, dtype=torch.float32))


def test_a_handshake_flood_does_not_keep_reads_out(weights, monkeypatch):
    """Silent peers holding more than every handshake slot of a buffer's owner: reads still work."""
    import socket

    from monarch_torchx import wire

    monkeypatch.setenv("MONARCH_TORCHX_RDMA", "tcp")
    buf = weights.slice(hosts=1).handle.call_one().get()
    host, port, _ = buf._h.owner_addr
    flood = [socket.create_connection((host, port)) for _ in range(2 * wire.MAX_HANDSHAKES)]
    try:
        for _ in range(3):
            dst = torch.zeros(N, dtype=torch.float32)
            buf.read_into(as_bytes(dst)).get()
            assert torch.equal(dst, torch.arange(N, dtype=torch.float32))
    finally:
        for s in flood:
            s.close()
