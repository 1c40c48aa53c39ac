"""A renewal's handover between host files (``agent/handover.py``): when a serving agent may hand
its host over, and when a successor on standby takes it over by itself. Real host files in a
temporary state dir, written and read as agents and clients do."""

from __future__ import annotations

import os
import socket
import time

import pytest

from monarch_torchx.agent.handover import hand_over, handing_over_to, take_over_due
from monarch_torchx.errors import MonarchError
from monarch_torchx.registry import HostAddr, PoolRecord, Registry
from monarch_torchx.schedulers.slurm import Allocation, SlurmProvisioner, allocations, set_allocations
from monarch_torchx.schedulers.slurm_allocator import renew_lead_s

OLD = HostAddr(0, "10.77.0.11", 4000, "node1", 11, "old", last_work=100.0)
NEW = HostAddr(0, "10.77.0.12", 4001, "node2", 22, "new")


def _dir(tmp_path):
    (tmp_path / "hosts").mkdir()
    return tmp_path


def test_a_serving_agent_hands_over_only_to_an_armed_live_successor(tmp_path):
    d = _dir(tmp_path)
    Registry.publish_host(d, OLD)
    assert handing_over_to(d, 0, "old") is None  # none waits
    Registry.publish_host(d, NEW, standby=True)
    assert handing_over_to(d, 0, "old") is None  # up, not yet given what was synced
    Registry.publish_host(d, HostAddr(**{**NEW.__dict__, "armed": True}), standby=True)
    succ = handing_over_to(d, 0, "old")
    assert succ is not None and succ.incarnation == "new"
    assert Registry.read_host(d, 0) == OLD  # (a standby file is not host 0's address)

    why = hand_over(d, succ, last_work=123.0)
    assert "handed host 0 over to its successor (pid 22 on node2)" in why
    now = Registry.read_host(d, 0)
    assert now is not None and now.incarnation == "new" and now.last_work == 123.0 and not now.armed


def test_a_successor_waits_while_its_predecessor_serves_and_heartbeats(tmp_path):
    d = _dir(tmp_path)
    Registry.publish_host(d, OLD)
    assert take_over_due(d, 0, "new", stale_after=90) is None


def test_a_successor_takes_over_what_was_handed_to_it_keeping_the_hosts_idle_clock(tmp_path):
    d = _dir(tmp_path)
    Registry.publish_host(d, HostAddr(**{**NEW.__dict__, "last_work": 123.0}))
    due = take_over_due(d, 0, "new", stale_after=90)
    assert due is not None and not due.leave and due.last_work == 123.0


def test_a_successor_takes_over_from_an_agent_its_walltime_ended(tmp_path):
    d = _dir(tmp_path)
    Registry.publish_host(d, HostAddr(**{**OLD.__dict__, "exited": 5.0, "exit_reason": "signal SIGTERM"}))
    due = take_over_due(d, 0, "new", stale_after=90)
    assert due is not None and not due.leave and "exited (signal SIGTERM)" in due.why


def _stale(d, port: int) -> None:
    Registry.publish_host(d, HostAddr(**{**OLD.__dict__, "host": "127.0.0.1", "port": port}))
    old = time.time() - 600
    os.utime(d / "hosts" / "0.json", (old, old))


def test_a_successor_takes_over_from_an_agent_whose_heartbeats_stopped_and_that_is_gone(tmp_path):
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = _dir(tmp_path)
    _stale(d, port)
    due = take_over_due(d, 0, "new", stale_after=90)
    assert due is not None and "has not written its heartbeat" in due.why


def test_an_old_heartbeat_alone_is_no_takeover_while_the_agent_still_listens(tmp_path):
    with socket.socket() as s:  # (a slow or full shared file system: the agent lives)
        s.bind(("127.0.0.1", 0))
        s.listen()
        d = _dir(tmp_path)
        _stale(d, s.getsockname()[1])
        assert take_over_due(d, 0, "new", stale_after=90) is None


def test_a_successor_leaves_with_a_predecessor_that_left_idle(tmp_path):
    d = _dir(tmp_path)
    Registry.publish_host(d, HostAddr(**{**OLD.__dict__, "exited": 5.0, "exited_idle": True}))
    due = take_over_due(d, 0, "new", stale_after=90)
    assert due is not None and due.leave


def test_an_allocation_record_keeps_its_successor():
    rec = PoolRecord("p", "monarch_slurm", {"hosts": 3}, "00", "/tmp/x")
    set_allocations(rec, [Allocation("7", 0, 1, 1.0, successor="9"), Allocation("8", 1, 2, 2.0)])
    got = allocations(rec)
    assert got[0].successor == "9" and got[0].jobs == ["7", "9"] and got[1].jobs == ["8"]


def test_a_successor_is_submitted_a_tenth_of_the_walltime_ahead_at_least_a_minute_at_most_half():
    assert renew_lead_s(120) == 60
    assert renew_lead_s(600) == 60
    assert renew_lead_s(24 * 3600) == 2.4 * 3600


def test_renew_needs_a_walltime_to_renew_before():
    with pytest.raises(MonarchError, match=r"renew=True needs time= .*-cfg time=02:00:00"):
        SlurmProvisioner().pool_spec({"renew": True}, {"hosts": 1}, {})
    options: dict = {}
    SlurmProvisioner().pool_spec({"renew": True, "time": "02:00:00"}, {"hosts": 1}, options)
    assert options["renew"] is True and options["walltime_s"] == 7200
