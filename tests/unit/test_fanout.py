"""Fan-out through the pool's relay tree: how targets split into groups, how outcomes travel and
merge, and the tree itself run end to end by in-process agents (``agent.relay.Relay`` on servers
of this process; no agent processes)."""

from __future__ import annotations

import asyncio
import socket
import threading
from types import SimpleNamespace

import pytest

from monarch_torchx import net
from monarch_torchx.agent import relay as agent_relay
from monarch_torchx.net import fanout  # the client's half of the tree (split, Target, call_group, ask_tree)


def targets(n: int) -> list[fanout.Target]:
    return [fanout.Target(i, "127.0.0.1", 1000 + i, f"p/{i}") for i in range(n)]


# ------------------------------------------------------------------ pure parts


@pytest.mark.parametrize("n", range(0, 23))
@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_targets_split_into_at_most_fanout_contiguous_groups_of_near_equal_size(n, k):
    ts = targets(n)
    groups = fanout.split(ts, k)
    assert [t for g in groups for t in g] == ts  # every target once, in order
    assert len(groups) == min(k, n) and all(groups)
    sizes = [len(g) for g in groups]
    assert max(sizes, default=0) - min(sizes, default=0) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the larger groups first


def test_a_split_by_nothing_is_no_groups():
    assert fanout.split(targets(5), 0) == [] and fanout.split([], 8) == []


def test_a_target_travels_as_a_dict_and_keys_a_cache():
    t = fanout.Target(3, "10.0.0.3", 4000, "p/3/inc")
    assert fanout.Target(**t.as_dict()) == t and {t: 1}[fanout.Target(3, "10.0.0.3", 4000, "p/3/inc")] == 1


def test_a_failure_says_what_kind_it_was_and_whether_nothing_listened():
    refused = fanout.failure(net.ConnectFailed("cannot reach h:1: Connection refused", refused=True))
    assert (refused.ok, refused.kind, refused.refused) == (False, "ConnectFailed", True)
    timed_out = fanout.failure(net.PeerTimeout("slow"), via=4)
    assert (timed_out.kind, timed_out.refused, timed_out.via) == ("PeerTimeout", False, 4)
    passed_on = fanout.failure(net.RemoteError("bad arguments", "TypeError"))
    assert passed_on.kind == "TypeError"  # a peer's error keeps the type it had there
    assert fanout.failure(KeyError()).error == "KeyError"  # never an empty reason


def test_an_outcome_travels_shallow():
    value = {"big": list(range(1000))}
    assert fanout.Outcome(True, value).as_dict()["value"] is value  # not copied at every level of the tree


def test_only_a_closed_connection_counts_as_the_peer_gone_not_a_timeout():
    assert fanout._closed(net.PeerClosed("x")) and fanout._closed(net.ProofRejected("x"))
    assert fanout._closed(ConnectionResetError(104, "reset"))
    assert not fanout._closed(net.PeerTimeout("x")) and not fanout._closed(net.ConnectFailed("x"))


def ok(value, **kw) -> dict:
    return fanout.Outcome(True, value, **kw).as_dict()


def test_a_subtrees_values_are_combined_into_its_lowest_answering_host():
    out = {
        4: ok(4),
        2: ok(2),
        7: fanout.Outcome(False, error="gone", kind="PeerClosed").as_dict(),
        5: ok(None),  # nothing to combine
        6: ok(6),
        9: ok(None, merged_into=6),  # merged below, into a host of this subtree
    }
    got = agent_relay.combined(out, lambda args, values: {"sum": sum(values), "args": args}, {"q": 1})
    assert got[2] == ok({"sum": 12, "args": {"q": 1}})
    assert [got[i]["merged_into"] for i in (4, 6, 9)] == [2, 2, 2]
    assert got[7] == out[7] and got[5] == out[5]  # failures and empty answers as they were
    assert out[4] == ok(4)  # the input is left alone


