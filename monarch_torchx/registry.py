"""The pool registry: which pools exist, how to reach their agents, and what runs on them.

Everything lives under ``$MONARCH_TORCHX_HOME`` (default ``~/.monarch_torchx``) so any later
process (another shell, `torchx status`, a submitit job) can find a pool by name::

    pools/NAME.json        PoolRecord (mode 0600: it holds the pool's secret)
    pools/NAME.lock        flock: create/replace/repair of one pool name is serialized
    stopped/NAME.json      the state dirs of stopped pools of this name (history.py)
    pools/NAME/            the pool's state dir (0700)
        hosts/I.json       written by agent I when it listens (address, pid, incarnation)
        apps/APP.json      one AppRecord per app run on the pool
        ended/APP/...      how each of its replicas ended (history.py): outlives the pool
        logs/...           agents' own logs and per-replica stdout/stderr

For SLURM the state dir sits on the shared file system (the job dir), so agents on other
nodes publish their addresses through it.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import functools
import json
import os
import re
import secrets
import shutil
import stat
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from . import history
from .credentials import TLS_FILE, TOKEN_FILE, PoolCredentials, check_tls_pem, new_tls_pem
from .errors import HomeUnusable, MonarchError, PoolNotFound
from .private import PrivatePathError, private_dir, write_private_bytes
from .specs import known_fields

VIEW_FILE = "hosts/view.json"  # every host's address in one file (see Registry.read_view)
CLOCK_FILE = "hosts/clock"  # touched to read the file system's "now" (Registry.host_file_age)
CHECK_FILE = "hosts/check-first"  # a run found a host unwell: the next one checks the pool before it launches
MONARCH_JOBS_DIR = "monarch_jobs"  # the TLS files of real-Monarch jobs on the pool (monarch_backend.py)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def home() -> Path:
    """The registry home. One that exists must be readable by this user: checked here, where
    every command starts, so another user's home is one line naming its owner (and what to
    do) rather than a "corrupt" record or a traceback deeper down."""
    path = Path(os.environ.get("MONARCH_TORCHX_HOME") or Path.home() / ".monarch_torchx")
    try:
        st = path.stat()
    except FileNotFoundError:
        return path  # made on first use (Registry._ensure_dirs)
    except OSError as e:  # a parent we may not search: another user's tree
        raise HomeUnusable(f"the monarch-torchx home {path} cannot be reached ({e.strerror}): {_OTHER_HOME}") from None
    if not os.access(path, os.R_OK | os.X_OK):
        raise HomeUnusable(
            f"the monarch-torchx home {path} is not readable by you ({_whose(path, st)}): "
            + (_OTHER_HOME if st.st_uid != os.getuid() else f"`chmod 700 {path}`")
        )
    return path


# what to do about a home that is not this user's (a shared MONARCH_TORCHX_HOME, a copied env)
_OTHER_HOME = "set MONARCH_TORCHX_HOME to a directory of your own (e.g. export MONARCH_TORCHX_HOME=~/.monarch_torchx)"


def _whose(path: Path, st: os.stat_result) -> str:
    """Who may use ``path``, as the reason this user may not: its owner, else its mode."""
    if st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}, you are uid {os.getuid()}"
    return f"mode {stat.S_IMODE(st.st_mode):o}"


def _unwritable(path: Path, err: OSError | None) -> str:
    """Why this user cannot write ``path`` (or, where it is not there yet, the directory it
    would be made in): a read-only file system, its owner or its mode; and what to do, as one line."""
    where = path if path.exists() else path.parent
    try:
        read_only = bool(os.statvfs(where).f_flag & os.ST_RDONLY) or (err is not None and err.errno == errno.EROFS)
        st = where.stat()
    except OSError:
        return f"cannot keep pools in {where}: {err.strerror if err else 'it cannot be written'}; {_OTHER_HOME}"
    if read_only:
        return f"cannot keep pools in {where}: it is on a read-only file system; {_OTHER_HOME}"
    fix = _OTHER_HOME if st.st_uid != os.getuid() else f"`chmod 700 {where}`, or {_OTHER_HOME}"
    return f"cannot keep pools in {where}: it is not writable by you ({_whose(where, st)}); {fix}"


# how each engine's pool is sized, with the option a first pool most often needs
_CREATE_EXAMPLES = {
    "monarch_local": "hosts=2",
    "monarch_slurm": "nodes=2,partition=PARTITION,time=01:00:00",
    "monarch_kubernetes": "replicas=2,image=IMAGE,namespace=NAMESPACE",
}


def create_hint(name: str, scheduler: str | None = None) -> str:
    """The command that creates pool ``name``: for ``scheduler``, else for each engine."""
    engines = [scheduler] if scheduler in _CREATE_EXAMPLES else list(_CREATE_EXAMPLES)
    cmds = [f"`torchx pool create {name} -s {s} -cfg {_CREATE_EXAMPLES[s]}`" for s in engines]
    return cmds[0] if len(cmds) == 1 else f"{cmds[0]} (or on SLURM {cmds[1]}, on Kubernetes {cmds[2]})"


def check_pool_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise MonarchError(
            f"invalid pool name {name!r}: use letters, digits, '.', '_' or '-' (at most 63, no leading punctuation)"
        )
    return name


def write_private(path: Path, data: str) -> None:
    """Atomically writes a 0600 file (readers see the old or the new content, never half)."""
    write_private_bytes(path, data.encode())


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except PermissionError:  # not corrupt: another user's (or a closed) file; nothing to remove
        raise HomeUnusable(_unreadable(path)) from None
    except OSError as e:
        raise MonarchError(f"cannot read registry file {path}: {e.strerror}") from None
    except ValueError as e:
        raise MonarchError(
            f"corrupt registry file {path}: {e}; remove it to start over "
            "(for a pool's record: `torchx pool stop --force NAME`)"
        ) from None
    if not isinstance(data, dict):
        raise MonarchError(f"corrupt registry file {path}: not a JSON object; remove it to start over")
    return data


def _unreadable(path: Path) -> str:
    """Why this user may not read a registry file (the first level of its path they may not
    enter or read, and whose it is), and what to do, as one line."""
    for p in [*reversed(path.parents), path]:
        try:
            st = p.stat()
        except OSError:
            break
        if not os.access(p, os.R_OK | (os.X_OK if p != path else 0)):
            return f"{path} is not readable by you ({p}: {_whose(p, st)}); {_OTHER_HOME}"
    return f"{path} is not readable by you; {_OTHER_HOME}"


@dataclass
class HostAddr:
    """Where agent ``index`` of a pool listens; written by the agent itself."""

    index: int
    host: str
    port: int
    hostname: str
    pid: int
    incarnation: str
    started: float = 0.0
    heartbeat: float = 0.0
    exited: float = 0.0
    exit_reason: str = ""
    # it left by its own idle timeout: a grown pool's further allocation that idled out is given
    # back (the pool shrinks), not read as lost and submitted again
    exited_idle: bool = False
    last_work: float = 0.0  # when this host last ran or was asked to run something (now, if busy)
    via: str = ""  # how clients reach it when not directly ("k8s-portforward:NS/POD"); "" = host:port
    # a successor's (``--standby``, in ``hosts/N.next.json``): what was synced to the pool was
    # replayed to it, so host N's agent may hand its index over to it (``agent/handover.py``)
    armed: bool = False

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def same_agent(self, other: HostAddr | None) -> bool:
        """Whether ``other`` is this very agent, reached the same way (heartbeats aside)."""
        return other is not None and (
            self.host,
            self.port,
            self.incarnation,
            self.pid,
            self.via,
            bool(self.exited),
        ) == (other.host, other.port, other.incarnation, other.pid, other.via, bool(other.exited))

    def identity(self, pool: str) -> bytes:
        """What both handshake MACs cover: this agent and no other."""
        return f"{pool}/{self.index}/{self.incarnation}".encode()

    @classmethod
    def from_file(cls, data: dict[str, Any]) -> HostAddr:
        """From an agent's host file. Fields this version does not know are left out: an agent of
        a newer version (a pool kept warm across an upgrade of its client) is still read."""
        return cls(**known_fields(cls, data))


@dataclass
class PoolRecord:
    """A pool as the registry knows it. ``spec`` is the fingerprint that decides reuse."""

    name: str
    scheduler: str
    spec: dict[str, Any]
    token: str
    state_dir: str
    created: float = field(default_factory=time.time)
    allocation: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    tls_pem: str = ""  # the pool's certificate and key ("" = plaintext frames: a loopback pool)

    @property
    def key(self) -> bytes:
        return bytes.fromhex(self.token)

    @functools.cached_property
    def credentials(self) -> PoolCredentials:
        """What this client dials the pool's agents and procs with (its TLS contexts built once)."""
        return PoolCredentials(self.key, str(Path(self.state_dir) / TLS_FILE) if self.tls_pem else None)

    @property
    def num_hosts(self) -> int:
        return int(self.spec["hosts"])

    @property
    def path(self) -> Path:
        return Path(self.state_dir)


