"""Faults in a 64-host pool, through the relay tree as it runs by default (fan-out 8, depth 2)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from monarch_torchx.pool import LOST, OK, UNREACHABLE, attach

from .conftest import (assert_a_relay_killed_mid_wait_is_passed_over, assert_launch_with_dead_hosts_is_all_or_nothing,
                       module_pool, torchx, wait_for)

HOSTS = 64


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    with module_pool(tmp_path_factory, "big64", HOSTS, preload="none") as made:
        yield made


def test_a_hung_host_of_64_is_named_and_the_others_answer(big):
    name, home = big
    pool = attach(name)
    victim = 37
    pid = pool.hosts[victim].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        t = time.monotonic()
        health = pool.health()
        took = time.monotonic() - t
        assert [h.index for h in health if h.state != OK] == [victim]
        assert health[victim].state == UNREACHABLE and f"host {victim} of pool" in health[victim].error
        assert took < 40, took  # the patient probe's bound, not a speed check
        out = torchx(home, "pool", "status", name, check=False).stdout
        assert f"\n{victim} " in out and "unreachable" in out
    finally:
        os.kill(pid, signal.SIGCONT)
    assert all(h.ok for h in pool.health())


def test_a_launch_on_64_with_3_dead_hosts_is_all_or_nothing(big):
    name, home = big
    pool = attach(name)
    dead = [5, 30, 63]
    assert_launch_with_dead_hosts_is_all_or_nothing(pool, "aon64", dead)
    health = pool.health()
    assert [h.index for h in health if h.state == LOST] == dead
    # the next run repairs the dead hosts and runs on all 64
    h = torchx(home, "run", "-s", "monarch_local", "-cfg", f"pool={name}", "utils.echo", "--msg", "back",
               "--num_replicas", str(HOSTS)).stdout.strip().splitlines()[-1]
    wait_for(lambda: "SUCCEEDED" in torchx(home, "status", h).stdout, timeout=120, what="echo on 64 hosts")


def test_a_relay_of_64_killed_mid_operation_is_passed_over(big):  # (last: it leaves host 8 dead)
    name, _ = big
    assert_a_relay_killed_mid_wait_is_passed_over(attach(name), "midwait64", victim=8)  # leads 8 of the 64
