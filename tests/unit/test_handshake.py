"""The handshake (``net.handshake``, ``net.dial``): both ends prove they hold the pool's secret for
the member meant, over connected socket pairs; what each side raises when the other is wrong,
goes away or stays silent; and the gate that bounds handshakes in progress."""

from __future__ import annotations

import os
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from monarch_torchx import net
from monarch_torchx.credentials import PoolCredentials
from monarch_torchx.net import blocking, handshake

ID = b"pool/0/inc-1"


class Side:
    """Runs ``fn`` on a thread; ``result()`` is what it returned or raised."""

    def __init__(self, fn, *args) -> None:
        self.value: object = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        threading.Thread(target=self._run, args=(fn, *args), daemon=True).start()

    def _run(self, fn, *args) -> None:
        try:
            self.value = fn(*args)
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            self.error = e
        finally:
            self._done.set()

    def result(self, timeout: float = 5.0) -> object:
        assert self._done.wait(timeout), "the other side did not finish"
        if self.error is not None:
            raise self.error
        return self.value


# ------------------------------------------------------------------ the exchange itself (pure)


def test_both_proofs_check_out_with_the_same_secret_and_identity():
    key = os.urandom(32)
    nonce_s, hello = handshake.server_hello()
    assert hello == handshake.MAGIC + nonce_s and len(hello) == handshake.HELLO_LEN
    answer, ns, nc = handshake.client_answer(key, hello, ID)
    assert ns == nonce_s and len(answer) == handshake.ANSWER_LEN
    proof = handshake.server_check(key, nonce_s, answer, ID)
    handshake.client_check(key, ns, nc, proof, ID)  # raises on a bad proof
    assert handshake.server_hello()[0] != nonce_s  # fresh nonces: an answer cannot be replayed


@pytest.mark.parametrize("what", ["secret", "identity"])
def test_a_client_with_another_secret_or_meaning_another_member_is_refused(what):
    key = os.urandom(32)
    nonce_s, hello = handshake.server_hello()
    answer, ns, nc = handshake.client_answer(os.urandom(32) if what == "secret" else key, hello, ID)
    with pytest.raises(net.HandshakeRefused, match="authentication failed"):
        handshake.server_check(key, nonce_s, answer, ID if what == "secret" else b"pool/1/inc-1")


def test_a_server_whose_proof_does_not_check_out_is_refused_by_the_client():
    key = os.urandom(32)
    nonce_s, hello = handshake.server_hello()
    answer, ns, nc = handshake.client_answer(key, hello, ID)
    proof = handshake.server_check(key, nonce_s, answer, ID)
    with pytest.raises(net.HandshakeRefused, match="agent failed authentication"):
        handshake.client_check(key, ns, nc, bytes([proof[0] ^ 1]) + proof[1:], ID)


def test_a_greeting_or_answer_of_the_wrong_shape_is_refused_before_any_mac():
    key = os.urandom(32)
    with pytest.raises(net.HandshakeRefused, match="bad greeting"):
        handshake.client_answer(key, b"HTTP/1.1 400 Bad Request\r\n\r\n1234", ID)
    with pytest.raises(net.HandshakeRefused, match="bad greeting"):
        handshake.client_answer(key, b"MTX1" + b"n" * 31, ID)  # one byte short
    nonce_s, _ = handshake.server_hello()
    with pytest.raises(net.HandshakeRefused, match="malformed handshake"):
        handshake.server_check(key, nonce_s, b"GET / HTTP/1.1\r\n" + b"x" * 52, ID)


# ------------------------------------------------------------------ over a connection


def test_dial_and_accept_authenticate_each_other_and_then_carry_frames(creds, tcp_pair):
    client_end, server_end = tcp_pair()
    server = Side(handshake.accept_handshake, server_end, creds, ID)
    sock = net.dial("127.0.0.1", 0, creds, ID, timeout=2, sock=client_end)
    accepted = server.result()
    assert sock.gettimeout() == 2 and accepted.gettimeout() is None  # the acceptor's socket blocks
    blocking.send_msg(sock, {"id": 1, "op": "hello"})
    assert net.FrameReader(accepted).recv() == {"id": 1, "op": "hello"}
    blocking.send_msg(accepted, {"id": 1, "ok": True, "value": "hi"})
    assert net.FrameReader(sock).recv()["value"] == "hi"


@pytest.mark.parametrize("what", ["secret", "identity"])
def test_the_wrong_secret_or_member_fails_on_both_sides(creds, tcp_pair, what):
    client_end, server_end = tcp_pair()
    server = Side(handshake.accept_handshake, server_end, creds, ID)
    other = PoolCredentials(os.urandom(32)) if what == "secret" else creds
    with pytest.raises(net.ProofRejected) as e:  # the server closed on our answer
        net.dial("127.0.0.1", 0, other, ID if what == "secret" else b"pool/0/inc-0", timeout=2, sock=client_end)
    assert isinstance(e.value, net.PeerClosed)  # (a flood's shedding looks the same: not HandshakeRefused)
    with pytest.raises(net.HandshakeRefused, match="authentication failed"):
        server.result()
    assert client_end.fileno() == -1 and server_end.fileno() == -1  # both closed on failure


