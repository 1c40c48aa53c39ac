"""The wire codec (``net.frames``, the blocking reads and writes of ``net.blocking``): how a frame is
laid out, the incremental parser however the bytes arrive, and what it refuses."""

from __future__ import annotations

import pickle
import random
import socket
import struct

import pytest

from monarch_torchx import net
from monarch_torchx.net import blocking, frames

HEAD = struct.Struct("!IH")


def wire_bytes(msg: object) -> bytes:
    return b"".join(bytes(memoryview(p).cast("B")) for p in net.encode(msg))


def parse(stream: bytes, sizes: object, parser: net.FrameParser | None = None) -> list:
    """Feeds ``stream`` to a parser in reads of the given sizes (an int, or an iterator of them);
    returns the decoded messages."""
    parser = parser or net.FrameParser()
    out, pos = [], 0
    while pos < len(stream):
        view = parser.get_buffer()
        want = sizes if isinstance(sizes, int) else next(sizes)
        n = min(len(view), want, len(stream) - pos)
        view[:n] = stream[pos : pos + n]
        pos += n
        out += [net.decode(body, bufs) for body, bufs in parser.feed(n)]
    return out


def test_a_frame_is_its_header_then_its_pickled_body_then_each_out_of_band_buffer():
    msg = {"id": 7, "op": "echo", "args": {"a": pickle.PickleBuffer(bytearray(b"abc")), "b": pickle.PickleBuffer(b"")}}
    head, body, *bufs = net.encode(msg)
    body_len, nbufs = HEAD.unpack_from(head)
    assert (body_len, nbufs) == (len(body), 2)
    assert [struct.unpack_from("!Q", head, HEAD.size + 8 * i)[0] for i in range(nbufs)] == [3, 0]
    assert len(head) == HEAD.size + 8 * nbufs
    assert [bytes(b) for b in bufs] == [b"abc", b""]  # written from the buffers' own memory
    assert b"abc" not in bytes(body)  # not copied into the pickle
    (back,) = parse(wire_bytes(msg), 1 << 20)
    assert back["id"] == 7 and bytes(back["args"]["a"]) == b"abc" and bytes(back["args"]["b"]) == b""


def test_frames_split_at_every_byte_come_out_whole_and_in_order():
    msgs = [
        {"id": 1, "op": "x", "args": {}},
        {"id": 2, "value": [None, 1.5, "é", b"\x00" * 40]},
        {"id": 3, "bufs": [pickle.PickleBuffer(bytearray([i]) * (i + 1)) for i in range(5)]},
        {"id": 4},
    ]
    stream = b"".join(wire_bytes(m) for m in msgs)
    got = parse(stream, 1)  # one byte per read: header, lengths, body and buffers each cut everywhere
    assert [m["id"] for m in got] == [1, 2, 3, 4]
    assert got[1]["value"] == [None, 1.5, "é", b"\x00" * 40]
    assert [bytes(b) for b in got[2]["bufs"]] == [bytes([i]) * (i + 1) for i in range(5)]


def test_a_large_buffer_is_received_in_place_across_reads_of_any_size():
    big = bytes(random.Random(1).randbytes(3 * net.FrameParser.BIG + 17))
    msgs = [{"i": 0}, {"i": 1, "big": pickle.PickleBuffer(bytearray(big))}, {"i": 2}]
    stream = b"".join(wire_bytes(m) for m in msgs)
    rng = random.Random(2)
    sizes = iter(lambda: rng.choice([1, 3, 100, 4096, 70_000]), None)
    got = parse(stream, sizes, net.FrameParser(alloc=bytearray))
    assert [m["i"] for m in got] == [0, 1, 2]
    assert isinstance(got[1]["big"], bytearray) and bytes(got[1]["big"]) == big


def test_many_frames_in_one_read_all_come_out_and_a_partial_one_waits_for_its_rest():
    whole = b"".join(wire_bytes({"i": i}) for i in range(100))
    last = wire_bytes({"i": 100, "pad": "p" * 500})
    parser = net.FrameParser()
    got = parse(whole + last[:-1], 1 << 20, parser)
    assert [m["i"] for m in got] == list(range(100))  # the 101st is one byte short
    view = parser.get_buffer()
    view[:1] = last[-1:]
    ((body, bufs),) = parser.feed(1)
    assert net.decode(body, bufs) == {"i": 100, "pad": "p" * 500}


def test_reading_only_what_is_wanted_never_reads_past_a_frame():
    """``wanted()`` (the fork server's channel, where descriptors follow a frame): a reader that
    takes no more than it says stops exactly at the end of each frame."""
    first, second = wire_bytes({"a": pickle.PickleBuffer(bytearray(b"x" * 10))}), wire_bytes({"b": 2})
    stream = first + second + b"TRAILER"
    parser = net.FrameParser()
    pos, ends = 0, []
    while len(ends) < 2:
        n = min(parser.wanted(), len(parser.get_buffer()))
        parser.get_buffer()[:n] = stream[pos : pos + n]
        pos += n
        if parser.feed(n):
            ends.append(pos)
    assert ends == [len(first), len(first) + len(second)]  # the trailer was never taken


