"""Monarch's bootstrap of hosts someone else started: ``run_worker_loop_forever`` on each
worker machine, ``attach_to_workers`` in the controller.

Monarch's workers listen with ``ca="trust_all_connections"``: no authentication at all. Ours
never listen unauthenticated. A worker waits, on the pool protocol, for one client that proves
it holds the workers' secret to *adopt* it (give it a pool name, a host index and an
incarnation); then it serves that pool as an ordinary agent on the same port (the same agent,
fork server and procs as every pool's host), until the pool is stopped (the worker returns, as
Monarch's does when its HostMesh is shut down) or idles out (the worker waits to be adopted
again). The secret comes from ``ca``:

- ``"trust_all_connections"``: this user's workers secret, ``~/.monarch_torchx/worker_secret``
  (made 0600 on first use). Client and workers share it wherever they share a home directory
  (one machine, a cluster's shared home); elsewhere, copy it or pass it.
- bytes: the secret itself (at least 16 bytes); a ``Path`` (or ``str``): a file holding it,
  which must be ours and 0600.

Workers whose address is not loopback talk TLS 1.3 with a certificate derived from the secret
(both sides derive the same one, so nothing but the secret has to reach them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import hashlib
import hmac
import logging
import os
import secrets
import shutil
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Sequence, Union

from .. import net
from ..credentials import PoolCredentials
from ..errors import MonarchError
from ..net import aio
from ..private import node_temp_root, private_dir, read_private_file
from ..registry import HostAddr, Registry, check_pool_name, home

log = logging.getLogger("monarch_torchx.actor")

CA = Union[bytes, Path, str, Literal["trust_all_connections"]]  # noqa: UP007
TRUST_ALL = "trust_all_connections"
SECRET_FILE = "worker_secret"
SCHEDULER = "monarch_workers"  # the engine of pools made by attach_to_workers
_LOOPBACK = ("127.", "localhost", "::1")


def attach_timeout() -> float:
    """How long attach_to_workers waits for each worker (they may still be starting): Monarch's
    ``mesh_attach_config_timeout`` where ``configure`` set it, else ``MONARCH_TORCHX_ATTACH_TIMEOUT_S``."""
    from .config import duration_s, get_runtime_config

    knob = get_runtime_config().get("mesh_attach_config_timeout")
    if knob is not None:
        return duration_s(knob)
    return float(os.environ.get("MONARCH_TORCHX_ATTACH_TIMEOUT_S", "60"))


class WorkerRefused(MonarchError):
    """A worker could not be adopted: it serves another client's pool, or holds another secret."""


# ---------------------------------------------------------------- addresses and secrets


@dataclass(frozen=True)
class WorkerAddress:
    """One worker, as ``tcp://HOST:PORT`` or ``ipc://PATH`` (a Unix socket; Monarch's other forms:
    ``tcp://DIAL:PORT@tcp://BIND:PORT``
    to listen on one interface and be dialled on another, ``tcp://HOST:fdN`` to listen on an
    inherited bound socket, ``ID@tcp://...`` with a proc identity, which is ignored here)."""

    host: str  # what clients dial
    port: int  # 0 with ``fd``: the port is the socket's
    bind: str
    fd: int | None = None
    text: str = ""

    @classmethod
    def parse(cls, text: str) -> WorkerAddress:
        if not isinstance(text, str):
            raise ValueError(f"a worker address is a string such as 'tcp://host:4444', not {type(text).__name__}")
        rest = text.strip()
        if rest.startswith("ipc://"):  # a Unix socket: a worker on this machine
            path = rest[len("ipc://") :]
            if not path or "@" in path:
                raise ValueError(f"worker address {text!r}: expected ipc://PATH")
            host = net.UNIX + os.path.abspath(path)
            return cls(host, 0, host, None, text)
        if not rest.startswith("tcp://") and "@tcp://" in rest:  # Monarch's "<proc id>@tcp://..."
            rest = rest.split("@", 1)[1]
        dial, _, bind = rest.partition("@")
        host, port, fd = _host_port(dial, text)
        bind_host = _host_port(bind, text)[0] if bind else host
        if host in ("*", "0.0.0.0", "", "::"):
            raise ValueError(
                f"worker address {text!r}: a wildcard is not an address clients can dial; give the "
                f"host's name, or tcp://NAME:PORT@tcp://0.0.0.0:PORT to listen on every interface"
            )
        return cls(host, port, bind_host, fd, text)

    @property
    def loopback(self) -> bool:
        return self.host.startswith(_LOOPBACK + (net.UNIX,))

    def identity(self) -> bytes:
        """What a worker's handshake covers before adoption: this address and no other."""
        return f"monarch-torchx-worker/{self.host}:{self.port}".encode()