def test_nothing_is_combined_below_two_answers_or_when_combining_fails(caplog):
    one = {1: ok(1), 2: fanout.Outcome(False, error="x").as_dict()}
    assert agent_relay.combined(one, lambda a, v: 1 / 0, {}) is one
    two = {1: ok(1), 2: ok(2)}
    assert agent_relay.combined(two, lambda a, v: 1 / 0, {}) == two  # the values travel as they came
    assert "combining 2 answers failed" in caplog.text


class FakeClient:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_kept_connections_are_reused_newest_first_expire_and_are_capped_per_peer(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(fanout, "time", SimpleNamespace(monotonic=lambda: now[0]))
    cache = fanout.ConnectionCache()
    peer, other = targets(2)
    kept = [FakeClient() for _ in range(cache.PER_PEER + 1)]
    for c in kept:
        cache.give(peer, c)
    assert kept[0].closed and not any(c.closed for c in kept[1:])  # past the cap: the oldest goes
    assert cache.take(peer) is kept[-1] and cache.take(other) is None
    now[0] += cache.IDLE_S
    assert cache.take(peer) is None and all(c.closed for c in kept[:-1])  # idle too long: closed, not used
    cache.give(peer, kept[-1])
    cache.close()
    assert kept[-1].closed and cache.take(peer) is None


# ------------------------------------------------------------------ the tree, run by in-process agents


class FakeAgent:
    """What ``Relay`` uses of its agent: index, credentials, handlers, combiners, stopping."""

    def __init__(self, index: int, creds) -> None:
        self.index, self.creds = index, creds
        self.stopping = threading.Event()
        self.stop_reason = "idle"
        self.touched: list[str] = []
        self.combiners: dict = {"total": lambda args, values: sum(values)}
        self.relay = agent_relay.Relay(self)
        self.handlers = {"relay": self.relay.op_relay, "ping": self.ping, "info": self.info, "total": self.info}
        self.handlers.update({"fails": self.fails, "stalls": self.stalls, "add": self.add})

    def touch(self, op: str, work: bool = True) -> None:
        self.touched.append(op)

    async def ping(self, peer):
        if self.stopping.is_set():
            raise fanout.RelayRefused("stopping")
        return True

    async def info(self, peer):
        return self.index

    async def add(self, peer, x):
        return self.index * 100 + x

    async def fails(self, peer):
        if self.index == 3:
            raise ValueError("replica r/3 is already running")
        return "ok"

    async def stalls(self, peer):
        await asyncio.Event().wait()


@pytest.fixture
def tree(loop_thread, creds):
    """Makes ``n`` in-process agents; returns (their targets, the agents)."""
    made: list[FakeAgent] = []

    def make(n: int) -> tuple[list[fanout.Target], list[FakeAgent]]:
        ts = []
        for i in range(n):
            agent = FakeAgent(i, creds)
            made.append(agent)
            port = loop_thread.serve(creds, agent.handlers, identity=f"p/{i}".encode())
            ts.append(fanout.Target(i, "127.0.0.1", port, f"p/{i}"))
        return ts, made

    yield make
    for agent in made:
        agent.relay.close()


def values(out: dict) -> dict:
    return {i: (o["value"] if o["ok"] else o["kind"]) for i, o in sorted(out.items())}


def test_every_host_answers_through_the_tree_and_each_relay_passes_on_its_groups(tree, creds):
    ts, agents = tree(7)
    out = fanout.ask_tree(ts, creds, "info", fanout=2, timeout=5)
    assert values(out) == {i: i for i in range(7)}
    # the client asks [0-3] and [4-6]; 0 passes on [1, 2] and [3], 1 passes on [2], 4 passes on [5] and [6]
    assert [a.relay.relayed for a in agents] == [2, 1, 0, 0, 2, 0, 0]
    assert all(a.touched == ["info"] for a in agents)
    assert all(o.get("via") is None for o in out.values())


def test_per_host_calls_run_in_turn_and_a_hosts_own_failure_is_its_outcome_only(tree, creds):
    ts, _ = tree(5)
    out = fanout.ask_tree(ts, creds, "add", calls={1: [{"x": 1}, {"x": 2}], 3: [], 4: [{"x": 7}]}, fanout=2)
    assert values(out)[1] == [101, 102] and values(out)[3] == [] and values(out)[4] == [407]
    failed = fanout.ask_tree(ts, creds, "fails", fanout=2)
    assert values(failed) == {0: "ok", 1: "ok", 2: "ok", 3: "ValueError", 4: "ok"}
    assert "already running" in failed[3]["error"]


def test_a_relayed_op_the_agents_combine_comes_back_merged_into_the_lowest_host(tree, creds):
    ts, _ = tree(6)
    out = fanout.ask_tree(ts, creds, "total", fanout=2)
    carriers = {i: o["value"] for i, o in out.items() if o.get("merged_into") is None}
    assert sum(carriers.values()) == sum(range(6)) and set(carriers) < set(range(6))  # combined on the way
    assert all(out[o["merged_into"]]["merged_into"] is None for o in out.values() if o.get("merged_into") is not None)


def test_a_group_whose_first_member_is_unreachable_is_led_by_the_next(tree, creds):
    ts, agents = tree(6)
    with socket.socket() as s:  # a port nothing listens on: the dead first member of the 2nd group
        s.bind(("127.0.0.1", 0))
        ts[3] = fanout.Target(3, "127.0.0.1", s.getsockname()[1], "p/3")
        out = fanout.ask_tree(ts, creds, "info", fanout=2, timeout=5)
    assert values(out) == {0: 0, 1: 1, 2: 2, 3: "ConnectFailed", 4: 4, 5: 5}
    assert out[3]["refused"] and agents[4].relay.relayed == 1  # 4 led the rest of 3's group: [5]


def test_a_stopping_agent_refuses_to_relay_and_the_next_member_leads_its_group(tree, creds):
    ts, agents = tree(4)
    agents[0].stopping.set()
    out = fanout.call_group(ts, creds, "info", None, None, 2, 5.0)
    assert values(out) == {0: "RelayRefused", 1: 1, 2: 2, 3: 3} and "shutting down" in out[0]["error"]
    assert agents[0].touched == [] and agents[1].relay.relayed == 2  # nothing ran on 0; 1 led [2] and [3]


def test_a_relay_that_does_not_answer_in_time_reports_its_subtree_as_not_answered(tree, creds):
    ts, _ = tree(3)
    out = fanout.call_group(ts, creds, "stalls", None, None, 2, 0.3)
    assert all(not o["ok"] and o["via"] == 0 and "no answer through host 0" in o["error"] for o in out.values())
    assert sorted(out) == [0, 1, 2]


def test_a_kept_connection_carries_the_next_request_and_one_that_closed_since_is_dialled_afresh(tree, creds):
    ts, agents = tree(2)
    cache = fanout.ConnectionCache()
    try:
        assert values(fanout.call_group(ts[:1], creds, "info", None, None, 2, 5.0, cache=cache)) == {0: 0}
        kept = cache.take(ts[0])
        assert kept is not None
        cache.give(ts[0], kept)
        assert values(fanout.call_group(ts[:1], creds, "info", None, None, 2, 5.0, cache=cache)) == {0: 0}
        assert cache.take(ts[0]) is kept  # the same connection carried it (pinged first)
        kept.abort()  # the connection ended since (as a restarted peer's does): a fresh dial, the request sent once
        cache.give(ts[0], kept)
        assert values(fanout.call_group(ts[:1], creds, "info", None, None, 2, 5.0, cache=cache)) == {0: 0}
        assert agents[0].touched == ["info"] * 3
        fresh = cache.take(ts[0])  # (the fresh connection was kept in its place)
        assert fresh is not None and fresh is not kept
        fresh.close()
    finally:
        cache.close()
