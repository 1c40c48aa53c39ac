"""Routing in the actor runtime without procs: a controller's ``Hub`` talking to a stand-in proc on
the other end of a socketpair (answers to the futures that wait for them, port messages to their
receivers, supervision events to the hook, a lost connection to everything that waited on it),
the message headers, and how a large multicast is cut into a tree of procs."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from monarch_torchx import net
from monarch_torchx.actor import hub as hub_mod
from monarch_torchx.actor import mesh, messages
from monarch_torchx.actor.errors import ActorError, MeshFailure, ProcStopped, SupervisionError, error_payload
from monarch_torchx.actor.future import Future
from monarch_torchx.credentials import PoolCredentials

ADDR = hub_mod.ProcAddr("10.0.0.5", 4100, "p/proc/0")


class Proc:
    """The proc's end of the connection: reads what the hub sent, answers as a proc does."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.settimeout(2)
        self.parser = net.FrameParser()
        self.frames: list = []

    def read(self, expected=messages.TO_PROC) -> tuple:
        while not self.frames:
            view = self.parser.get_buffer()
            n = self.sock.recv_into(view)
            assert n, "the hub closed the connection"
            self.frames += self.parser.feed(n)
        body, bufs = self.frames.pop(0)
        header = messages.decode(body, expected)
        return header, (hub_mod.unpack(bufs) if bufs else None)

    def send(self, header, payload=None) -> None:
        self.sock.sendall(b"".join(bytes(memoryview(p).cast("B")) for p in hub_mod.encode(header, payload)))


@pytest.fixture
def hub(monkeypatch):
    """A hub whose dial to ADDR is a socketpair (yields the hub and the proc's end); no idle reader:
    the thread that waits on a future reads, as a controller's caller does."""
    h = hub_mod.Hub(PoolCredentials(os.urandom(32)), "p")
    ours, theirs = socket.socketpair()
    dials: list = []

    def dial(hub, addr):
        dials.append(addr)
        ours.setblocking(False)
        return ours

    monkeypatch.setattr(hub_mod.Conn, "open", staticmethod(dial))
    monkeypatch.setattr(h, "_start_idle_reader", lambda: None)
    h.dials = dials
    yield h, Proc(theirs)
    theirs.close()
    ours.close()
    h.sel.close()
    os.close(h._wake_r)
    os.close(h._wake_w)


def call(h, endpoint: str, *args) -> tuple[int, Future]:
    """Sends a Call as a mesh's endpoint does; returns its request id and future."""
    fut: Future = Future(h)
    rid = h.next_id()
    header = messages.Call(rid, h.sender, h.next_seq(ADDR), "actor-1", endpoint)
    h.conn(ADDR).send(hub_mod.encode(header, (args, {})), rid, fut)
    return rid, fut


def test_a_call_reaches_the_proc_and_its_answer_completes_the_future_that_waits(hub):
    h, proc = hub
    rid, fut = call(h, "add", 1, 2)
    header, payload = proc.read()
    assert type(header) is messages.Call and header.rid == rid and header.seq == 0
    assert (header.sender, header.actor_id, header.endpoint, payload) == (h.sender, "actor-1", "add", ((1, 2), {}))
    proc.send(messages.Answer(rid, True), 3)
    assert fut.get(timeout=2) == 3  # read by this (waiting) thread: no reader thread
    assert h.dials == [ADDR]  # one connection per proc, reused
    call(h, "add", 0, 0)
    assert proc.read()[0].seq == 1 and h.dials == [ADDR]


