"""Faults in a 64-host pool, through the relay tree as it runs by default (fan-out 8, depth 2)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from monarch_torchx.pool import LOST, OK, UNREACHABLE, attach
from monarch_torchx.syncfs import sync

from .conftest import (
    assert_a_relay_killed_mid_wait_is_passed_over,
    assert_launch_with_dead_hosts_is_all_or_nothing,
    module_pool,
    torchx,
    wait_for,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.serial,
]  # (its module-wide pool: one worker)

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
    h = (
        torchx(
            home,
            "run",
            "-s",
            "monarch_local",
            "-cfg",
            f"pool={name}",
            "utils.echo",
            "--msg",
            "back",
            "--num_replicas",
            str(HOSTS),
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    wait_for(lambda: "SUCCEEDED" in torchx(home, "status", h).stdout, timeout=120, what="echo on 64 hosts")


def test_a_sync_to_64_hosts_is_asked_through_the_relay_tree_and_sent_down_a_tree_of_chains(big, tmp_path):
    name, _ = big
    pool = attach(name)
    src = tmp_path / "src"
    for i in range(50):
        (src / f"d{i % 5}").mkdir(parents=True, exist_ok=True)
        (src / f"d{i % 5}" / f"f{i}.py").write_text(f"x = {i}\n" * 200)
    (src / "blob.bin").write_bytes(os.urandom(3 << 20))
    size = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())

    def relayed() -> int:  # (each ask counts its own relaying too)
        return sum(v["relayed"] for _, v, _ in pool.ask("info", range(HOSTS)))

    r0 = relayed()
    per_ask = relayed() - r0
    r1 = r0 + per_ask
    report = sync(pool, str(src), "code")
    assert report.ok and len(report.hosts) == HOSTS and len({h.generation for h in report.hosts}) == 1
    assert report.bytes_sent <= 2 * size + (1 << 20)  # two halves of 32, not 4 chains of 16
    # the target check, what lacks, prepare and commit went through the relays, as an info does
    assert per_ask > 0 and relayed() - r1 - per_ask >= 3 * per_ask
    assert pool.ask("syncfs.where", [0, 63], target="code")[1][1]["generation"] == report.generation


def test_a_relay_of_64_killed_mid_operation_is_passed_over(big):  # (last: it leaves host 8 dead)
    name, _ = big
    assert_a_relay_killed_mid_wait_is_passed_over(attach(name), "midwait64", victim=8)  # leads 8 of the 64
