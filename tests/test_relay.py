"""Fan-out through the pool's agents (agent/relay.py): answers, and faults of relaying hosts.

A pool of 10 local agents, with the tree forced on (it starts at 32 hosts by default) and a
fan-out of 2, so requests pass through several levels of agents.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import replace

import pytest

import monarch_torchx.net.fanout as relay
from monarch_torchx.errors import HostUnreachable
from monarch_torchx.pool import LOST, OK, PoolRequest, attach, ensure_pool
from monarch_torchx.registry import Registry

from .conftest import (
    assert_a_relay_killed_mid_wait_is_passed_over,
    assert_launch_with_dead_hosts_is_all_or_nothing,
    torchx,
    wait_for,
)
from .test_cli import _handle

pytestmark = pytest.mark.integration

HOSTS = 10


@pytest.fixture
def tree_pool(home, pool_name, monkeypatch):
    monkeypatch.setenv("MONARCH_TORCHX_TREE_MIN_HOSTS", "2")
    monkeypatch.setattr(relay, "FANOUT", 2)
    ensure_pool(PoolRequest("monarch_local", pool_name, {"hosts": HOSTS, "preload": "none"}))
    yield attach(pool_name)


def test_every_host_answers_through_the_tree_over_connections_the_relays_keep(tree_pool):
    pool = tree_pool
    before = {i: v["accepted"] for i, v, _ in pool.ask("info", range(HOSTS), timeout=10.0)}
    res = pool.ask("info", range(HOSTS), timeout=10.0)
    assert [(i, v["index"], e) for i, v, e in res] == [(i, i, None) for i in range(HOSTS)]
    # again: the client dials the heads of its 2 groups; the relays reuse the connections they kept
    assert {i: v["accepted"] - before[i] for i, v, _ in res} == {i: int(i in (0, 5)) for i in range(HOSTS)}
    # per-host arguments, several calls each
    lists = pool.ask("reserve_port", [1, 4, 7], calls={1: [{}, {}], 4: [{}], 7: []})
    assert [(i, len(v)) for i, v, _ in lists] == [(1, 2), (4, 1), (7, 0)]
    # a host's own failure comes back as the error a direct call gives
    bad = pool.ask("describe", [0, 5], timeout=10.0, no_such_argument=1)
    assert all("bad arguments for 'describe'" in str(e) for _, _, e in bad)
    # a relay's kept connection to a host that was restarted since is replaced, and the host answers
    victim = 7
    os.kill(pool.hosts[victim].pid, signal.SIGKILL)
    wait_for(lambda: LOST in [h.state for h in pool.health()], what="the host to be lost")
    torchx_run_repairs = ensure_pool(PoolRequest("monarch_local", pool.name, {}))
    assert all(err is None for _, _, err in torchx_run_repairs.ask("info", range(HOSTS), timeout=10.0))


def test_operations_that_must_not_run_twice_use_the_relays_kept_connections_too(tree_pool):
    """An operation not marked ``REPEATABLE`` (``reserve_port`` here; a launch in use) is relayed
    over kept connections too (each pinged before it carries the request)."""
    assert "reserve_port" not in relay.REPEATABLE
    pool = tree_pool
    every = {i: [{}] for i in range(HOSTS)}

    def accepted() -> dict:
        return {i: v["accepted"] for i, v, _ in pool.ask("info", range(HOSTS), timeout=10.0)}

    pool.ask("reserve_port", range(HOSTS), calls=every)
    before = accepted()
    res = pool.ask("reserve_port", range(HOSTS), calls=every)
    assert [(i, len(v), e) for i, v, e in res] == [(i, 1, None) for i in range(HOSTS)]
    # the client dialled the heads of its 2 groups twice (this and the info after it); no relay dialled
    assert {i: n - before[i] for i, n in accepted().items()} == {i: 2 * int(i in (0, 5)) for i in range(HOSTS)}


class _Peer:
    """A hand-made agent for one relay hop: it answers ``ping``, and either closes the connection
    as soon as it has a ``relay`` request (it took the request and died) or refuses both as a
    stopping agent does."""

    def __init__(self, creds, refuse: bool = False):
        import socket
        import threading

        self.creds, self.refuse = creds, refuse
        self.accepted = self.relays = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.target = relay.Target(1, "127.0.0.1", self.listener.getsockname()[1], "peer")
        threading.Thread(target=self._serve, daemon=True).start()

    def kept(self):
        from monarch_torchx import wire

        return wire.Client("127.0.0.1", self.target.port, self.creds, identity=b"peer")

    def _serve(self) -> None:
        from monarch_torchx import wire

        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            try:
                sock = wire.accept_handshake(sock, self.creds, b"peer")
                self.accepted += 1
                frames = wire.FrameReader(sock)
                while True:
                    msg = frames.recv()
                    if self.refuse:
                        wire.send_msg(sock, {"id": msg["id"], "ok": False, "error": "stopping", "kind": "RelayRefused"})
                        continue
                    if msg["op"] != "relay":
                        wire.send_msg(sock, {"id": msg["id"], "ok": True, "value": True})
                        continue
                    self.relays += 1
                    break
            except (OSError, wire.WireError):
                pass
            finally:
                sock.close()

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize("op, sent", [("launch", 1), ("describe", 2)])
def test_a_kept_connection_that_closes_under_a_request_sends_it_again_only_if_it_may_run_twice(op, sent):
    from monarch_torchx.credentials import PoolCredentials

    creds = PoolCredentials(os.urandom(32), None)
    peer = _Peer(creds)
    try:
        cache = relay.ConnectionCache()
        cache.give(peer.target, peer.kept())
        out = relay.call_group([peer.target], creds, op, {}, None, 2, 10.0, cache=cache)
        assert peer.relays == sent  # a launch went once; a describe once more, on a fresh dial
        assert not out[1]["ok"] and "no answer through host 1" in out[1]["error"]
    finally:
        peer.close()


def test_a_kept_connection_to_a_stopping_agent_carries_no_request():
    from monarch_torchx.credentials import PoolCredentials

    creds = PoolCredentials(os.urandom(32), None)
    peer = _Peer(creds, refuse=True)
    try:
        cache = relay.ConnectionCache()
        cache.give(peer.target, peer.kept())
        out = relay.call_group([peer.target], creds, "launch", {}, None, 2, 10.0, cache=cache)
        # the ping was refused: dialled afresh, the relay refused too, and its refusal is the outcome
        assert peer.accepted == 2
        assert out[1]["kind"] == relay.RelayRefused.__name__ and not out[1]["ok"]
    finally:
        peer.close()


def test_a_killed_relay_host_is_passed_over_and_named_as_lost(tree_pool):
    pool = tree_pool
    victim = 5  # the first host of the client's second group
    os.kill(pool.hosts[victim].pid, signal.SIGKILL)
    wait_for(
        lambda: (
            not os.path.exists(f"/proc/{pool.hosts[victim].pid}/status")
            or "zombie" in open(f"/proc/{pool.hosts[victim].pid}/status").read()
        ),
        what="the agent to die",
    )
    res = pool.ask("info", range(HOSTS), timeout=10.0)
    assert [i for i, _, e in res if e is None] == [i for i in range(HOSTS) if i != victim]
    err = res[victim][2]
    assert isinstance(err, HostUnreachable) and pool.loss_evidence(victim, err)
    health = pool.health()
    assert [h.state for h in health] == [LOST if h.index == victim else OK for h in health]
    assert f"host {victim} of pool" in health[victim].error


def test_a_relay_host_killed_mid_operation_is_passed_over(tree_pool):
    assert_a_relay_killed_mid_wait_is_passed_over(tree_pool, "midwait", victim=5)  # leads the client's 2nd group


def test_a_relay_host_too_busy_to_answer_in_the_dial_time_is_asked_again(tree_pool):
    import threading

    pool = tree_pool
    slow = 5  # leads the client's 2nd group: passed over after the dial time (3 s), then asked again
    pid = pool.hosts[slow].pid
    os.kill(pid, signal.SIGSTOP)
    threading.Timer(4.0, os.kill, (pid, signal.SIGCONT)).start()
    res = pool.ask("info", range(HOSTS), timeout=15.0)
    assert [(i, e) for i, _, e in res if e is not None] == []


def test_a_hung_relay_host_costs_its_group_a_bounded_wait(tree_pool):
    pool = tree_pool
    victim = 0  # the first host of the client's first group
    pid = pool.hosts[victim].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        t = time.monotonic()
        res = pool.ask("info", range(HOSTS), timeout=6.0)
        took = time.monotonic() - t
        assert [i for i, _, e in res if e is not None] == [victim]
        assert isinstance(res[victim][2], HostUnreachable)
        assert took < 6.0 + 2.0, took  # (a bound of the operation's, not a speed check)
    finally:
        os.kill(pid, signal.SIGCONT)


def test_torchx_run_status_and_stop_through_the_tree(home, pool_name, monkeypatch):
    monkeypatch.setenv("MONARCH_TORCHX_TREE_MIN_HOSTS", "2")
    torchx(home, "pool", "create", pool_name, "-cfg", f"hosts={HOSTS},preload=none")
    h = _handle(
        torchx(
            home,
            "run",
            "-s",
            "monarch_local",
            "-cfg",
            f"pool={pool_name}",
            "utils.echo",
            "--msg",
            "tree",
            "--num_replicas",
            str(HOSTS),
        )
    )
    wait_for(lambda: "SUCCEEDED" in torchx(home, "status", h).stdout, what="echo on every host")
    assert torchx(home, "log", h).stdout.count("tree") == HOSTS
    # a run on 3 hosts asks the other 7 in the same pass, with an empty request. One whose address
    # leads nowhere (its agent's process alive: nothing at hand said so) is named after the launch,
    # which stands, and left to the next run, which checks the pool first and repairs it
    nowhere = socket.socket()
    nowhere.bind(("127.0.0.1", 0))
    port = nowhere.getsockname()[1]
    nowhere.close()
    rec = Registry(home).get(pool_name)
    Registry.publish_host(rec.state_dir, replace(Registry.read_host(rec.state_dir, 7), port=port))
    Registry.write_view(rec, Registry.hosts(rec))  # as a check that found them well would have
    res = torchx(
        home,
        "run",
        "-s",
        "monarch_local",
        "-cfg",
        f"pool={pool_name}",
        "utils.echo",
        "--msg",
        "three",
        "--num_replicas",
        "3",
    )
    assert "host 7 of pool" in res.stderr and "the next run repairs it" in res.stderr, res.stderr
    assert "repairing" not in res.stderr and "again" not in res.stderr, res.stderr
    h3 = _handle(res)
    wait_for(lambda: "SUCCEEDED" in torchx(home, "status", h3).stdout, what="echo on 3 hosts")
    assert torchx(home, "log", h3).stdout.count("three") == 3
    res = torchx(
        home,
        "run",
        "-s",
        "monarch_local",
        "-cfg",
        f"pool={pool_name}",
        "utils.echo",
        "--msg",
        "four",
        "--num_replicas",
        "3",
    )
    assert "repairing" in res.stderr, res.stderr
    assert all(x.ok for x in attach(pool_name).health())
    torchx(home, "pool", "stop", pool_name)
    assert Registry(home).get(pool_name) is None


def test_actor_procs_are_spawned_through_the_tree(tree_pool):
    from monarch_torchx import attach as attach_hosts

    from .fixtures.actors import Counter

    hosts = attach_hosts(tree_pool.name)
    procs = hosts.spawn_procs(per_host={"procs": 1})
    counters = procs.spawn("c", Counter)
    assert list(counters.incr.call(2).get(timeout=60).values()) == [2] * HOSTS
    assert len(set(counters.pid.call().get(timeout=60).values())) == HOSTS
    procs.stop().get(timeout=60)


def test_a_launch_with_dead_hosts_is_all_or_nothing_through_the_tree(tree_pool):
    assert_launch_with_dead_hosts_is_all_or_nothing(tree_pool, "aon", [2, 5, 8])


SLOW_COUNT = "import time\nfor i in range(4):\n    print(i, flush=True)\n    time.sleep(0.3)"


def _relayed(pool) -> int:
    return sum(v["relayed"] for _, v, _ in pool.ask("info", range(HOSTS), timeout=10.0))


def test_torchx_log_tail_follows_every_replica_through_the_tree(tree_pool, home, monkeypatch):
    """``torchx log --tail`` of 10 replicas while they print: every line, in each replica's order,
    with TorchX's prefix, through one stream per group of the tree (fan-out 2: the client holds
    2 streams, and every agent that leads a subgroup relays it), ending when the replicas end."""
    from .test_cli import _plain

    monkeypatch.setenv("MONARCH_TORCHX_TREE_FANOUT", "2")  # the CLI's fan-out (this process's is patched)
    pool = tree_pool
    base = _relayed(pool)
    per_ask = _relayed(pool) - base  # what one relayed info adds to the counters
    h = _handle(
        torchx(
            home,
            "run",
            "-s",
            "monarch_local",
            "-cfg",
            f"pool={pool.name}",
            "utils.python",
            "--num_replicas",
            str(HOSTS),
            "-c",
            SLOW_COUNT,
        )
    )
    before = _relayed(pool)
    res = torchx(home, "log", "--tail", h, timeout=60)
    relays = _relayed(pool) - before - per_ask
    lines = _plain(res.stdout).splitlines()
    assert sorted(lines) == sorted(f"python/{k} {i}" for k in range(HOSTS) for i in range(4)), res.stdout
    for k in range(HOSTS):
        assert [ln for ln in lines if ln.startswith(f"python/{k} ")] == [f"python/{k} {i}" for i in range(4)]
    assert per_ask == 8 and relays == 2 * per_ask, (relays, per_ask)  # the CLI's describe, then the follow: same tree
    assert "SUCCEEDED" in torchx(home, "status", h).stdout
    one = torchx(home, "log", "--tail", f"{h}/python/3,7", timeout=60)
    assert sorted(_plain(one.stdout).splitlines()) == sorted(f"python/{k} {i}" for k in (3, 7) for i in range(4))
    bad = torchx(home, "log", "--tail", "--regex", "(", h, check=False)
    assert bad.returncode == 1 and "bad --regex" in bad.stderr and "Traceback" not in bad.stderr


def test_torchx_log_tail_names_a_hung_host_and_follows_the_others(tree_pool, home, monkeypatch):
    """A SIGSTOPped host that leads a subgroup: after the dial time it is named on stderr, the next
    member leads the rest, every other replica's lines are printed, and the exit status is 1."""
    from .test_cli import _plain

    monkeypatch.setenv("MONARCH_TORCHX_TREE_FANOUT", "2")
    pool = tree_pool
    victim = 8  # host 5 splits 6..9 into [6, 7] and [8, 9]: 8 leads a group of two
    h = _handle(
        torchx(
            home,
            "run",
            "-s",
            "monarch_local",
            "-cfg",
            f"pool={pool.name}",
            "utils.python",
            "--num_replicas",
            str(HOSTS),
            "-c",
            SLOW_COUNT,
        )
    )
    pid = pool.hosts[victim].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        res = torchx(home, "log", "--tail", h, timeout=60, check=False)
    finally:
        os.kill(pid, signal.SIGCONT)
    lines = _plain(res.stdout).splitlines()
    assert sorted(lines) == sorted(f"python/{k} {i}" for k in range(HOSTS) if k != victim for i in range(4)), res.stdout
    assert res.returncode == 1 and f"logs of host {victim} not followed: not reached" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_torchx_log_tail_names_the_subtree_of_a_relay_killed_mid_follow(tree_pool, home, monkeypatch):
    """Host 5 leads the client's second group and dies while its subtree still prints: the first
    group's replicas are followed to their end, every host of the second group that had not ended
    is named as lost through host 5 (not followed again: its lines would be printed twice), and
    the exit status is 1."""
    import subprocess

    from .conftest import TORCHX, cli_env
    from .test_cli import _plain

    monkeypatch.setenv("MONARCH_TORCHX_TREE_FANOUT", "2")
    pool = tree_pool
    victim = 5
    h = _handle(
        torchx(
            home,
            "run",
            "-s",
            "monarch_local",
            "-cfg",
            f"pool={pool.name}",
            "utils.python",
            "--num_replicas",
            str(HOSTS),
            "-c",
            SLOW_COUNT.replace("range(4)", "range(12)"),
        )
    )
    follow = subprocess.Popen(
        [TORCHX, "log", "--tail", h], env=cli_env(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        # a line of the second group: its stream is open through host 5 (killed before, host 6 would
        # lead the rest of the group, and they would be followed to their end: nothing lost)
        wait_for(
            lambda: int(_plain(follow.stdout.readline()).split(" ")[0].split("/")[-1] or -1) >= victim,
            what="a line of the second group",
        )
        os.kill(pool.hosts[victim].pid, signal.SIGKILL)
        out, err = follow.communicate(timeout=60)
    finally:
        follow.kill()
    lines = _plain(out).splitlines()
    for k in range(victim):  # the first group: every line after the first one read above
        assert [ln for ln in lines if ln.startswith(f"python/{k} ")][-1] == f"python/{k} 11", out
    assert follow.returncode == 1, err
    named = {int(line.split("logs of host ")[1].split()[0]) for line in err.splitlines() if "logs of host " in line}
    assert named == set(range(victim, HOSTS)) and "lost through host 5" in err, err
    assert "Traceback" not in err


def test_a_relayed_failure_keeps_its_type_for_the_run_that_decides_whether_to_check_the_pool():
    """A tunnel the client could not open to a group's first member (a pod that is gone) comes
    back through the tree as evidence of loss, not as an agent's refusal: ``apps.start`` checks
    the pool for it. An agent's own error is a refusal; a stopping agent's is not."""
    from monarch_torchx import apps, wire
    from monarch_torchx.errors import HostLost
    from monarch_torchx.pool import _outcome_error

    lost = _outcome_error("p", 3, relay.failure(HostLost("host 3 of pool 'p' is lost: pod gone", 3)).as_dict())
    assert isinstance(lost, HostLost) and lost.index == 3 and not apps._refused(lost)
    answered = _outcome_error("p", 4, relay.failure(ValueError("replica e/0 of a is already running")).as_dict())
    assert isinstance(answered, wire.RemoteError) and apps._refused(answered)
    stopping = _outcome_error("p", 5, relay.failure(relay.RelayRefused("agent 5 is shutting down")).as_dict())
    assert isinstance(stopping, wire.RemoteError) and not apps._refused(stopping)
    unreached = _outcome_error("p", 6, relay.failure(wire.ConnectFailed("refused", refused=True)).as_dict())
    assert isinstance(unreached, HostUnreachable) and not apps._refused(unreached)