@dataclass
class Placement:
    role: str
    replica_id: int
    host_index: int
    incarnation: str
    requeues: int = 0  # times it was started again on another host after its host was lost

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Placement:
        return cls(**known_fields(cls, d))


@dataclass
class AppRecord:
    """An app as submitted: enough to describe it even when an agent is gone."""

    app_id: str
    pool: str
    name: str
    roles: list[dict[str, Any]]
    placement: list[Placement]
    created: float = field(default_factory=time.time)
    # the launched specs (``LaunchSpec`` as dicts) of replicas that may start again on another
    # host if theirs is lost (``max_retries``, a submitit job's requeue): ``apps.requeue_lost``
    retry_specs: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_json(cls, data: dict) -> AppRecord:
        data = known_fields(cls, data)
        data["placement"] = [Placement.from_wire(p) for p in data["placement"]]
        return cls(**data)


class Registry:
    """Reads and writes pool and app records under one home directory."""

    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root else home()
        self.pools_dir = self.root / "pools"
        self.stopped_dir = self.root / "stopped"  # stopped pools' state dirs, by name (history.py)

    def _ensure_dirs(self) -> None:
        """The home and its pools dir: ours, private, and under parents no one else can write."""
        try:
            private_dir(self.pools_dir, from_=self.root)
        except PrivatePathError as e:
            raise MonarchError(f"refusing to keep pool secrets here: {e}") from None
        except OSError as e:  # a read-only mount, a home of mode 0500: one line, not a traceback
            raise HomeUnusable(_unwritable(Path(e.filename) if e.filename else self.root, e)) from None
        # an existing pools dir on a read-only mount passes the check above: its lock and
        # record files could not be written
        if not os.access(self.pools_dir, os.W_OK | os.X_OK):
            raise HomeUnusable(_unwritable(self.pools_dir, None))

    def record_path(self, name: str) -> Path:
        return self.pools_dir / f"{check_pool_name(name)}.json"

    def state_dir(self, name: str) -> Path:
        return self.pools_dir / check_pool_name(name)

    @contextlib.contextmanager
    def lock(self, name: str, on_wait: Callable[[str], None] = lambda _m: None, wait: bool = True) -> Iterator[bool]:
        """Exclusive lock on one pool name, across processes (two `torchx run` at once); yields
        whether it was had. ``wait=False``: at once, False when another process holds it (for what
        may as well be done later, or by someone else: never worth a wait on a long repair)."""
        self._ensure_dirs()
        fd = os.open(self.pools_dir / f"{check_pool_name(name)}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not wait:
                    yield False
                    return
                on_wait(f"waiting for another process that is creating or repairing pool {name!r}")
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield True
        finally:
            os.close(fd)

    # ------------------------------------------------------------ pools

    def new_record(self, name: str, scheduler: str, spec: dict[str, Any], options: dict[str, Any]) -> PoolRecord:
        """A fresh record with a new secret; the state dir is created (0700), not yet saved.

        The state dir is ``pools/NAME`` unless ``options["job_dir"]`` names a (shared) directory.
        """
        self._ensure_dirs()
        state = (
            Path(options["job_dir"]).expanduser().absolute() / name if options.get("job_dir") else self.state_dir(name)
        )
        try:  # on shared scratch: JOB_DIR/NAME must be ours and closed, or someone could swap the token
            private_dir(state, from_=state)
        except PrivatePathError as e:
            raise MonarchError(f"refusing the pool's state dir: {e}") from None
        for sub in ("hosts", "apps", "logs"):
            private_dir(state / sub)
        return PoolRecord(
            name=name,
            scheduler=scheduler,
            spec=spec,
            token=secrets.token_hex(32),
            state_dir=str(state),
            options=options,
            tls_pem=new_tls_pem(name) if spec.get("tls") else "",
        )

    def save(self, rec: PoolRecord) -> None:
        self._ensure_dirs()
        write_private(self.record_path(rec.name), json.dumps(asdict(rec), indent=1))
        PoolCredentials.install(Path(rec.state_dir), rec.token, rec.tls_pem)

    def get(self, name: str) -> PoolRecord | None:
        path = self.record_path(name)
        data = _read_json(path)
        if not data:
            return None
        try:
            rec = PoolRecord(**data)
            rec.key, rec.num_hosts  # noqa: B018 - the fields everything relies on parse
            if rec.tls_pem:
                check_tls_pem(rec.tls_pem)
            return rec
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise MonarchError(
                f"corrupt registry file {path} ({type(e).__name__}: {e}); "
                f"`torchx pool stop --force {name}` ends its agents and removes it"
            ) from None

    def require(self, name: str, scheduler: str | None = None) -> PoolRecord:
        rec = self.get(name)
        if rec is None or (scheduler and rec.scheduler != scheduler):
            known = ", ".join(r.name for r in self.list(scheduler)) or "none"
            where = f" on {scheduler}" if scheduler else ""
            raise PoolNotFound(
                f"no pool named {name!r}{where} (known: {known}); create it with {create_hint(name, scheduler)}"
            )
        return rec

    def list(self, scheduler: str | None = None) -> builtins.list[PoolRecord]:
        if not self.pools_dir.is_dir():
            return []
        out = []
        for p in sorted(self.pools_dir.glob("*.json")):
            with contextlib.suppress(MonarchError, TypeError):
                rec = self.get(p.stem)
                if rec and (scheduler is None or rec.scheduler == scheduler):
                    out.append(rec)
        return out

    def delete(self, rec: PoolRecord) -> None:
        """Forgets a pool: its record, addresses and secrets. Its apps' records, ends and logs stay
        in its state dir, remembered under its name, so its apps still answer (``history.py``);
        stopped pools' dirs past the retention are pruned here."""
        with contextlib.suppress(OSError):  # (a pool that cannot be remembered is still stopped)
            history.remember_stopped(self.stopped_dir, rec.name, rec.scheduler, Path(rec.state_dir))
        with contextlib.suppress(FileNotFoundError):
            self.record_path(rec.name).unlink()
        for sub in ("hosts",):
            d = Path(rec.state_dir) / sub
            if d.is_dir():
                for f in d.iterdir():
                    with contextlib.suppress(OSError):
                        f.unlink()
        for name in (TOKEN_FILE, TLS_FILE):
            with contextlib.suppress(FileNotFoundError):
                (Path(rec.state_dir) / name).unlink()
        shutil.rmtree(Path(rec.state_dir) / MONARCH_JOBS_DIR, ignore_errors=True)  # their keys, with the pool
        with contextlib.suppress(OSError):
            self._prune_history(rec)

    def _prune_history(self, stopping: PoolRecord) -> None:
        """Past the retention: the old apps of the pool being stopped, and the state dirs of pools
        stopped long ago, each under its name's lock (a create of that name may be under way: then
        it is left for a later stop). The caller holds ``stopping``'s lock."""
        history.prune_old_apps(Path(stopping.state_dir))
        live = [Path(r.state_dir) for r in self.list()]
        for name in history.stopped_names(self.stopped_dir):
            if name == stopping.name:
                history.prune_stopped(self.stopped_dir, live, skip=Path(stopping.state_dir), names=[name])
                continue
            with contextlib.suppress(MonarchError), self.lock(name, wait=False) as held:
                if held:
                    history.prune_stopped(self.stopped_dir, live, names=[name])

    def stopped(self, name: str | None = None, scheduler: str | None = None) -> builtins.list[history.StoppedPool]:
        """Stopped pools whose apps are kept (``history.py``): named ``name`` (newest first), or all."""
        names = [name] if name else history.stopped_names(self.stopped_dir)
        out = []
        for n in names:
            with contextlib.suppress(MonarchError):
                check_pool_name(n)
                out += [
                    p
                    for p in history.stopped_pools(self.stopped_dir, n)
                    if scheduler is None or p.scheduler == scheduler
                ]
        return out

    # ------------------------------------------------------------ hosts

    @staticmethod
    def host_path(state_dir: str | Path, index: int, standby: bool = False) -> Path:
        """Host ``index``'s address file, or (``standby``) that of the successor waiting to take
        the index over when the allocation holding it ends (a SLURM pool's ``renew``)."""
        return Path(state_dir) / "hosts" / (f"{index}.next.json" if standby else f"{index}.json")

    @staticmethod
    def read_host(state_dir: str | Path, index: int, standby: bool = False) -> HostAddr | None:
        path = Registry.host_path(state_dir, index, standby)
        data = _read_json(path)
        try:
            return HostAddr.from_file(data) if data else None
        except TypeError as e:
            raise MonarchError(f"corrupt host file {path} ({e}); the host's agent rewrites it, or remove it") from None

    @staticmethod
    def standby_hosts(state_dir: str | Path, indices: Iterable[int]) -> dict[int, HostAddr]:
        """The successors waiting on standby, live, to take some of ``indices`` over (a renewal),
        by host; an unreadable file (being rewritten) is left out."""
        out = {}
        for i in indices:
            with contextlib.suppress(MonarchError):
                h = Registry.read_host(state_dir, i, standby=True)
                if h is not None and not h.exited:
                    out[i] = h
        return out

    @staticmethod
    def host_file_age(state_dir: Path, index: int) -> float | None:
        """Seconds since agent ``index`` last wrote its host file (its heartbeat), or None if that
        cannot be told. Read on one clock, the file system's: the file's mtime against a file we
        touch now. Comparing the agent's clock with ours would call a healthy host dead as soon
        as the two machines disagree by more than the grace (a client clock 2 minutes ahead)."""
        try:
            written = os.stat(Path(state_dir) / "hosts" / f"{index}.json").st_mtime
            fd = os.open(Path(state_dir) / CLOCK_FILE, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError:  # no file yet, or a full or read-only file system: nothing to compare with
            return None
        try:
            os.utime(fd)  # "now", stamped as the file system stamps the agent's writes
            now = os.fstat(fd).st_mtime
        except OSError:
            return None
        finally:
            os.close(fd)
        return max(0.0, now - written)

    @staticmethod
    def hosts(rec: PoolRecord) -> builtins.list[HostAddr | None]:
        """The agents' published addresses by index, each from its own file (fresh heartbeats
        included); None where one has not published (yet). A client reads ``read_view`` first."""
        return [Registry.read_host(Path(rec.state_dir), i) for i in range(rec.num_hosts)]

    @staticmethod
    def publish_host(state_dir: Path, addr: HostAddr, moved: bool = True, standby: bool = False) -> None:
        """Writes host ``addr.index``'s file. ``moved`` (a new agent, a new address, an exit, not a
        heartbeat): the pool's view of addresses is dropped first, so that whoever sees the new
        file can no longer read the old view. A successor's file (``standby``) is no address of
        the pool's: the view stays."""
        if moved and not standby:
            Registry.drop_view(state_dir)
        write_private(Registry.host_path(state_dir, addr.index, standby), json.dumps(asdict(addr)))

    # A pool's view: every host's address in one file, so a client on a shared file system makes
    # one read per operation, not one per host. Written by a client that read every host's file
    # and found them all live; dropped whenever an address changes (publish_host, clear_host).
    # A view written from files read just before an agent moved can be stale: a call to such a
    # host fails its handshake (the identity names the incarnation), and the client then reads
    # that host's own file (Pool.fresh_host), which drops the view.

    @staticmethod
    def read_view(rec: PoolRecord) -> builtins.list[HostAddr | None] | None:
        """The pool's view of addresses, or None if there is none (or it is not this pool's size)."""
        path = Path(rec.state_dir) / VIEW_FILE
        try:
            data = _read_json(path)
            hosts = [HostAddr.from_file(h) for h in data["hosts"]] if data else None
        except (MonarchError, TypeError, KeyError, AttributeError):  # damaged: the host files are the truth
            return None
        if hosts is None or len(hosts) != rec.num_hosts or [h.index for h in hosts] != list(range(rec.num_hosts)):
            return None
        return list(hosts)

    @staticmethod
    def write_view(rec: PoolRecord, hosts: builtins.list[HostAddr]) -> None:
        with contextlib.suppress(OSError):  # a view is an optimisation: without one, files are read
            write_private(Path(rec.state_dir) / VIEW_FILE, json.dumps({"hosts": [asdict(h) for h in hosts]}))

    @staticmethod
    def drop_view(state_dir: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            (Path(state_dir) / VIEW_FILE).unlink()

    @staticmethod
    def want_check(state_dir: Path, why: str) -> None:
        """The next run checks the pool's health before it launches (``apps.start``): this one
        found a host unwell and, with its app on the pool, did not repair it."""
        with contextlib.suppress(OSError):
            write_private(Path(state_dir) / CHECK_FILE, why)

    @staticmethod
    def check_wanted(rec: PoolRecord) -> bool:
        return (Path(rec.state_dir) / CHECK_FILE).exists()

    @staticmethod
    def check_done(rec: PoolRecord) -> None:
        with contextlib.suppress(FileNotFoundError):
            (Path(rec.state_dir) / CHECK_FILE).unlink()

    @staticmethod
    def install_credentials(state_dir: Path, token: str, tls_pem: str = "") -> None:
        """Writes the pool's secret (and certificate) where agents and procs read them, for hosts
        without the client's files (Kubernetes): 0600, in a state dir that is checked to be
        ours and private first, an existing one included."""
        for sub in ("", "hosts", "apps", "logs"):
            private_dir(Path(state_dir) / sub)
        PoolCredentials.install(Path(state_dir), token, tls_pem)

    @staticmethod
    def clear_host(rec: PoolRecord, index: int, standby: bool = False) -> None:
        if not standby:
            Registry.drop_view(Path(rec.state_dir))
        with contextlib.suppress(FileNotFoundError):
            Registry.host_path(rec.state_dir, index, standby).unlink()

    # ------------------------------------------------------------ apps

    @staticmethod
    def save_app(rec: PoolRecord, app: AppRecord) -> None:
        write_private(Path(rec.state_dir) / "apps" / f"{app.app_id}.json", json.dumps(asdict(app)))

    @staticmethod
    def get_app(rec: PoolRecord, app_id: str) -> AppRecord | None:
        return Registry.app_in(Path(rec.state_dir), app_id)

    @staticmethod
    def app_in(state_dir: Path, app_id: str) -> AppRecord | None:
        """The record of app ``app_id`` in a (live or stopped) pool's state dir, if there."""
        if not _NAME.match(app_id):
            return None
        data = _read_json(Path(state_dir) / "apps" / f"{app_id}.json")
        return AppRecord.from_json(data) if data else None

    @staticmethod
    def delete_app(rec: PoolRecord, app_id: str) -> None:
        """Forgets an app's record (``torchx delete``): it no longer lists or describes. Logs are kept."""
        if _NAME.match(app_id):
            with contextlib.suppress(FileNotFoundError):
                (Path(rec.state_dir) / "apps" / f"{app_id}.json").unlink()
            history.forget_app(Path(rec.state_dir), app_id)

    @staticmethod
    def list_apps(rec: PoolRecord) -> builtins.list[AppRecord]:
        return Registry.apps_in(Path(rec.state_dir))

    @staticmethod
    def apps_in(state_dir: Path) -> builtins.list[AppRecord]:
        d = Path(state_dir) / "apps"
        out = []
        for p in sorted(d.glob("*.json")) if d.is_dir() else []:
            with contextlib.suppress(MonarchError, TypeError, KeyError):
                data = _read_json(p)
                if data:
                    out.append(AppRecord.from_json(data))
        return sorted(out, key=lambda a: a.created)
