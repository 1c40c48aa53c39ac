"""Monarch's bootstrap of hosts started elsewhere: run_worker_loop_forever + attach_to_workers.

Workers here are real processes on loopback (the SLURM lab's test covers workers on other
nodes, over TLS). Each test ends its workers.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from monarch_torchx.actor import Channel, attach_to_workers
from monarch_torchx.actor.bootstrap import WorkerAddress, WorkerRefused
from monarch_torchx.errors import MonarchError
from monarch_torchx.private import PrivatePathError
from monarch_torchx.registry import Registry
from tests.fixtures.actors import Counter

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(address: str, ca: str = "'trust_all_connections'", **popen) -> subprocess.Popen:
    code = (
        "from monarch_torchx.actor import run_worker_loop_forever; "
        f"run_worker_loop_forever(address={address!r}, ca={ca})"
    )
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, **popen)


@pytest.fixture
def workers(home):
    started: list[subprocess.Popen] = []

    def start(n: int = 2, ca: str = "'trust_all_connections'") -> list[str]:
        addrs = [f"tcp://127.0.0.1:{_free_port()}" for _ in range(n)]
        started.extend(_worker(a, ca) for a in addrs)
        return addrs

    yield start, started
    for p in started:
        p.kill()
        p.wait()


def test_attached_workers_are_a_warm_host_mesh_and_end_with_its_shutdown(workers):
    start, procs = workers
    addrs = start(2)
    hosts = attach_to_workers(ca="trust_all_connections", workers=addrs)
    assert hosts.extent.labels == ["hosts"] and hosts.extent.sizes == [2]
    port, _ = Channel.open()  # the pool in use at once, as Monarch's attach makes it (waits for the adoption)
    assert port.pool == hosts.pool
    counters = hosts.spawn_procs(per_host={"gpus": 1}).spawn("c", Counter)
    assert list(counters.incr.call(3).get(timeout=60).values()) == [3, 3]
    worker_pids = {p.pid for p in procs}
    # the procs run under the workers (their agents are the worker processes themselves)
    parents = {
        int(Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[1])
        for pid in counters.pid.call().get().values()
    }
    assert parents and all(_descends_from(pp, worker_pids) for pp in parents)
    # attaching again to the same live workers reuses the pool: nothing is adopted anew
    rec = Registry().get(hosts.pool)
    again = attach_to_workers(ca="trust_all_connections", workers=addrs)
    assert again.pool == hosts.pool
    # its adoption runs in the background: wait for it, or it may land after the shutdown below
    assert again.initialized.get(timeout=60) is True
    assert [h.incarnation for h in Registry.hosts(Registry().get(again.pool))] == [
        h.incarnation for h in Registry.hosts(rec)
    ]
    hosts.shutdown().get(timeout=60)
    assert [p.wait(timeout=30) for p in procs] == [0, 0]  # each worker returns, as Monarch's
    assert Registry().get(hosts.pool) is None


def _descends_from(pid: int, ancestors: set) -> bool:
    while pid > 1:
        if pid in ancestors:
            return True
        pid = int(Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[1])
    return False


def test_a_worker_refuses_a_client_without_its_secret_and_stays_for_one_with_it(workers, tmp_path):
    start, procs = workers
    secret = tmp_path / "secret"
    secret.write_text("a" * 64)
    secret.chmod(0o600)
    addrs = start(1, ca=f"{str(secret)!r}")
    with pytest.raises(WorkerRefused, match=f"worker {addrs[0]} refused us: .*another secret"):
        attach_to_workers(ca=b"b" * 32, workers=addrs).initialized.get(timeout=60)
    assert procs[0].poll() is None
    hosts = attach_to_workers(ca=secret, workers=addrs, name="mine")
    assert hosts.pool == "mine"
    assert list(hosts.spawn_procs().spawn("c", Counter).incr.call().get(timeout=60).values()) == [1]
    # a second client (another registry: another user's controller) cannot take it over
    with pytest.raises(WorkerRefused, match="serves another client's hosts"):
        attach_to_workers(ca=secret, workers=addrs, name="theirs").initialized.get(timeout=60)
    hosts.shutdown().get(timeout=60)
    assert procs[0].wait(timeout=30) == 0


def test_a_worker_listens_on_an_inherited_socket(home):
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    proc = _worker(f"tcp://127.0.0.1:fd{sock.fileno()}", pass_fds=(sock.fileno(),))
    sock.close()
    try:
        hosts = attach_to_workers(ca="trust_all_connections", workers=[f"tcp://127.0.0.1:{port}"])
        assert list(hosts.spawn_procs().spawn("c", Counter).incr.call(2).get(timeout=60).values()) == [2]
        hosts.shutdown().get(timeout=60)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()


def test_workers_on_unix_sockets(home, tmp_path):
    addrs = [f"ipc://{tmp_path}/w{i}" for i in range(2)]
    procs = [_worker(a) for a in addrs]
    try:
        hosts = attach_to_workers(ca="trust_all_connections", workers=addrs)
        assert list(hosts.spawn_procs().spawn("c", Counter).incr.call(2).get(timeout=60).values()) == [2, 2]
        hosts.shutdown().get(timeout=60)
        assert [p.wait(timeout=30) for p in procs] == [0, 0]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_an_unreachable_worker_is_named_after_the_bounded_wait(home, monkeypatch):
    """As Monarch's, attach_to_workers returns at once; `initialized`, and the mesh's first use,
    raise naming the worker, after Monarch's mesh_attach_config_timeout (or our env variable)."""
    from monarch_torchx.actor.config import configured

    monkeypatch.setenv("MONARCH_TORCHX_ATTACH_TIMEOUT_S", "1")
    dead = f"tcp://127.0.0.1:{_free_port()}"
    hosts = attach_to_workers(ca="trust_all_connections", workers=[dead])
    assert hosts.sizes == {"hosts": 1}
    with pytest.raises(
        MonarchError, match=f"attach failed: .*worker {dead} is not reachable .*run_worker_loop_forever"
    ):
        hosts.initialized.get(timeout=30)
    with pytest.raises(MonarchError, match=f"worker {dead} is not reachable"):
        hosts.spawn_procs()
    assert Registry().list() == []  # nothing half-made is left
    monkeypatch.setenv("MONARCH_TORCHX_ATTACH_TIMEOUT_S", "600")
    with configured(mesh_attach_config_timeout="300ms"):  # Monarch's knob wins where it is set
        hosts = attach_to_workers(ca="trust_all_connections", workers=[dead])
    with pytest.raises(MonarchError, match="not reachable"):
        hosts.initialized.get(timeout=30)