def test_a_server_that_proves_another_secret_is_refused_by_the_client(creds, tcp_pair):
    client_end, server_end = tcp_pair()

    def impostor() -> None:  # accepts anything, then proves a secret of its own
        nonce_s, hello = handshake.server_hello()
        server_end.sendall(hello)
        answer = handshake._recv_into(server_end, handshake.ANSWER_LEN)
        nonce_c = bytes(answer[4:36])
        server_end.sendall(handshake._mac(os.urandom(32), b"s", ID, nonce_c, nonce_s))

    peer = Side(impostor)
    with pytest.raises(net.HandshakeRefused, match="agent failed authentication"):
        net.dial("127.0.0.1", 0, creds, ID, timeout=2, sock=client_end)
    peer.result()


def test_a_peer_that_is_not_ours_is_refused_from_its_greeting(creds):
    a, b = socket.socketpair()
    with b:
        b.sendall(b"SSH-2.0-OpenSSH_9.6\r\n".ljust(handshake.HELLO_LEN, b" "))  # as long as a greeting
        with pytest.raises(net.HandshakeRefused, match="not a monarch-torchx agent"):
            net.dial("peer", 1, creds, ID, timeout=2, sock=a)


def test_a_server_that_closes_before_its_greeting_is_peer_closed(creds):
    a, b = socket.socketpair()
    b.close()
    with pytest.raises(net.PeerClosed) as e:
        net.dial("peer", 1, creds, ID, timeout=2, sock=a)
    assert type(e.value) is net.PeerClosed and "peer:1" in str(e.value)


def test_a_client_that_closes_mid_handshake_is_peer_closed_at_the_server(creds, tcp_pair):
    client_end, server_end = tcp_pair()
    server = Side(handshake.accept_handshake, server_end, creds, ID)
    assert len(handshake._recv_into(client_end, handshake.HELLO_LEN)) == handshake.HELLO_LEN
    client_end.sendall(b"MTX1" + b"\x00" * 10)  # part of an answer, then gone
    client_end.close()
    with pytest.raises(net.PeerClosed):
        server.result()


def test_a_silent_server_times_out_the_dial(creds):
    a, b = socket.socketpair()
    with b:
        t0 = time.monotonic()
        with pytest.raises(net.PeerTimeout, match="did not answer the handshake"):
            net.dial("peer", 1, creds, ID, timeout=0.1, sock=a)
        assert time.monotonic() - t0 < 1.0
        assert a.fileno() == -1


def test_a_silent_client_is_cut_off_by_the_acceptors_deadline(creds, tcp_pair, monkeypatch):
    monkeypatch.setattr(handshake, "HANDSHAKE_TIMEOUT_S", 0.1)
    client_end, server_end = tcp_pair()
    t0 = time.monotonic()
    # its read times out, or the deadline's timer shuts the socket under it first: either way an
    # OSError (ConnectionError included), which the acceptors drop with a logged reason
    with pytest.raises((TimeoutError, net.PeerClosed)):
        handshake.accept_handshake(server_end, creds, ID)
    assert time.monotonic() - t0 < 1.0 and server_end.fileno() == -1
    client_end.settimeout(1)
    assert len(client_end.recv(100)) == handshake.HELLO_LEN and client_end.recv(100) == b""  # greeted, then closed


def test_nothing_listening_is_connect_failed_and_refused(creds, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connecting is refused
        with pytest.raises(net.ConnectFailed) as e:
            net.dial("127.0.0.1", port, creds, ID, timeout=1)
    assert e.value.refused
    with pytest.raises(net.ConnectFailed) as e:
        net.dial(net.UNIX + str(tmp_path / "no-such-socket"), 0, creds, ID, timeout=1)
    assert e.value.refused


# ------------------------------------------------------------------ the gate


def test_a_full_gate_lets_the_newest_in_by_evicting_the_oldest():
    gate = handshake.HandshakeGate(limit=3)
    evicted: list[str] = []
    for name in "abc":
        gate.admit(name, lambda n=name: evicted.append(n))
    gate.release("b")  # finished its handshake: no longer counted
    gate.admit("d", lambda: evicted.append("d"))
    assert evicted == [] and list(gate.pending) == ["a", "c", "d"]
    gate.admit("e", lambda: evicted.append("e"))
    gate.admit("f", lambda: evicted.append("f"))
    assert evicted == ["a", "c"] and list(gate.pending) == ["d", "e", "f"]


def test_drops_are_logged_once_per_reason_per_period_with_a_count(monkeypatch, caplog):
    now = [1000.0]
    monkeypatch.setattr(handshake, "time", SimpleNamespace(monotonic=lambda: now[0]))
    caplog.set_level("WARNING", logger="monarch_torchx.wire")
    gate = handshake.HandshakeGate(name="agent 0: ")
    for i in range(5):
        gate.note_drop(f"10.0.0.{i}:1", "handshake timed out")
    gate.note_drop("10.0.0.9:1", "authentication failed")
    now[0] += handshake.DROP_LOG_EVERY_S
    gate.note_drop("10.0.0.7:1", "handshake timed out")
    assert [r.getMessage() for r in caplog.records] == [
        "agent 0: dropped connection from 10.0.0.0:1: handshake timed out",
        "agent 0: dropped connection from 10.0.0.9:1: authentication failed",
        "agent 0: dropped connection from 10.0.0.7:1: handshake timed out (4 more like it since the last report)",
    ]