def _host_port(part: str, text: str) -> tuple:
    if part.startswith(("unix:", "inproc://", "metatls://")):
        raise ValueError(
            f"worker address {text!r}: only tcp:// and ipc:// addresses are served here (Monarch's "
            f"inproc:// and metatls:// are not)"
        )
    if not part.startswith("tcp://"):
        raise ValueError(f"worker address {text!r}: expected tcp://HOST:PORT")
    host, sep, port = part[len("tcp://") :].rpartition(":")
    host = host.strip("[]")
    if not sep or not port:
        raise ValueError(f"worker address {text!r}: expected tcp://HOST:PORT")
    if port.startswith("fd") and port[2:].isdigit():
        return host, 0, int(port[2:])
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"worker address {text!r}: {port!r} is not a port")
    return host, int(port), None


def _read_secret(path: Path) -> bytes:
    try:
        return read_private_file(path).strip()
    except FileNotFoundError:
        raise MonarchError(f"no workers secret at {path}") from None


def worker_secret(ca: CA) -> bytes:
    """The secret that ``ca`` names (see the module's docstring)."""
    if isinstance(ca, (bytes, bytearray)):
        secret = bytes(ca)
    elif ca == TRUST_ALL:
        path = home() / SECRET_FILE
        private_dir(home())
        if not os.path.lexists(path):
            try:
                with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                    f.write(secrets.token_hex(32))
            except FileExistsError:  # another worker or client made it first
                pass
        secret = _read_secret(path)
    elif isinstance(ca, (str, Path)):
        secret = _read_secret(Path(ca).expanduser())
    else:
        raise ValueError(
            f"ca must be 'trust_all_connections', the workers' secret (bytes) or a file holding it, "
            f"not {type(ca).__name__}"
        )
    if len(secret) < 16:
        raise ValueError("the workers' secret is too short: use at least 16 bytes (e.g. `openssl rand -hex 32`)")
    return secret


def pool_key(secret: bytes) -> bytes:
    return hmac.new(secret, b"monarch-torchx workers: pool key", hashlib.sha256).digest()