def test_answers_find_their_own_future_in_any_order_and_an_error_keeps_its_kind(hub):
    h, proc = hub
    (r1, f1), (r2, f2), (r3, f3) = call(h, "a"), call(h, "b"), call(h, "c")
    proc.send(
        messages.Answer(r3, False),
        error_payload("actor", "ZeroDivisionError: division by zero", "tb", "ZeroDivisionError"),
    )
    proc.send(messages.Answer(r1, True), "one")
    proc.send(messages.Answer(r2, False), error_payload("supervision", "the actor has failed"))
    assert f1.get(timeout=2) == "one"
    with pytest.raises(SupervisionError, match="the actor has failed"):
        f2.get(timeout=2)
    with pytest.raises(ActorError) as e:
        f3.get(timeout=2)
    assert e.value.exception_type == "ZeroDivisionError" and e.value.traceback == "tb"
    proc.send(messages.Answer(r1, True), "late")  # an answer nobody waits for (any more) is dropped
    r4, f4 = call(h, "d")
    proc.send(messages.Answer(r4, True), "four")
    assert f4.get(timeout=2) == "four" and f1.get() == "one"


def test_a_port_message_goes_to_its_receiver_and_one_for_a_closed_port_is_dropped(hub):
    h, proc = hub
    got: list = []
    h.ports["port-1"] = got.append
    rid, fut = call(h, "open")
    proc.send(messages.PortValue("port-1"), {"step": 1})
    proc.send(messages.PortValue("port-gone"), "nobody")
    proc.send(messages.PortValue("port-1"), {"step": 2})
    proc.send(messages.Answer(rid, True), None)
    assert fut.get(timeout=2) is None
    assert got == [{"step": 1}, {"step": 2}]  # in the order sent, before the answer that followed them


def test_a_supervision_event_goes_to_the_fault_hook(hub, faults):
    h, proc = hub
    rid, fut = call(h, "spawn")
    failure = MeshFailure("mesh-1", 2, 0, "node0", "exited with code 3", exit_code=3)
    proc.send(messages.Fault(""), vars(failure))
    proc.send(messages.Answer(rid, True), "spawned")
    assert fut.get(timeout=2) == "spawned"
    assert faults == [failure]


def test_a_lost_connection_fails_what_waits_on_it_says_why_and_is_remembered(hub):
    h, proc = hub
    h.explain[ADDR] = lambda: "proc p/proc/0 on host 0 exited with code -9 (SIGKILL)"
    _, f1 = call(h, "a")
    _, f2 = call(h, "b")
    proc.sock.close()
    for f in (f1, f2):
        with pytest.raises(SupervisionError, match="exited with code -9"):
            f.get(timeout=2)
    with pytest.raises(SupervisionError, match="exited with code -9"):  # no new dial to a lost proc
        h.conn(ADDR)
    assert h.dials == [ADDR] and ADDR in h.dead


def test_a_malformed_message_from_a_proc_ends_its_connection(hub):
    h, proc = hub
    _, fut = call(h, "a")
    proc.send(messages.Call(1, None, None, "x", "y"))  # a request, where only answers may come
    with pytest.raises(SupervisionError, match="unexpected message Call"):
        fut.get(timeout=2)


def test_a_proc_stopped_on_purpose_fails_its_callers_as_stopped_and_its_owner_is_not_told(hub):
    h, proc = hub
    lost = threading.Event()
    h.watch(ADDR, lambda addr: lost.set())
    assert type(proc.read()[0]) is messages.Own  # the connection that owns it
    h.closing[ADDR] = ProcStopped("proc p/proc/0 was stopped")
    h.unwatch_all([ADDR])
    _, fut = call(h, "a")
    proc.sock.close()
    with pytest.raises(ProcStopped):
        fut.get(timeout=2)
    assert not lost.is_set()


def test_the_owner_of_a_proc_is_told_when_its_connection_breaks(hub):
    h, proc = hub
    lost = threading.Event()
    told: list = []
    h.watch(ADDR, lambda addr: (told.append(addr), lost.set()))
    assert type(proc.read()[0]) is messages.Own
    proc.sock.close()
    assert h.wait(lambda: ADDR in h.dead, time.monotonic() + 2)  # (no call waits: this thread reads)
    assert lost.wait(2) and told == [ADDR]  # on the supervision thread, not the one that read


