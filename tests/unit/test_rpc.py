"""The blocking ``net.Client`` against the asyncio request server (``net.aio.Server``) of this very
process: replies, streams, the errors a handler raises as the caller's types, timeouts."""

from __future__ import annotations

import asyncio
import pickle
import threading

import pytest

from monarch_torchx import net
from monarch_torchx.net import aio
from monarch_torchx.net import fanout as fanout_mod

ID = b"pool/0/inc-1"


@pytest.fixture
def served(loop_thread, creds):
    """An in-process server; yields (port, what it saw: ops in order, a stream's end)."""
    seen: dict = {"ops": [], "stream_closed": threading.Event()}

    async def echo(peer, value):
        return value

    async def whoami(peer):
        return peer.addr

    async def fails(peer, kind):
        raise {"value": ValueError("no such replica r/3"), "lookup": KeyError("app-1")}[kind]

    async def stopping(peer):
        raise fanout_mod.RelayRefused("agent 0 is shutting down (idle)")

    async def needs(peer, a, b=2):
        return a + b

    async def count(peer, n):
        async def items():
            try:
                for i in range(n):
                    yield i
            finally:
                seen["stream_closed"].set()

        return aio.Stream(items())

    async def stalls(peer):
        await asyncio.Event().wait()  # never answers (cancelled when the connection goes)

    async def unsendable(peer):
        return threading.Lock()

    handlers = {f.__name__: f for f in (echo, whoami, fails, stopping, needs, count, stalls, unsendable)}
    port = loop_thread.serve(creds, handlers, identity=ID, on_activity=seen["ops"].append)
    return port, seen


def client(creds, port, **kw) -> net.Client:
    return net.Client("127.0.0.1", port, creds, identity=ID, **kw)


def test_a_call_returns_the_handlers_value_and_the_server_saw_each_op_in_order(served, creds):
    port, seen = served
    with client(creds, port) as c:
        assert c.call("echo", value={"x": [1, 2], "y": None}) == {"x": [1, 2], "y": None}
        back = c.call("echo", value=pickle.PickleBuffer(bytearray(b"z" * 100_000)))  # out of band both ways
        assert bytes(back) == b"z" * 100_000
        assert c.call("needs", a=1) == 3 and c.call("needs", a=1, b=5) == 6
        host, port_seen = c.call("whoami").rsplit(":", 1)
        assert (host, int(port_seen)) == c._sock.getsockname()  # the handler knows who calls
    assert seen["ops"] == ["echo", "echo", "needs", "needs", "whoami"]


def test_a_handlers_error_comes_back_as_a_remote_error_naming_its_type(served, creds):
    port, _ = served
    with client(creds, port) as c:
        with pytest.raises(net.RemoteError, match="no such replica r/3") as e:
            c.call("fails", kind="value")
        assert e.value.raised(ValueError) and not e.value.raised(KeyError)
        with pytest.raises(net.RemoteError) as e:
            c.call("fails", kind="lookup")
        assert e.value.raised(KeyError)
        with pytest.raises(fanout_mod.RelayRefused, match="shutting down"):  # a type both ends know: its own
            c.call("stopping")
        with pytest.raises(net.UnknownOperation, match="'nope'"):
            c.call("nope")
        with pytest.raises(net.RemoteError, match="bad arguments for 'needs'") as e:
            c.call("needs", b=1)
        assert e.value.raised(TypeError)
        with pytest.raises(net.RemoteError, match="cannot be sent"):  # a value that does not pickle
            c.call("unsendable")
        assert c.call("echo", value="still in step") == "still in step"  # the connection carries on


def test_a_stream_yields_its_items_then_ends_and_closing_it_early_cancels_the_producer(served, creds):
    port, seen = served
    with client(creds, port) as c:
        assert list(c.stream("count", n=5)) == [0, 1, 2, 3, 4]
        assert seen["stream_closed"].wait(2)
    seen["stream_closed"].clear()
    c = client(creds, port)
    items = c.stream("count", n=10**9)
    assert [next(items), next(items)] == [0, 1]
    items.close()  # cancels it at the server, and this connection with it (its replies are out of step)
    assert seen["stream_closed"].wait(2)
    with pytest.raises(net.PeerClosed):
        c.call("echo", value=1)


def test_no_answer_within_the_timeout_is_peer_timeout_and_the_connection_is_not_reused(served, creds):
    port, _ = served
    c = client(creds, port, timeout=0.1)
    with pytest.raises(net.PeerTimeout, match="timed out on 'stalls'"):
        c.call("stalls")
    with pytest.raises(net.PeerClosed):  # closed: a late reply would answer the next call
        c.call("echo", value=1)
    with client(creds, port) as again:
        assert again.call("echo", value=2) == 2


@pytest.mark.parametrize("what", ["secret", "identity"])
def test_a_client_with_another_secret_or_meaning_another_agent_is_refused(served, creds, what):
    from monarch_torchx.credentials import PoolCredentials

    port, seen = served
    other = PoolCredentials(b"\x00" * 32) if what == "secret" else creds
    with pytest.raises(net.ProofRejected):
        net.Client("127.0.0.1", port, other, identity=ID if what == "secret" else b"pool/1/inc-1", timeout=2)
    assert seen["ops"] == []  # nothing it sent was read as a request