def worker_tls_pem(secret: bytes) -> str:
    """The certificate and key every holder of ``secret`` derives alike: an Ed25519 key from the
    secret, and a self-signed certificate with fixed fields (Ed25519 signatures are deterministic)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519
    from cryptography.x509.oid import NameOID

    seed = hmac.new(secret, b"monarch-torchx workers: tls key", hashlib.sha256).digest()
    key = ed25519.Ed25519PrivateKey.from_private_bytes(seed)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "monarch-torchx workers")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(int.from_bytes(seed[:8], "big") | 1)
        .not_valid_before(datetime.datetime(2025, 1, 1, tzinfo=datetime.timezone.utc))
        .not_valid_after(datetime.datetime(2125, 1, 1, tzinfo=datetime.timezone.utc))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, None)
    )
    return (
        cert.public_bytes(serialization.Encoding.PEM).decode()
        + key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ).decode()
    )


def _install(state_dir: Path, secret: bytes, tls: bool) -> PoolCredentials:
    """Writes the pool credentials derived from ``secret`` into a private dir; returns them."""
    pem = worker_tls_pem(secret) if tls else ""
    PoolCredentials.install(state_dir, pool_key(secret).hex(), pem)
    return PoolCredentials.load(state_dir)


@dataclass(frozen=True)
class Adoption:
    """What a client tells a worker it adopts: whose host it now is (the ``adopt`` op's args)."""

    pool: str
    index: int
    incarnation: str
    idle_timeout: float = 1800.0
    preload: str = "torch"

    def check(self) -> Adoption:
        check_pool_name(self.pool)
        if not isinstance(self.index, int) or self.index < 0:
            raise ValueError(f"bad host index {self.index!r}")
        if not isinstance(self.incarnation, str) or not self.incarnation.isalnum():
            raise ValueError(f"bad incarnation {self.incarnation!r}")
        return self


# ---------------------------------------------------------------- the worker


def run_worker_loop_forever(*, ca: CA, address: str, private_key: Any = None) -> None:
    """As Monarch's: lets this machine be one host of a controller's HostMesh. Waits for a
    client (``attach_to_workers`` with the same secret) to adopt it, then serves as that pool's
    agent. Returns once that pool is stopped (``HostMesh.shutdown()``); a pool that idles out
    leaves the worker waiting for the next client. Ctrl-C or SIGTERM ends it."""
    if private_key is not None:
        raise ValueError("private_key: workers authenticate with the shared secret that ca names, not TLS keys")
    if not logging.getLogger().handlers:  # a worker's log is what its launcher shows of it
        logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    addr = WorkerAddress.parse(address)
    if addr.fd is None and not addr.host.startswith(net.UNIX):
        addr = _hold_port(addr)
    if addr.fd is not None:  # clients dial the inherited socket's port
        with socket.socket(fileno=os.dup(addr.fd)) as s:
            addr = dataclasses.replace(addr, port=s.getsockname()[1])
    secret = worker_secret(ca)
    root = private_dir(node_temp_root() / "workers", from_=node_temp_root())
    while True:
        state = private_dir(root / f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            creds = _install(state, secret, tls=not addr.loopback)
            adoption = asyncio.run(_wait_for_adoption(addr, creds))
            if adoption is None:
                return
            log.info("worker %s adopted as host %d of pool %s", addr.text, adoption.index, adoption.pool)
            reason = _serve_as_agent(addr, state, adoption)
        finally:
            shutil.rmtree(state, ignore_errors=True)
        if reason != "idle":
            return


def _hold_port(addr: WorkerAddress) -> WorkerAddress:
    """The worker's port, bound and listening once for the worker's whole life; every server of
    it (the adoption listener, then the agent it becomes) serves a duplicate of this socket. A
    port closed between the two would be anyone's to take on a shared node (and the worker would
    die trying to reopen it); connections that arrive in between wait in the backlog."""
    family = socket.AF_INET6 if ":" in addr.bind else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((addr.bind if addr.bind not in ("*",) else "", addr.port))
        sock.listen(1024)
    except OSError as e:
        sock.close()
        raise MonarchError(f"worker {addr.text}: cannot listen on {addr.bind}:{addr.port}: {e.strerror or e}") from None
    return dataclasses.replace(addr, fd=sock.detach())


def _listen_socket(addr: WorkerAddress) -> socket.socket | None:
    """A fresh handle on the inherited socket, for each server that listens on it (closing a
    server closes its socket)."""
    return socket.socket(fileno=os.dup(addr.fd)) if addr.fd is not None else None


async def _wait_for_adoption(addr: WorkerAddress, creds: PoolCredentials) -> Adoption | None:
    loop = asyncio.get_running_loop()
    adopted: asyncio.Future[Adoption | None] = loop.create_future()

    async def adopt(peer: aio.Peer, **args: Any) -> dict[str, Any]:
        adoption = Adoption(**args).check()
        if adopted.done():
            raise net.RemoteError(f"worker {addr.text} was adopted by another client just now")
        adopted.set_result(adoption)
        return {"hostname": socket.gethostname(), "pid": os.getpid()}

    import signal

    def stop_waiting() -> None:
        if not adopted.done():
            adopted.set_result(None)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_waiting)
    server = aio.Server(creds, {"adopt": adopt}, identity=addr.identity())
    await server.start(addr.bind, addr.port, sock=_listen_socket(addr))
    log.info("worker waiting at %s for a client to attach", addr.text)
    try:
        return await adopted
    finally:
        await server.close()


def _serve_as_agent(addr: WorkerAddress, state: Path, adoption: Adoption) -> str:
    """Runs the pool's agent (``python -m monarch_torchx.agent``, a child of this worker, serving
    the worker's own socket) until it stops; returns "idle" if it idled out. A child, not this
    process: the worker outlives the agent and is adopted again (and the actor runtime never
    imports the agent's code: a process boundary, as the fork server's)."""
    import subprocess

    from ..interpreter import module_argv

    argv = [
        "--state-dir",
        str(state),
        "--pool",
        adoption.pool,
        "--index",
        str(adoption.index),
        "--incarnation",
        adoption.incarnation,
        "--bind",
        addr.bind,
        "--port",
        str(addr.port),
        "--advertise",
        addr.host,
        "--idle-timeout",
        str(adoption.idle_timeout),
        "--preload",
        adoption.preload,
    ]
    fds: tuple[int, ...] = ()
    if addr.fd is not None:
        argv += ["--listen-fd", str(addr.fd)]
        fds = (addr.fd,)
    for sub in ("hosts", "apps", "logs"):
        private_dir(state / sub)
    code = subprocess.run(
        [*module_argv("monarch_torchx.agent"), *argv], pass_fds=fds, stdin=subprocess.DEVNULL
    ).returncode
    host = Registry.read_host(state, adoption.index)
    reason = (host.exit_reason if host is not None and host.exited else "") or f"agent exited with code {code}"
    return "idle" if reason.startswith("idle") else reason


# ---------------------------------------------------------------- the client


def attach_to_workers(
    *,
    ca: CA,
    workers: Sequence[Any],
    name: str | None = None,
    private_key: Any = None,
    idle_timeout: float = 1800.0,
    preload: str = "torch",
) -> Any:
    """As Monarch's: a HostMesh (dim ``hosts``) of the given workers, each running
    ``run_worker_loop_forever`` with the same secret. Workers may be strings or Futures of them.

    As Monarch's, it returns at once: the workers are adopted in the background, and
    ``await hosts.initialized`` (or the first use of the mesh) waits for them and raises
    ``MonarchError`` naming a worker that does not serve within ``attach_timeout()``. Bad
    arguments (an address, the secret) are refused here, at the call. The HostMesh is a warm
    pool like any other (``name``, default ``workers-<hash of the addresses>``), and attaching
    again to the same live workers reuses it."""
    from . import session
    from .future import Future
    from .mesh import HostMesh

    if private_key is not None:
        raise ValueError("private_key: workers authenticate with the shared secret that ca names, not TLS keys")
    texts = [w.get() if hasattr(w, "get") and not isinstance(w, str) else w for w in workers]
    addrs = [WorkerAddress.parse(t) for t in texts]
    if not addrs:
        raise ValueError("attach_to_workers needs at least one worker")
    if len({a.loopback for a in addrs}) > 1:
        raise ValueError(
            "attach_to_workers: some workers are on loopback and some are not; give every worker an "
            "address the others can reach"
        )
    secret = worker_secret(ca)
    tls = not addrs[0].loopback
    spec: dict[str, Any] = {"hosts": len(addrs), "workers": [f"{a.host}:{a.port}" for a in addrs], "tls": tls}
    name = check_pool_name(name or "workers-" + hashlib.sha256("\n".join(spec["workers"]).encode()).hexdigest()[:10])
    deadline = time.monotonic() + attach_timeout()  # read now: a `configured(...)` block may end before it is used
    adopted: Future[Any] = Future()

    def adopt() -> None:
        try:
            adopted.set_result(_attach_now(name, addrs, spec, secret, tls, idle_timeout, preload, deadline))
        except BaseException as e:  # noqa: BLE001 - the mesh's `initialized` (and first use) raises it
            adopted.set_exception(e)

    session.set_current_pool(name, adopted)  # now, as Monarch's attach makes it the one in use
    threading.Thread(target=adopt, name=f"attach-{name}", daemon=True).start()
    return HostMesh.pending(name, len(addrs), adopted)


def _attach_now(
    name: str,
    addrs: list[WorkerAddress],
    spec: dict[str, Any],
    secret: bytes,
    tls: bool,
    idle_timeout: float,
    preload: str,
    deadline: float,
) -> Any:
    """Adopts the workers (or reuses the pool that already serves them); the pool's HostMesh."""
    from .mesh import attach

    registry = Registry()
    with registry.lock(name):
        rec = registry.get(name)
        if rec is not None and not _reusable(rec, spec, secret, registry):
            _forget(rec, registry)
            rec = None
        if rec is None:
            rec = registry.new_record(name, SCHEDULER, spec, {"idle_timeout": idle_timeout})
            rec.token, rec.tls_pem = pool_key(secret).hex(), worker_tls_pem(secret) if tls else ""
            registry.save(rec)
            try:
                _adopt_all(rec, addrs, float(idle_timeout), preload, deadline)
            except BaseException:
                registry.delete(rec)
                raise
    return attach(name)


def _reusable(rec: Any, spec: dict[str, Any], secret: bytes, registry: Registry) -> bool:
    """Whether a pool of these workers from an earlier attach still serves, with this secret."""
    from ..pool import Pool

    if rec.scheduler != SCHEDULER or rec.spec != spec or rec.token != pool_key(secret).hex():
        return False
    return all(h.ok for h in Pool(rec, registry).health())


def _forget(rec: Any, registry: Registry) -> None:
    """A stale record of these workers: ask what still serves it to stop, then forget it."""
    from ..pool import Pool

    pool = Pool(rec, registry)
    pool.ask("shutdown", [i for i, h in enumerate(pool.hosts) if h is not None], timeout=5.0, reason="attached again")
    registry.delete(rec)


def _adopt_all(rec: Any, addrs: list[WorkerAddress], idle_timeout: float, preload: str, deadline: float) -> None:
    from concurrent.futures import ThreadPoolExecutor

    creds = rec.credentials  # the workers' key and certificate, installed in the pool's state dir

    def one(i: int) -> None:
        adoption = Adoption(rec.name, i, uuid.uuid4().hex[:12], idle_timeout, preload)
        reply = _adopt(addrs[i], creds, adoption, deadline)
        Registry.publish_host(
            Path(rec.state_dir),
            HostAddr(
                index=i,
                host=addrs[i].host,
                port=addrs[i].port,
                hostname=str(reply.get("hostname", "")),
                pid=int(reply.get("pid", 0)),
                incarnation=adoption.incarnation,
                started=time.time(),
                last_work=time.time(),
            ),
        )
        _wait_serving(rec, i, addrs[i], deadline)

    with ThreadPoolExecutor(max_workers=min(32, len(addrs))) as ex:
        errors = [f.exception() for f in [ex.submit(one, i) for i in range(len(addrs))]]
    failed = [e for e in errors if e is not None]
    if failed:
        raise failed[0] if isinstance(failed[0], MonarchError) else MonarchError(str(failed[0]))


def _adopt(addr: WorkerAddress, creds: PoolCredentials, adoption: Adoption, deadline: float) -> dict[str, Any]:
    """Asks one worker to serve as host ``adoption.index``, retrying while it is not listening yet."""
    delay = 0.02
    rejected = 0
    while True:
        try:
            with net.Client(addr.host, addr.port, creds, timeout=10.0, identity=addr.identity()) as c:
                return c.call("adopt", **asdict(adoption))
        except (net.HandshakeRefused, net.ProofRejected) as e:
            rejected += 1
            if isinstance(e, net.HandshakeRefused) or rejected >= 3:  # (once could be a flood shedding us)
                raise WorkerRefused(
                    f"worker {addr.text} refused us: it serves another client's hosts, or was "
                    f"started with another secret (ca=...)"
                ) from None
        except net.RemoteError as e:
            raise WorkerRefused(f"worker {addr.text}: {e}") from None
        except (net.ConnectFailed, net.PeerClosed, net.PeerTimeout) as e:
            if time.monotonic() > deadline:
                # (Monarch's words lead: the adoption is where the host gets its settings pushed)
                raise MonarchError(
                    f"attach failed: config push failed during attach: worker {addr.text} is not reachable "
                    f"({e}); is run_worker_loop_forever running there? (the wait is "
                    f"mesh_attach_config_timeout, else MONARCH_TORCHX_ATTACH_TIMEOUT_S)"
                ) from None
        time.sleep(delay)
        delay = min(delay * 2, 0.25)


def _wait_serving(rec: Any, index: int, addr: WorkerAddress, deadline: float) -> None:
    """Until the adopted worker answers as the pool's agent (it reopens its port to do so)."""
    from ..pool import Pool

    pool = Pool(rec, Registry())
    delay = 0.01
    while True:
        try:
            pool.call(index, "info", timeout=10.0)
            return
        except (MonarchError, net.WireError) as e:
            if time.monotonic() > deadline:
                raise MonarchError(f"worker {addr.text} was adopted but does not serve as host {index}: {e}") from None
        time.sleep(delay)
        delay = min(delay * 2, 0.25)
