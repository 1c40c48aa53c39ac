"""The pool's view of addresses (Registry.read_view): one file read per operation on all hosts.

Real local pools. Reads of host files are counted by wrapping ``Registry.read_host`` (the real
function still runs): on a shared file system each is a metadata round trip.
"""

from __future__ import annotations

import json
import os
import signal
import stat

import pytest

from monarch_torchx.pool import OK, PoolRequest, attach, ensure_pool
from monarch_torchx.registry import VIEW_FILE, HostAddr, Registry

from .conftest import torchx, wait_for

pytestmark = pytest.mark.integration

HOSTS = 3


@pytest.fixture
def pool(home, pool_name):
    ensure_pool(PoolRequest("monarch_local", pool_name, {"hosts": HOSTS, "preload": "none"}))
    return attach(pool_name)


@pytest.fixture
def host_reads(monkeypatch):
    reads = []
    real = Registry.read_host

    def counted(state_dir, index):
        reads.append(index)
        return real(state_dir, index)

    monkeypatch.setattr(Registry, "read_host", staticmethod(counted))
    return reads


def _view(pool) -> dict:
    return json.loads((pool.record.path / VIEW_FILE).read_text())


def test_a_healthy_pool_is_asked_from_one_view_without_reading_host_files(pool, host_reads):
    assert [h.state for h in pool.health()] == [OK] * HOSTS  # this read every file and wrote the view
    path = pool.record.path / VIEW_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [h["incarnation"] for h in _view(pool)["hosts"]] == [h.incarnation for h in pool.hosts]
    host_reads.clear()
    again = attach(pool.name)
    assert [h.state for h in again.health()] == [OK] * HOSTS
    assert [i for i, _, e in again.ask("list", range(HOSTS)) if e is None] == list(range(HOSTS))
    assert host_reads == []


def test_heartbeats_keep_the_view_and_a_restarted_host_drops_it(pool, home):
    pool.health()
    before = (pool.record.path / VIEW_FILE).read_text()
    h = pool.hosts[1]
    Registry.publish_host(pool.record.path, HostAddr(**{**h.__dict__, "heartbeat": h.heartbeat + 1}), moved=False)
    assert (pool.record.path / VIEW_FILE).read_text() == before
    os.kill(h.pid, signal.SIGKILL)
    wait_for(
        lambda: not os.path.exists(f"/proc/{h.pid}") or "zombie" in open(f"/proc/{h.pid}/status").read(),
        what="the agent to die",
    )
    torchx(home, "run", "-s", "monarch_local", "-cfg", f"pool={pool.name}", "utils.echo", "--msg", "hi")  # repairs it
    fresh = attach(pool.name)
    assert [x.state for x in fresh.health()] == [OK] * HOSTS
    assert fresh.hosts[1].incarnation != h.incarnation
    assert _view(fresh)["hosts"][1]["incarnation"] == fresh.hosts[1].incarnation


def test_a_stale_view_is_corrected_on_the_first_failed_call(pool):
    pool.health()
    view = _view(pool)
    real = view["hosts"][2]
    # as a client would leave it that read host 2's file just before host 2 was replaced
    view["hosts"][2] = {**real, "incarnation": "gone-since", "port": real["port"]}
    (pool.record.path / VIEW_FILE).write_text(json.dumps(view))
    stale = attach(pool.name)
    assert stale.hosts[2].incarnation == "gone-since"
    health = stale.health()
    assert [h.state for h in health] == [OK] * HOSTS  # the handshake failed, host 2's own file was read
    assert stale.hosts[2].incarnation == real["incarnation"]
    assert not (pool.record.path / VIEW_FILE).exists() or _view(pool)["hosts"][2]["incarnation"] == real["incarnation"]
    assert attach(pool.name).hosts[2].incarnation == real["incarnation"]  # the next client reads it right