@pytest.mark.parametrize(
    "address, message",
    [
        ("inproc://3423", "only tcp:// and ipc:// addresses"),
        ("tcp://*:4444", "a wildcard is not an address"),
        ("tcp://host", "expected tcp://HOST:PORT"),
        ("tcp://host:99999", "is not a port"),
    ],
)
def test_bad_worker_addresses_are_refused_in_one_line(address, message):
    with pytest.raises(ValueError, match=message):
        WorkerAddress.parse(address)


def test_monarch_address_forms_are_understood():
    alias = WorkerAddress.parse("tcp://node7:4444@tcp://0.0.0.0:4444")
    assert (alias.host, alias.port, alias.bind) == ("node7", 4444, "0.0.0.0")
    named = WorkerAddress.parse("service<2MuAHeDjLCEd>@tcp://node7:4444")
    assert (named.host, named.port, named.bind) == ("node7", 4444, "node7")
    assert not named.loopback and WorkerAddress.parse("tcp://127.0.0.1:1").loopback


def test_a_secret_file_others_can_read_is_refused(home, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("a" * 64)
    secret.chmod(0o644)
    with pytest.raises(PrivatePathError, match="open to other users"):
        attach_to_workers(ca=secret, workers=["tcp://127.0.0.1:1"])
    with pytest.raises(ValueError, match="too short"):
        attach_to_workers(ca=b"short", workers=["tcp://127.0.0.1:1"])
    # the per-user secret of "trust_all_connections" is made private
    from monarch_torchx.actor.bootstrap import worker_secret

    worker_secret("trust_all_connections")
    assert oct(os.stat(home / "worker_secret").st_mode & 0o777) == "0o600"


def _listener_inodes(port: int) -> list[int]:
    """The inodes of the sockets listening on ``port`` (IPv4, any address)."""
    out = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if int(f[1].split(":")[1], 16) == port and f[3] == "0A":  # 0A: LISTEN
            out.append(int(f[9]))
    return out


def test_a_worker_keeps_one_listening_socket_from_start_through_adoption(workers):
    """The worker's port is never closed while it waits to be adopted and becomes the pool's
    agent (a port closed in between is anyone's to take on a shared node): the socket that
    listened before the client came is the one its agent serves on."""
    start, procs = workers
    addr = start(1)[0]
    port = int(addr.rsplit(":", 1)[1])
    deadline = time.time() + 30
    while not _listener_inodes(port) and time.time() < deadline:
        time.sleep(0.05)
    before = _listener_inodes(port)
    hosts = attach_to_workers(ca="trust_all_connections", workers=[addr])
    assert list(hosts.spawn_procs(per_host={"gpus": 1}).spawn("c", Counter).incr.call(1).get(timeout=60).values()) == [
        1
    ]
    assert before and _listener_inodes(port) == before
    hosts.shutdown().get(timeout=60)
    assert procs[0].wait(timeout=30) == 0