def test_sequence_numbers_count_per_proc():
    h = hub_mod.Hub(PoolCredentials(os.urandom(32)), "p")
    try:
        other = ADDR._replace(port=4101)
        assert [h.next_seq(ADDR), h.next_seq(ADDR), h.next_seq(other), h.next_seq(ADDR)] == [0, 1, 0, 2]
    finally:
        h.sel.close()
        os.close(h._wake_r)
        os.close(h._wake_w)


# ------------------------------------------------------------------ the headers


def test_headers_round_trip_and_a_receiver_takes_only_its_own_kinds():
    spawn = messages.Spawn(1, "s", 0, "a", "n", (0, 1), ("hosts", "gpus"), (2, 2), "o", None, None)
    for header in (messages.Call(1, "s", 0, "a", "e"), messages.Answer(5, False), messages.Own(), spawn):
        assert messages.decode(messages.dumps(header), messages.TO_PROC + messages.TO_CALLER) == header
    with pytest.raises(net.MalformedFrame, match="unexpected message Answer"):
        messages.decode(messages.dumps(messages.Answer(1, True)), messages.TO_PROC)
    with pytest.raises(net.MalformedFrame, match="unexpected message tuple"):  # same fields, not the type
        messages.decode(messages.dumps((1, True)), messages.TO_CALLER)
    with pytest.raises(net.MalformedFrame, match="malformed message"):
        messages.decode(b"\x00garbage", messages.TO_CALLER)


# ------------------------------------------------------------------ the multicast tree


def refs(n: int) -> list[mesh.ProcRef]:
    return [
        mesh.ProcRef(hub_mod.ProcAddr("10.0.0.1", 5000 + r, f"p/{r}"), "m", r, r // 4, f"h{r // 4}", None)
        for r in range(n)
    ]


@pytest.mark.parametrize("n, fanout", [(1, 2), (2, 2), (9, 3), (37, 8), (100, 4)])
def test_a_multicast_tree_reaches_every_proc_once_within_fanout_per_level(monkeypatch, n, fanout):
    monkeypatch.setattr(mesh, "FANOUT", fanout)
    members = refs(n)
    tree = mesh._tree(members)

    def check(level: list, depth: int) -> int:
        assert 1 <= len(level) <= fanout
        return max((check(sub, depth + 1) for _, sub in level if sub), default=depth)

    assert mesh._flatten(tree) == members  # each once, in rank order
    depth = check(tree, 1)
    # logarithmic: no deeper than the fewest levels of ``fanout`` that hold n
    assert depth == 1 or fanout ** (depth - 1) < n
    links = mesh._links(tree)
    assert sum(len(v) for v in links.values()) + len(tree) == n  # each proc is sent to exactly once
    for ref, sub in tree:
        assert links.get(ref.rank, ()) == tuple(tuple(c.addr) for c, _ in sub)
    wire = mesh._wire_tree(tree)
    assert [(rank, addr) for rank, addr, _ in wire] == [(r.rank, tuple(r.addr)) for r, _ in tree]


def test_a_subtrees_answers_complete_each_ranks_future_and_its_failure_fails_them_all():
    per_rank = {r: Future() for r in range(4)}
    sub: Future = Future()
    sub.set_result([(0, True, "a"), (2, False, error_payload("actor", "boom")), (3, True, None)])
    mesh._fan_in(per_rank, [0, 2, 3], sub)
    assert per_rank[0].get(0) == "a" and per_rank[3].get(0) is None and not per_rank[1].done()
    with pytest.raises(ActorError, match="boom"):
        per_rank[2].get(0)
    lost = {r: Future() for r in range(2)}
    gone: Future = Future()
    gone.set_exception(SupervisionError("the subtree's head is lost"))
    mesh._fan_in(lost, [0, 1], gone)
    for f in lost.values():
        with pytest.raises(SupervisionError, match="head is lost"):
            f.get(0)