@pytest.mark.parametrize("at_once", [True, False], ids=["whole", "byte-by-byte"])
@pytest.mark.parametrize(
    "head, why",
    [
        (HEAD.pack(net.MAX_BODY + 1, 0), "body"),
        (HEAD.pack(10, frames.MAX_BUFS + 1), "buffers"),
        (HEAD.pack(0, 1) + struct.pack("!Q", frames.MAX_BUF + 1), "buffer too large"),
    ],
    ids=["body", "buffer-count", "buffer-size"],
)
def test_an_oversized_frame_is_refused_from_its_header_alone(head, why, at_once):
    """Nothing of it is allocated or waited for: the header is enough to refuse it."""
    parser = net.FrameParser()
    with pytest.raises(net.MalformedFrame, match=why) as e:
        if at_once:
            parser.get_buffer()[: len(head)] = head
            parser.feed(len(head))
        else:
            for i in range(len(head)):
                parser.get_buffer()[:1] = head[i : i + 1]
                parser.feed(1)
    assert isinstance(e.value, net.WireError) and isinstance(e.value, ConnectionError)  # what callers branch on


def test_a_body_that_is_not_a_pickle_or_not_a_message_is_malformed():
    with pytest.raises(net.MalformedFrame, match="malformed message"):
        net.decode(bytearray(b"\x80\x05garbage"), [])
    with pytest.raises(net.MalformedFrame, match="not a request/reply dict"):
        frames.check_msg(["id", 1])
    with pytest.raises(net.MalformedFrame):
        frames.check_msg({"id": "1"})
    assert frames.check_msg({"id": 1, "op": "x"}) == {"id": 1, "op": "x"}


def test_a_peers_error_comes_back_as_the_local_type_of_its_kind():
    unknown = net.remote_error("unknown operation 'nope'", "UnknownOperation")
    assert type(unknown) is net.UnknownOperation and str(unknown) == "unknown operation 'nope'"
    assert unknown.raised(net.UnknownOperation) and unknown.kind == "UnknownOperation"
    other = net.remote_error("bad arguments", "TypeError")  # no local RemoteError of that name
    assert type(other) is net.RemoteError and other.raised(TypeError) and not other.raised(ValueError)
    assert net.remote_error("x", "").kind == "RemoteError"


def test_a_gathered_buffer_travels_as_one_buffer_from_its_parts_and_a_file_region(tmp_path):
    (tmp_path / "f").write_bytes(b"0123456789")
    region = net.FileRegion(str(tmp_path / "f"), 2, 5)
    with pytest.raises(pickle.PicklingError):  # pickled anywhere else, its bytes would be lost
        pickle.dumps(net.Gathered([b"ab"]), protocol=5)
    a, b = socket.socketpair()
    with a, b:
        blocking.send_msg(a, {"id": 1, "data": net.Gathered([b"ab", bytearray(b"cd"), region])})
        got = net.FrameReader(b).recv()
    assert isinstance(got["data"], memoryview) and bytes(got["data"]) == b"abcd23456"


def test_a_file_region_that_is_shorter_than_said_fails_its_frame(tmp_path):
    (tmp_path / "f").write_bytes(b"abc")
    a, b = socket.socketpair()
    with a, b, pytest.raises(net.FileRegionError, match="ended 7 byte"):
        blocking.send_msg(a, {"data": net.Gathered([net.FileRegion(str(tmp_path / "f"), 0, 10)])})
    assert not isinstance(net.FileRegionError("x"), net.WireError)  # a local file's fault, not the peer's


def test_a_blocking_reader_in_exact_mode_leaves_what_follows_a_frame_in_the_socket():
    a, b = socket.socketpair()
    with a, b:
        blocking.send_msg(a, {"id": 1, "pad": "x" * 3000})
        a.sendall(b"FDS")
        reader = net.FrameReader(b, exact=True)
        assert reader.recv() == {"id": 1, "pad": "x" * 3000}
        b.settimeout(1)
        assert b.recv(16) == b"FDS"


def test_a_blocking_reader_says_peer_closed_at_the_end_of_the_stream_even_mid_frame():
    a, b = socket.socketpair()
    with b:
        frame = wire_bytes({"id": 1})
        a.sendall(frame + frame[:5])
        a.close()
        reader = net.FrameReader(b)
        assert reader.recv() == {"id": 1}
        with pytest.raises(net.PeerClosed):
            reader.recv()
