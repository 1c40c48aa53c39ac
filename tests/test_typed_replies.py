"""Replies and errors between our processes are named types: a peer's error comes back as the
local class of its type, an agent's replica status as a ``ReplicaStatus`` with an enum state, an
actor's failure as an ``ActorFailure``, the fork server's messages as dataclasses. No pool: a real
request server on loopback in this process, and the records themselves."""

from __future__ import annotations

import asyncio
import json
import os
import threading

import pytest

from monarch_torchx import history, net
from monarch_torchx.actor.errors import (
    ActorAborted,
    ActorError,
    ActorFailure,
    FailureKind,
    MalformedActorFailure,
    SupervisionError,
)
from monarch_torchx.actor.errors import remote_error as actor_error
from monarch_torchx.agent.forkserver_messages import Ready, Start, StartMode
from monarch_torchx.credentials import PoolCredentials
from monarch_torchx.net import aio
from monarch_torchx.net.fanout import RelayRefused, failure
from monarch_torchx.specs import ReplicaState, ReplicaStatus


@pytest.fixture
def agent_like():
    """A request server with handlers that raise what agents raise, on its own loop thread."""

    async def stopping(peer):
        raise RelayRefused("agent 3 is shutting down (idle)")

    async def bad(peer, x):
        raise ValueError(f"not a good x: {x}")

    async def forwards(peer):  # an error heard from another peer, passed on: keeps its kind
        raise net.remote_error("that one refused", "RelayRefused")

    creds = PoolCredentials(os.urandom(32), None)
    loop = asyncio.new_event_loop()
    srv = aio.Server(creds, {"stopping": stopping, "bad": bad, "forwards": forwards})
    port = loop.run_until_complete(srv.start("127.0.0.1", 0))
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    yield creds, port
    asyncio.run_coroutine_threadsafe(srv.close(), loop).result(5)
    loop.call_soon_threadsafe(loop.stop)
    t.join(5)
    loop.close()


def test_a_peers_error_comes_back_as_its_local_type_or_says_what_it_was(agent_like):
    creds, port = agent_like
    with net.Client("127.0.0.1", port, creds, timeout=5.0) as c:
        with pytest.raises(RelayRefused, match="shutting down"):
            c.call("stopping")
        with pytest.raises(RelayRefused, match="that one refused"):
            c.call("forwards")
        with pytest.raises(net.UnknownOperation):
            c.call("no_such_op")
        with pytest.raises(net.RemoteError) as bad:
            c.call("bad", x=1)
        assert bad.value.raised(ValueError) and not bad.value.raised(TypeError)
        assert not isinstance(bad.value, RelayRefused)
        with pytest.raises(net.RemoteError) as wrong:
            c.call("bad", y=1)  # a wrong argument: the handler's signature refused it
        assert wrong.value.raised(TypeError)


def test_an_outcome_through_the_tree_rebuilds_the_same_types():
    from monarch_torchx.pool import _outcome_error

    assert isinstance(_outcome_error("p", 5, failure(RelayRefused("stopping")).as_dict()), RelayRefused)
    assert isinstance(_outcome_error("p", 5, failure(net.UnknownOperation("x")).as_dict()), net.UnknownOperation)
    err = _outcome_error("p", 5, failure(KeyError("k")).as_dict())
    assert type(err) is net.RemoteError and err.raised(KeyError)


def test_replica_status_reads_an_agents_answer_and_compares_as_its_wire_string():
    wire_form = {
        "app_id": "a",
        "role": "r",
        "replica_id": 0,
        "state": "FAILED",
        "exit_code": 3,
        "msg": "exited with code 3",
        "attempts": 2,
        "field_of_a_newer_agent": 1,
    }
    st = ReplicaStatus.from_wire(wire_form, hostname="node1")
    assert st.state is ReplicaState.FAILED and st.state == "FAILED" and st.state.terminal
    assert (st.exit_code, st.attempts, st.hostname, st.final) == (3, 2, "node1", True)
    assert st.failed_for_good
    assert json.dumps(st.state) == '"FAILED"'  # a recorded end stays a plain string on disk
    with pytest.raises(ValueError):
        ReplicaStatus.from_wire({**wire_form, "state": "EXPLODED"})


def test_a_recorded_end_reads_back_as_the_status_it_was_made_from(tmp_path):
    st = ReplicaStatus(ReplicaState.SUCCEEDED, msg="", exit_code=0, attempts=1, started=1.0, ended=2.0, hostname="h")
    history.record_end(tmp_path, history.ReplicaEnd.from_status("app", "r", 0, st))
    back = history.read_ends(tmp_path, "app")[("r", 0)].status()
    assert (back.state, back.exit_code, back.hostname, back.recorded) == (ReplicaState.SUCCEEDED, 0, "h", True)


@pytest.mark.parametrize(
    ("kind", "raised"),
    [
        (FailureKind.ACTOR, ActorError),
        (FailureKind.SUPERVISION, SupervisionError),
        (FailureKind.ABORTED, ActorAborted),
        (FailureKind.USAGE, ValueError),
    ],
)
def test_an_actor_failure_becomes_the_exception_monarch_names(kind, raised):
    err = actor_error(ActorFailure(kind, "it broke", "Traceback ...", "KeyError"))
    assert type(err) is raised and err.args[0] == "it broke"
    if isinstance(err, ActorError):  # the remote traceback and type travel as fields, not in the text
        assert (err.traceback, err.exception_type) == ("Traceback ...", "KeyError")


def test_an_actor_failure_that_is_not_one_is_named_malformed():
    err = actor_error(("actor", "a 4-tuple of an older proc", "", ""))
    assert isinstance(err, MalformedActorFailure) and isinstance(err, ActorError)


def test_fork_server_messages_travel_as_themselves():
    for msg in (Start(7, StartMode.EXEC, ["true"], {"PATH": "/bin"}, cwd="/"), Ready(["torch"], {}, 1.5)):
        ((body, bufs),) = _frames(net.encode(msg))
        assert net.decode(body, bufs) == msg


def _frames(parts):
    parser = net.FrameParser()
    frame = b"".join(bytes(p) for p in parts)
    buf = parser.get_buffer()
    buf[: len(frame)] = frame
    return parser.feed(len(frame))


def test_what_moved_off_the_pool_handle_says_where_it_went():
    from monarch_torchx.pool import Pool

    pool = Pool.__new__(Pool)  # (no pool needed: the handle's own attribute lookup)
    with pytest.raises(AttributeError, match=r"Pool.sql\(\) moved: use monarch_torchx.telemetry.sql\(pool, query\)"):
        pool.sql("SELECT 1")
    with pytest.raises(AttributeError, match=r"monarch_torchx.syncfs.sync\(pool, src, target\)"):
        pool.sync(".", "work")
