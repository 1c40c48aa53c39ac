"""The wire protocol against a real asyncio server on loopback: auth, framing, streams, faults."""

from __future__ import annotations

import asyncio
import os
import pickle
import socket
import struct
import threading
import time
from pathlib import Path

import pytest

from monarch_torchx import wire
from monarch_torchx.credentials import PoolCredentials, new_tls_pem
from monarch_torchx.net import handshake


def _tls_file(path: Path, pool: str = "t") -> str:
    path.write_text(new_tls_pem(pool))
    path.chmod(0o600)
    return str(path)


@pytest.fixture(params=["plain", "tls"])
def creds(request, tmp_path):
    """A pool's credentials: loopback pools send plaintext frames, pools across machines TLS."""
    key = os.urandom(32)
    return PoolCredentials(key, _tls_file(tmp_path / "tls.pem") if request.param == "tls" else None)


def _raw(creds: PoolCredentials, port: int) -> socket.socket:
    """A hand-driven connection: TLS with the pool's certificate where the pool uses it."""
    s = socket.create_connection(("127.0.0.1", port))
    return creds.client_context.wrap_socket(s) if creds.tls else s


class _Pwn:
    """Unpickling this creates a file: proof that a frame was (or was not) unpickled."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


@pytest.fixture
def server(creds):
    key = creds
    cancelled = threading.Event()

    async def echo(peer, value):
        return value

    async def boom(peer):
        raise ValueError("it broke")

    async def count(peer, n):
        async def items():
            try:
                for i in range(n):
                    yield i
                    await asyncio.sleep(0)
            finally:
                if n > 1000:
                    cancelled.set()

        return wire.Stream(items())

    loop = asyncio.new_event_loop()

    async def unsendable(peer):
        return threading.Lock()

    async def as_bytes(peer, values):
        return [bytes(v) for v in values]

    async def gathered(peer):
        return wire.Gathered([b"only the blocking transport sends these"])

    srv = wire.Server(
        key,
        {
            "echo": echo,
            "boom": boom,
            "count": count,
            "unsendable": unsendable,
            "as_bytes": as_bytes,
            "gathered": gathered,
        },
    )
    port = loop.run_until_complete(srv.start("127.0.0.1", 0))
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    yield key, port, cancelled

    async def shutdown():
        await srv.close()
        tasks = [x for x in asyncio.all_tasks() if x is not asyncio.current_task()]
        for x in tasks:
            x.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run_coroutine_threadsafe(shutdown(), loop).result(5)
    loop.call_soon_threadsafe(loop.stop)
    t.join(5)
    loop.close()


def test_call_stream_and_remote_error(server):
    key, port, _ = server
    with wire.Client("127.0.0.1", port, key) as c:
        assert c.call("echo", value={"a": [1, 2]}) == {"a": [1, 2]}
        assert list(c.stream("count", n=5)) == [0, 1, 2, 3, 4]
        with pytest.raises(wire.RemoteError, match="it broke"):
            c.call("boom")
        with pytest.raises(wire.RemoteError, match="unknown operation"):
            c.call("nope")
        with pytest.raises(wire.RemoteError, match="bad arguments"):
            c.call("echo", wrong=1)
        with pytest.raises(wire.RemoteError, match="result of 'unsendable' cannot be sent"):
            c.call("unsendable")  # answered, not left waiting
        assert c.call("echo", value=3) == 3  # still usable after errors


def test_out_of_band_buffers_roundtrip(server):
    key, port, _ = server
    data = bytearray(os.urandom(8 << 20))
    with wire.Client("127.0.0.1", port, key) as c:
        back = c.call("echo", value=pickle.PickleBuffer(data))
    assert bytes(back) == bytes(data)
    parts = wire.encode({"x": pickle.PickleBuffer(data)})
    assert len(parts) == 3 and memoryview(parts[2]).nbytes == len(data)  # sent from its own memory


def test_a_gathered_buffer_of_bytes_and_file_regions_arrives_as_one_buffer(server, tmp_path):
    key, port, _ = server
    big = os.urandom(10 << 20)
    (tmp_path / "big").write_bytes(big)
    (tmp_path / "empty").write_bytes(b"")
    small = b"small file bytes"
    n = (9 << 20) + 12345  # over TLS: several slices, the last one partial
    parts = [
        small,
        wire.FileRegion(str(tmp_path / "big"), 1001, n),
        bytearray(b"x" * 70000),
        wire.FileRegion(str(tmp_path / "empty"), 0, 0),
        wire.FileRegion(str(tmp_path / "big"), 0, 10),
    ]
    expected = small + big[1001 : 1001 + n] + b"x" * 70000 + big[:10]
    with wire.Client("127.0.0.1", port, key) as c:
        back = c.call("as_bytes", values=[wire.Gathered(parts), pickle.PickleBuffer(bytearray(b"after"))])
        assert back == [expected, b"after"]  # one buffer each, in order
        assert c.call("echo", value=1) == 1
    frame = wire.encode({"v": wire.Gathered(parts)}, gathered=True)
    assert struct.unpack("!Q", frame[0][6:14])[0] == len(expected)  # one buffer's length on the wire
    assert frame[2:] == wire.Gathered(parts).parts  # written from the parts, never joined
    with pytest.raises(pickle.PicklingError):  # anywhere but the blocking transport its bytes would be lost
        pickle.dumps(wire.Gathered([b"abc"]), protocol=5)
    with wire.Client("127.0.0.1", port, key) as c:
        with pytest.raises(wire.RemoteError, match="cannot be sent"):  # an agent's reply cannot carry one
            c.call("gathered")


def test_a_file_region_that_shrank_fails_its_call_and_closes_only_that_connection(server, tmp_path):
    key, port, _ = server
    (tmp_path / "f").write_bytes(b"0123456789")
    with wire.Client("127.0.0.1", port, key) as c:
        with pytest.raises(wire.FileRegionError, match="ended 90 byte"):
            c.call("echo", value=wire.Gathered([wire.FileRegion(str(tmp_path / "f"), 0, 100)]))
        with pytest.raises(wire.PeerClosed):  # closed: the frame it cut short can never be followed
            c.call("echo", value=1)
    with wire.Client("127.0.0.1", port, key) as c:
        with pytest.raises(wire.FileRegionError, match="No such file"):
            c.call("echo", value=wire.Gathered([b"a", wire.FileRegion(str(tmp_path / "gone"), 0, 1)]))
    with wire.Client("127.0.0.1", port, key) as c:  # the server serves on
        assert c.call("echo", value=2) == 2


def test_frames_with_more_buffers_than_one_sendmsg_takes(server):
    key, port, _ = server
    bufs = [pickle.PickleBuffer(bytearray(os.urandom(100))) for _ in range(1500)]
    with wire.Client("127.0.0.1", port, key) as c:
        back = c.call("echo", value=bufs)
    assert [bytes(b) for b in back] == [bytes(b) for b in bufs]


def test_a_flood_of_silent_peers_cannot_keep_a_real_client_out(server, caplog):
    key, port, _ = server
    caplog.set_level("WARNING", logger="monarch_torchx.wire")

    def drops() -> list:
        return [r for r in caplog.records if "dropped connection" in r.getMessage()]

    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(2 * wire.MAX_HANDSHAKES + 5)]
    try:
        for _ in range(3):  # each real client gets in while the flood sits on (more than) every slot
            with wire.Client("127.0.0.1", port, key, timeout=10) as c:
                assert c.call("echo", value=1) == 1
    finally:
        for s in socks:
            s.close()
    # what the server logs of the closes is counted too: its one loop takes what is ready in order, so
    # once a client that connected after the closes (all readable before it connected) has its answer,
    # the loop has been through every one of them (an event to wait for, not a time)
    with wire.Client("127.0.0.1", port, key, timeout=10) as c:
        assert c.call("echo", value=2) == 2
    assert 1 <= len(drops()) <= 3, [r.getMessage() for r in drops()]  # rate-limited: a flood does not fill the log


def test_cancelling_a_stream_stops_the_server_side(server):
    key, port, cancelled = server
    c = wire.Client("127.0.0.1", port, key)
    it = c.stream("count", n=10**9)
    assert next(it) == 0
    it.close()
    assert cancelled.wait(5), "server kept producing after the client cancelled"


def test_wrong_token_is_refused_and_nothing_is_unpickled(server, tmp_path, caplog):
    key, port, _ = server
    with pytest.raises(wire.WireError, match="authentication|closed|handshake"):
        wire.Client("127.0.0.1", port, PoolCredentials(os.urandom(32), key.tls_file))
    # a peer that skips the handshake and sends a pickle straight away
    marker = tmp_path / "pwned"
    s = _raw(key, port)
    s.recv(64)
    s.sendall(b"".join(bytes(p) for p in wire.encode({"id": 1, "op": "echo", "args": {"value": _Pwn(str(marker))}})))
    s.settimeout(10)
    assert s.recv(100) == b""  # dropped
    s.close()
    assert not marker.exists()
    with wire.Client("127.0.0.1", port, key) as c:  # and the server still serves others
        assert c.call("echo", value=1) == 1


def test_garbage_and_malformed_frames_are_dropped(server, tmp_path):
    key, port, _ = server
    s = _raw(key, port)
    s.settimeout(10)
    s.recv(64)
    s.sendall(os.urandom(200))
    assert s.recv(100) == b""
    s.close()
    # authenticated, then a frame header claiming a 4 GiB body: dropped, not allocated
    c = wire.Client("127.0.0.1", port, key)
    c._sock.sendall(struct.pack("!IH", 0xFFFFFFFF, 0))
    assert c._sock.recv(100) == b""
    c.close()
    # authenticated, then bytes that do not unpickle: dropped with a reason
    c = wire.Client("127.0.0.1", port, key)
    c._sock.sendall(struct.pack("!IH", 5, 0) + b"\x80\x05junk")
    assert c._sock.recv(100) == b""
    c.close()
    with wire.Client("127.0.0.1", port, key) as c:
        assert c.call("echo", value="ok") == "ok"


def test_silent_peer_is_dropped_after_the_handshake_timeout(server, monkeypatch):
    key, port, _ = server
    monkeypatch.setattr(handshake, "HANDSHAKE_TIMEOUT_S", 0.3)
    s = socket.create_connection(("127.0.0.1", port))  # silent: no TLS hello either
    s.settimeout(10)
    if not key.tls:
        assert len(s.recv(64)) == wire.HELLO_LEN
    assert s.recv(100) == b""  # the server gave up on us rather than holding the slot forever
    s.close()


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
def test_frame_parser_reassembles_frames_from_any_split(chunk):
    """The incremental parser (actor procs, hub) yields the same frames however bytes arrive."""
    import numpy as np

    msgs = [{"i": i, "small": b"x" * i} for i in range(5)]
    msgs.append({"big": pickle.PickleBuffer(np.arange(3 << 20, dtype=np.uint8)), "tail": "t"})  # huge-page buffer
    msgs.append({"mid": pickle.PickleBuffer(bytearray(b"m" * 100_000)), "empty": pickle.PickleBuffer(bytearray())})
    stream = b"".join(bytes(memoryview(p).cast("B")) for m in msgs for p in wire.encode(m))
    parser = wire.FrameParser(chunk=64 * 1024)
    frames = []
    pos = 0
    while pos < len(stream):
        view = parser.get_buffer()
        n = min(len(view), chunk, len(stream) - pos)
        view[:n] = stream[pos : pos + n]
        pos += n
        frames += parser.feed(n)
    decoded = [wire.decode(body, bufs) for body, bufs in frames]
    assert [d["i"] for d in decoded[:5]] == list(range(5)) and decoded[4]["small"] == b"xxxx"
    assert bytes(decoded[5]["big"]) == bytes(np.arange(3 << 20, dtype=np.uint8)) and decoded[5]["tail"] == "t"
    assert bytes(decoded[6]["mid"]) == b"m" * 100_000 and bytes(decoded[6]["empty"]) == b""


def test_frame_parser_starts_small_and_grows_only_as_the_stream_needs():
    """A connection of small frames holds a small chunk; a header of many buffers or a body
    larger than the chunk (under the in-place size) makes it grow, and a stream that fills each
    read grows it to the full chunk; every frame still comes out whole, in order."""
    offered = []  # how much each read could take

    def feed_all(parser, stream, step):
        frames, pos = [], 0
        offered.clear()
        while pos < len(stream):
            view = parser.get_buffer()
            offered.append(len(view))
            n = min(len(view), step, len(stream) - pos)
            view[:n] = stream[pos : pos + n]
            pos += n
            frames += parser.feed(n)
        return [wire.decode(body, bufs) for body, bufs in frames]

    parser = wire.FrameParser()
    small = b"".join(bytes(memoryview(p).cast("B")) for i in range(50) for p in wire.encode({"i": i}))
    assert [m["i"] for m in feed_all(parser, small, 100)] == list(range(50))
    assert max(offered) <= 16 * 1024  # trickled small frames: it stayed small
    requests = [
        b"".join(bytes(memoryview(p).cast("B")) for p in wire.encode({"i": i, "pad": "x" * 150})) for i in range(500)
    ]  # 100 kB in all, one frame per read, as a request stream arrives
    got = []
    for frame in requests:
        got += feed_all(parser, frame, len(frame))
        assert max(offered) <= 16 * 1024
    assert [m["i"] for m in got] == list(range(500))
    many = {"bufs": [pickle.PickleBuffer(bytearray([i % 256])) for i in range(4000)]}  # 32 KB of buffer lengths
    wide = {"body": "y" * 40_000}  # a 40 KB body, received in the chunk (under BIG)
    stream = b"".join(bytes(memoryview(p).cast("B")) for m in (many, wide) for p in wire.encode(m))
    got = feed_all(parser, stream, 1 << 20)
    assert [bytes(b) for b in got[0]["bufs"]] == [bytes([i % 256]) for i in range(4000)]
    assert got[1]["body"] == "y" * 40_000
    burst = b"".join(bytes(memoryview(p).cast("B")) for i in range(5000) for p in wire.encode({"i": i}))
    assert [m["i"] for m in feed_all(wire.FrameParser(), burst, 1 << 20)] == list(range(5000))
    assert offered[0] == 16 * 1024 and max(offered) > 64 * 1024  # reads that filled it made it grow


def test_frame_parser_refuses_oversized_headers():
    parser = wire.FrameParser()
    view = parser.get_buffer()
    head = struct.pack("!IH", wire.MAX_BODY + 1, 0)
    view[: len(head)] = head
    with pytest.raises(wire.WireError, match="malformed frame"):
        parser.feed(len(head))


def test_tls_peer_without_the_pools_certificate_is_refused_and_nothing_is_unpickled(tmp_path):
    """A TLS pool admits only peers that present its own certificate: another pool's
    certificate, a plaintext client and a plaintext pickle are all refused before any frame is
    decoded, and the server keeps serving its own clients."""
    key = os.urandom(32)
    creds = PoolCredentials(key, _tls_file(tmp_path / "tls.pem", "mine"))
    loop = asyncio.new_event_loop()
    marker = tmp_path / "pwned"

    async def echo(peer, value):
        return value

    srv = wire.Server(creds, {"echo": echo})
    port = loop.run_until_complete(srv.start("127.0.0.1", 0))
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        other = PoolCredentials(key, _tls_file(tmp_path / "other.pem", "mine"))  # same secret, same name
        with pytest.raises(wire.HandshakeRefused, match="TLS refused"):
            wire.Client("127.0.0.1", port, other, timeout=5)
        with pytest.raises(wire.WireError):  # plaintext to a TLS pool: no greeting comes
            wire.Client("127.0.0.1", port, PoolCredentials(key), timeout=1)
        s = socket.create_connection(("127.0.0.1", port))  # a pickle where the TLS hello should be
        s.settimeout(10)
        s.sendall(
            b"".join(bytes(p) for p in wire.encode({"id": 1, "op": "echo", "args": {"value": _Pwn(str(marker))}}))
        )
        assert s.recv(100) == b""
        s.close()
        # the threaded acceptor (controller inbox, rdma data plane) refuses it the same way
        got = []
        acc = wire.ThreadedAcceptor("127.0.0.1", creds, b"inbox", lambda sock, peer: got.append(sock), name="test")
        with pytest.raises(wire.HandshakeRefused, match="TLS refused"):
            wire.dial("127.0.0.1", acc.port, other, b"inbox", 5)
        sock = wire.dial("127.0.0.1", acc.port, creds, b"inbox", 5)
        wire.send_msg(sock, {"id": 7})
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got and wire.FrameReader(got[0]).recv() == {"id": 7}
        sock.close()
        acc.close()
        assert not marker.exists()
        with wire.Client("127.0.0.1", port, creds) as c:
            assert c.call("echo", value=3) == 3
    finally:
        asyncio.run_coroutine_threadsafe(srv.close(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
        loop.close()


def test_threaded_acceptor_forgets_closed_tls_connections_and_evicts_silent_ones(tmp_path, monkeypatch):
    """The threaded acceptor (rdma data plane, controller inbox) tracks the TLS socket it serves,
    so a connection that ended is forgotten (no cap is reached over a long life) and a silent
    peer stuck in TLS is cut off by the deadline."""
    monkeypatch.setattr(handshake, "HANDSHAKE_TIMEOUT_S", 0.5)
    creds = PoolCredentials(os.urandom(32), _tls_file(tmp_path / "tls.pem"))

    def serve(sock, peer):
        assert wire.FrameReader(sock).recv() == {"id": 1}
        sock.close()
        acc.forget(sock)

    acc = wire.ThreadedAcceptor("127.0.0.1", creds, b"x", serve, name="test", max_conns=3)
    try:
        for _ in range(6):  # more than max_conns, one after another
            sock = wire.dial("127.0.0.1", acc.port, creds, b"x", 5)
            wire.send_msg(sock, {"id": 1})
            sock.close()
        deadline = time.monotonic() + 10
        while acc.socks and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not acc.socks
        silent = socket.create_connection(("127.0.0.1", acc.port))
        silent.settimeout(10)
        assert silent.recv(100) == b""  # dropped by the deadline, not held
        silent.close()
    finally:
        acc.close()


def test_a_send_that_must_wait_works_on_descriptors_past_selects_limit():
    """A controller of a big mesh holds more than 1,024 sockets; waiting for one to drain must not
    depend on select()."""
    import resource

    from monarch_torchx.actor.hub import raise_open_files_limit, send_parts

    raise_open_files_limit()
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 1300:
        pytest.skip("this process may not open 1,300 files")
    held = [socket.socket() for _ in range(1100)]  # the next sockets get descriptors past 1,023
    a, b = socket.socketpair()
    try:
        assert a.fileno() > 1024
        a.setblocking(False)
        with pytest.raises(TimeoutError, match="did not take data"):
            send_parts(a, [b"x" * (64 << 20)], timeout=0.3)  # nobody reads the other end
    finally:
        for s in held + [a, b]:
            s.close()
