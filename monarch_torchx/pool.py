"""Pools: create once, reuse by name, check health, repair, stop.

A ``Provisioner`` knows one engine (local processes, a SLURM allocation, Kubernetes pods);
everything else about a pool (the registry, agents' addresses, fingerprints, health, fan-out
calls) is the same for every engine and lives here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, NoReturn, Protocol, Sequence, cast

from . import net
from .agent_client import AgentClient
from .credentials import TLS_FILE, TOKEN_FILE
from .errors import AccessError, CreateInterrupted, HostLost, HostUnreachable, MonarchError, StartTimeout
from .net.fanout import tree_min_hosts
from .registry import HostAddr, PoolRecord, Registry, check_pool_name
from .specs import PENDING, RUNNING

if TYPE_CHECKING:
    from .submission import PoolPlan, Submission

log = logging.getLogger("monarch_torchx.pool")

PING_TIMEOUT_S = 3.0
# how long a host that did not answer the first ping is asked again before it reads as unreachable
# (a busy agent on a loaded node may take seconds to answer)
SLOW_PING_TIMEOUT_S = float(os.environ.get("MONARCH_TORCHX_SLOW_PING_S", "15"))
# a host whose heartbeat (its host file, rewritten every MONARCH_TORCHX_HEARTBEAT_WRITE_S, 30 s) is
# older than this, and that does not answer a patient probe either, is lost
HEARTBEAT_GRACE_S = float(os.environ.get("MONARCH_TORCHX_HEARTBEAT_GRACE_S", "90"))
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")


def parse_duration(value: Any, option: str = "idle_timeout") -> float:
    """'90s', '30m', '2h', '1d' or plain seconds -> seconds. '0' means never."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        m = _DURATION.match(str(value))
        if not m:
            raise MonarchError(f"{option}={value!r} is not a duration: use e.g. 90s, 30m, 2h (0 = never)")
        seconds = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    if seconds < 0:
        raise MonarchError(f"{option} must not be negative")
    return seconds


class Provisioner(Protocol):
    """What an engine must do; the rest of a pool's life is engine-independent."""

    scheduler: str
    hosts_option: str  # the run option that sizes a pool ("hosts", "nodes", "replicas")
    client_cwd_on_hosts: bool  # whether hosts see the client's file system (its cwd is valid there)
    fingerprint: Sequence[str]  # spec keys that must match for a pool to be reused
    tls_default: bool  # whether a new pool's connections are TLS unless the run says (tls=...)

    def add_run_opts(self, opts: Any) -> None:
        """Engine-specific TorchX run options."""

    def pool_spec(self, cfg: dict[str, Any], spec: dict[str, Any], options: dict[str, Any]) -> None:
        """Copies engine options from a run's cfg: into ``spec`` (must match to reuse) or ``options``."""

    def create(self, rec: PoolRecord) -> None:
        """Start one agent per host (or submit the allocation that will), filling rec.allocation."""

    def repair(self, rec: PoolRecord, indices: list[int]) -> list[int]:
        """Bring back lost hosts; returns the indices that will publish a new incarnation."""

    def release(self, rec: PoolRecord) -> None:
        """Free what the agents could not free themselves (leftover processes, the allocation)."""

    def end_leftovers(self, rec: PoolRecord, lost: list[int]) -> list[str]:
        """End what the lost hosts' agents left on their nodes (sync store, mounts, temp dirs)
        while the allocation still runs; returns what was found, a line each."""

    def wait_ready(
        self, rec: PoolRecord, indices: list[int], old: dict[int, str], timeout: float, progress: Callable[[str], None]
    ) -> None:
        """Block until the given hosts published a new incarnation; raise MonarchError otherwise."""

    def loss_reason(self, rec: PoolRecord) -> str | None:
        """Why hosts may be gone (e.g. "allocation 12 was CANCELLED"), or None."""

    def describe(self, rec: PoolRecord) -> dict[str, Any]:
        """Engine facts for `pool status` (allocation id, state, walltime left, ...)."""

    def submission(self, rec: PoolRecord) -> Submission:
        """What ``create(rec)`` would send (for dry-runs): built by the code ``create`` uses, making nothing."""

    # optional: ``resize(rec, hosts) -> (indices to wait for, their old incarnations)``,
    # ``open_tunnel(rec, addr, timeout)`` for hosts whose address has ``via`` set,
    # ``lost_hosts(rec) -> {index: why}`` where the engine knows per host (several allocations),
    # ``reuse_refusal(rec, options) -> line | None``: why a reused pool cannot serve a run's
    # options that are not part of its fingerprint (SLURM: less time left than min_time_left=),
    # and ``reuse_warnings(rec, options) -> [line]``: what it gives less of, said, not refused
    # (SLURM: less time left than time=)


class TunnelingProvisioner(Protocol):
    """The optional part of a ``Provisioner`` for engines whose host addresses have ``via`` set."""

    def open_tunnel(self, rec: PoolRecord, addr: HostAddr, timeout: float) -> Any:
        """A stream to the agent at ``addr`` (its ``sock``, and ``error()`` to explain a failure)."""


# (pool, the hosts that joined, progress): readies them before the pool's queue is handed them,
# e.g. syncfs.replay.replay_syncs (a layer above this one); raises MonarchError to give them back
JoinHook = Callable[["Pool", list[int], Callable[[str], None]], None]


@dataclass
class PoolRequest:
    """What a run asks of a pool; ``spec`` keys set to None mean "whatever the pool has".
    ``on_join``: what hosts that join by a grow get before they take work (``JoinHook``)."""

    scheduler: str
    name: str
    spec: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)
    replace: bool = False
    on_join: JoinHook | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        preload = self.spec.get("preload")
        if isinstance(preload, str):  # as in -cfg preload=...: "none" means no preloads, not a module
            self.spec = {**self.spec, "preload": preload_list(preload)}


def preload_list(text: str) -> str:
    """A preload option as the pool keeps it: module names, comma-separated; "" for none."""
    if text.strip().lower() in ("", "none"):
        return ""
    return ",".join(m.strip() for m in text.split(",") if m.strip())


OK, LOST, UNREACHABLE = "ok", "lost", "unreachable"  # a host's health: only "lost" is ever repaired


@dataclass
class HostHealth:
    index: int
    addr: HostAddr | None
    ok: bool
    info: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    state: str = OK


class Pool:
    """A handle on a live pool: its agents and a blocking client per call."""

    def __init__(self, rec: PoolRecord, registry: Registry):
        self.record = rec
        self.registry = registry
        self._hosts: list[HostAddr | None] | None = None
        self._provisioner: Provisioner | None = None
        self._engine_loss: tuple[float, str | dict[int, str] | None] | None = None  # (when asked, the answer)
        self._patient: dict[tuple[int, str, int], bool] = {}  # (index, incarnation, port) -> answered a patient ping
        self.unreachable: list[int] = []  # hosts ensure_pool's check left be: unreachable, not known to be lost

    # Two methods this handle offered once, now where they belong: the pool layer does not import the
    # services above it (the README's layers). Kept one release, to say where they went.
    def sync(self, *_args: Any, **_kwargs: Any) -> NoReturn:
        raise AttributeError("Pool.sync() moved: use monarch_torchx.syncfs.sync(pool, src, target)")

    def sql(self, *_args: Any, **_kwargs: Any) -> NoReturn:
        raise AttributeError("Pool.sql() moved: use monarch_torchx.telemetry.sql(pool, query)")

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def hosts(self) -> list[HostAddr | None]:
        """Every host's address: from the pool's view (one file), else from each host's file,
        which then become the view. Heartbeats in it may be old: ``fresh_host`` reads one host's."""
        if self._hosts is None:
            hosts = self.registry.read_view(self.record)
            if hosts is None:
                hosts = self.registry.hosts(self.record)
                if all(h is not None and not h.exited for h in hosts):
                    self.registry.write_view(self.record, [h for h in hosts if h is not None])
            self._hosts = hosts
        return self._hosts

    def fresh_host(self, index: int) -> HostAddr | None:
        """Host ``index`` as its own file says now (its heartbeat, whether it exited or moved). If
        it moved, the address this handle and the pool's view had was stale: both are corrected."""
        if not 0 <= index < self.record.num_hosts:
            return None
        fresh = self.registry.read_host(self.record.path, index)
        if self._hosts is not None:
            old = self._hosts[index]
            self._hosts[index] = fresh
            if fresh is None or not fresh.same_agent(old):
                self.registry.drop_view(self.record.path)
        return fresh

    def host(self, index: int) -> HostAddr | None:
        """Host ``index``'s address: from the pool's list if it was read, else from its own file
        alone (a call to one host need not read the addresses of all)."""
        if self._hosts is not None:
            return self._hosts[index] if 0 <= index < len(self._hosts) else None
        if not 0 <= index < self.record.num_hosts:
            return None
        return self.registry.read_host(self.record.path, index)

    def refresh(self) -> None:
        self._hosts = None

    def successors(self, indices: Sequence[int]) -> Pool:
        """A handle whose calls to hosts ``indices`` reach the successors waiting on standby to take
        them over (a SLURM pool's renewal, ``agent/handover.py``), not the agents serving them now:
        what is synced to the pool is replayed to them through it."""
        view = Pool(self.record, self.registry)
        view._hosts = [
            self.registry.read_host(self.record.path, i, standby=i in indices) for i in range(self.record.num_hosts)
        ]
        return view

    @property
    def provisioner(self) -> Provisioner:
        """The engine's provisioner, kept for this handle's life (it may hold an API client)."""
        if self._provisioner is None:
            self._provisioner = get_provisioner(self.record.scheduler)
        return self._provisioner

    def connect(self, index: int, timeout: float = PING_TIMEOUT_S) -> AgentClient:
        addr = self.host(index)
        if addr is None:
            raise MonarchError(f"host {index} of pool {self.name!r} has no agent address (not started yet?)")
        if addr.exited:
            raise MonarchError(f"host {index} of pool {self.name!r} is stopped ({addr.exit_reason})")
        tunnel = None
        if addr.via:  # e.g. a Kubernetes port-forward: the engine opens the stream
            try:
                # only engines that define open_tunnel publish addresses with ``via``
                tunnel = cast(TunnelingProvisioner, self.provisioner).open_tunnel(self.record, addr, timeout)
            except AccessError:
                raise
            except MonarchError as e:  # the pod behind it is gone or not running
                raise HostLost(f"host {index} of pool {self.name!r} is lost: {e}", index) from None
        try:
            return AgentClient(
                addr.host,
                addr.port,
                self.record.credentials,
                timeout=timeout,
                identity=addr.identity(self.name),
                sock=tunnel.sock if tunnel else None,
            )
        except net.WireError as e:
            why = tunnel.error() if tunnel else ""
            raise HostUnreachable(f"host {index} of pool {self.name!r} is unreachable: {why or e}", index, e) from None

    def call(self, index: int, op: str, timeout: float = 30.0, **args: Any) -> Any:
        return self._calls(index, op, timeout, [args])[0]

    def _calls(self, index: int, op: str, timeout: float, arg_list: list[dict[str, Any]]) -> list[Any]:
        """``op`` with each of ``arg_list`` in turn, on one connection to host ``index``."""
        with self.connect(index) as c:
            c.settimeout(timeout)
            try:
                return [c.call(op, **a) for a in arg_list]
            except net.WireError as e:
                raise HostUnreachable(f"host {index} of pool {self.name!r} is unreachable: {e}", index, e) from None

    def loss_evidence(self, index: int, err: BaseException | None = None) -> str | None:
        """Why host ``index`` is gone, on evidence, or None.

        Evidence: its engine says it ended (process gone, allocation or pod over), the agent
        published its exit, its host refused the connection (nothing listens on the agent's port:
        ``err``), or its heartbeat is older than HEARTBEAT_GRACE_S *and* it does not answer a
        patient probe (SLOW_PING_TIMEOUT_S) either. A connection that timed out or was dropped is
        not evidence: a flooded, busy or briefly cut-off host looks the same, and so does a host
        whose heartbeat stopped because its disk is full. The heartbeat's age is read on the file
        system's clock (``Registry.host_file_age``), never by comparing our clock with the agent's.
        """
        addr = self.fresh_host(index)
        why = self._engine_loss_reason(index)  # the engine's word first: it says why
        if why:
            return why
        if addr is None:
            return f"host {index} has no agent"
        gone = getattr(self.provisioner, "host_gone", None)
        why = gone(self.record, addr) if gone else None
        if why:
            return why
        if addr.exited:
            return f"host {index} stopped ({addr.exit_reason})"
        cause = err.cause if isinstance(err, HostUnreachable) else None
        if isinstance(cause, net.ConnectFailed) and cause.refused:
            return f"nothing listens on host {index}'s agent port ({addr.address}): its agent is gone"
        age = Registry.host_file_age(Path(self.record.state_dir), index)
        if age is not None and age > HEARTBEAT_GRACE_S and not self._answers_patiently(addr):
            return (
                f"host {index} has not heartbeaten for {age:.0f} s and did not answer a patient probe "
                f"({SLOW_PING_TIMEOUT_S:.0f} s)"
            )
        return None

    def _answers_patiently(self, addr: HostAddr) -> bool:
        """Whether the agent at ``addr`` answers a ping within SLOW_PING_TIMEOUT_S (asked once per
        agent for this handle's life: one health check weighs the evidence several times)."""
        key = (addr.index, addr.incarnation, addr.port)
        if key not in self._patient:
            try:
                with self.connect(addr.index, timeout=SLOW_PING_TIMEOUT_S) as c:
                    c.settimeout(SLOW_PING_TIMEOUT_S)
                    c.call("ping")
                self._patient[key] = True
            except AccessError:
                self._patient[key] = True  # our access is broken, not the host: no evidence either way
            except (HostUnreachable, HostLost, net.WireError):
                self._patient[key] = False
            except (MonarchError, net.RemoteError):  # it answered, with an error (e.g. shutting down): alive
                self._patient[key] = True
        return self._patient[key]

    def _engine_loss_reason(self, index: int) -> str | None:
        """Why the engine says host ``index`` is gone: its ``lost_hosts`` (per host, where a pool
        spans several allocations) or else its ``loss_reason`` (the whole pool), asked once a
        second at most: on SLURM it runs squeue, and one health check may weigh the evidence for
        every host of a pool."""
        now = time.monotonic()
        if self._engine_loss is None or now - self._engine_loss[0] > 1.0:
            per_host = getattr(self.provisioner, "lost_hosts", None)
            found = per_host(self.record) if per_host is not None else self.provisioner.loss_reason(self.record)
            self._engine_loss = (now, found)
        found = self._engine_loss[1]
        return found.get(index) if isinstance(found, dict) else found

    def ask(
        self,
        op: str,
        indices: Sequence[int],
        timeout: float = 10.0,
        calls: dict[int, list[dict]] | None = None,
        **args: Any,
    ) -> list[tuple[int, Any, Exception | None]]:
        """Runs agent operation ``op`` on each host of ``indices`` (with ``args``, or with each of
        ``calls[i]`` in turn, giving the list of their values); returns (index, value, error) in
        order, the errors as a direct call would raise them (HostUnreachable when a host was not
        reached). From MONARCH_TORCHX_TREE_MIN_HOSTS hosts on, through the agents' relay tree
        (``agent/relay.py``): the client opens a few connections, not one per host; ``timeout``
        then bounds the whole operation."""
        indices = list(indices)
        if len(indices) > 1:
            self.hosts  # noqa: B018 (many hosts: one read of the pool's view, not one file each)
        if len(indices) < tree_min_hosts():
            if calls is not None:
                return self.fan_out(lambda i: self._calls(i, op, timeout, calls.get(i, [])), indices)
            return self.fan_out(lambda i: self._calls(i, op, timeout, [args])[0], indices)
        return self._ask_tree(op, indices, timeout, calls, args)

    def _ask_tree(
        self, op: str, indices: list[int], timeout: float, calls: dict[int, list[dict]] | None, args: dict[str, Any]
    ) -> list[tuple[int, Any, Exception | None]]:
        from .net.fanout import ask_tree

        targets, errors, tunnel = self.tree_targets(indices)
        outcomes = ask_tree(targets, self.record.credentials, op, args or None, calls, timeout, tunnel)
        out: list[tuple[int, Any, Exception | None]] = []
        for i in indices:
            o = outcomes.get(i)
            if i in errors:
                out.append((i, None, errors[i]))
            elif o is None:
                out.append((i, None, HostUnreachable(f"host {i} of pool {self.name!r} did not answer", i, None)))
            elif o["ok"]:
                out.append((i, o["value"], None))
            else:
                out.append((i, None, _outcome_error(self.name, i, o)))
        return out

    def tree_targets(
        self, indices: Sequence[int]
    ) -> tuple[list[Any], dict[int, Exception], Callable[[Any, float], Any]]:
        """What a request through the relay tree needs for hosts ``indices``: a Target for each
        host with a live address, the error of each other one, and the dialer of a group's first
        member behind a port-forward (None: dial it directly)."""
        from .net.fanout import Target

        errors: dict[int, Exception] = {}
        targets: list[Target] = []
        by_index: dict[int, HostAddr] = {}
        for i in indices:
            h = self.host(i)
            if h is None:
                errors[i] = MonarchError(f"host {i} of pool {self.name!r} has no agent address (not started yet?)")
            elif h.exited:
                errors[i] = MonarchError(f"host {i} of pool {self.name!r} is stopped ({h.exit_reason})")
            else:
                by_index[i] = h
                targets.append(Target(i, h.host, h.port, h.identity(self.name).decode()))

        def tunnel(head: Target, t: float) -> Any:
            h = by_index[head.index]
            if not h.via:
                return None
            try:
                return cast(TunnelingProvisioner, self.provisioner).open_tunnel(self.record, h, t).sock
            except AccessError:
                raise
            except MonarchError as e:  # the pod behind it is gone or not running (as in ``connect``)
                raise HostLost(f"host {head.index} of pool {self.name!r} is lost: {e}", head.index) from None

        return targets, errors, tunnel

    def fan_out(self, fn: Callable[[int], Any], indices: Sequence[int]) -> list[tuple[int, Any, Exception | None]]:
        """Runs fn(index) for each index concurrently; returns (index, result, error) in order."""

        def one(i: int) -> tuple[int, Any, Exception | None]:
            try:
                return i, fn(i), None
            except (MonarchError, net.WireError, net.RemoteError, OSError) as e:
                return i, None, e

        if len(indices) <= 1:
            return [one(i) for i in indices]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(32, len(indices))) as ex:
            return list(ex.map(one, indices))

    def health(self, touch: bool = False) -> list[HostHealth]:
        """Pings every agent; ``touch`` counts as work on the pool (resets agents' idle clocks)."""
        hosts = self.hosts

        def patient_ping(i: int) -> Any:
            with self.connect(i, timeout=SLOW_PING_TIMEOUT_S) as c:
                c.settimeout(SLOW_PING_TIMEOUT_S)
                try:
                    return c.call("info", touch=touch)
                except net.WireError as e:
                    raise HostUnreachable(f"host {i} of pool {self.name!r} is unreachable: {e}", i, e) from None

        cached = list(hosts)
        res = self.ask("info", range(len(hosts)), timeout=PING_TIMEOUT_S, touch=touch)
        # no evidence it is gone, or it was asked at an address it had left: ask once more,
        # patiently (connecting included); loss_evidence reads each failed host's own file
        again = [
            i
            for i, _, err in res
            if isinstance(err, HostUnreachable)
            and (not self.loss_evidence(i, err) or not (cur := self.hosts[i]) or not cur.same_agent(cached[i]))
        ]
        if again:
            retried = {i: (v, e) for i, v, e in self.fan_out(patient_ping, again)}
            res = [(i, *retried[i]) if i in retried else (i, v, e) for i, v, e in res]
        for _, _, err in res:
            if isinstance(err, AccessError):  # our access is broken, not the hosts: nothing to repair
                raise err
        out = []
        hosts = self.hosts
        for i, info, err in res:
            if err is None:
                out.append(HostHealth(i, hosts[i], True, info or {}, "", OK))
                continue
            evidence = self.loss_evidence(i, err)
            state = LOST if evidence or not isinstance(err, HostUnreachable) else UNREACHABLE
            out.append(
                HostHealth(i, hosts[i], False, {}, self.lost_message(i, evidence, err) if evidence else str(err), state)
            )
        return out

    def lost_message(self, index: int, evidence: str, err: BaseException | None = None) -> str:
        """One line for a host lost on ``evidence`` (with what the last connection said, if any)."""
        cause = err.cause if isinstance(err, HostUnreachable) else None
        return f"host {index} of pool {self.name!r} is lost: {evidence}" + (f" (last try: {cause})" if cause else "")


_WIRE_KINDS = {
    "ConnectFailed": net.ConnectFailed,
    "PeerTimeout": net.PeerTimeout,
    "PeerClosed": net.PeerClosed,
    "ProofRejected": net.ProofRejected,
    "HandshakeRefused": net.HandshakeRefused,
    "MalformedFrame": net.MalformedFrame,
}


def _outcome_error(pool: str, index: int, o: dict[str, Any]) -> Exception:
    """A relayed host's failure as the exception a direct call would have raised."""
    if o.get("kind") == HostLost.__name__:  # (its tunnel: the client's own finding, carried by the tree)
        return HostLost(o["error"], index)
    kind = _WIRE_KINDS.get(o.get("kind", ""))
    via = f" (through host {o['via']})" if o.get("via") is not None else ""
    if kind is not None:  # the host was not reached
        cause = (
            net.ConnectFailed(o["error"], refused=bool(o.get("refused")))
            if kind is net.ConnectFailed
            else kind(o["error"])
        )
        return HostUnreachable(f"host {index} of pool {pool!r} is unreachable{via}: {o['error']}", index, cause)
    return net.remote_error(o["error"], o.get("kind", ""))


# what a pool declares of each host's capacity (run options of every engine, part of every pool's
# fingerprint): the agents detect the rest (``agent/capacity.py``)
CAPACITY_KEYS = ("cpus_per_host", "mem_per_host_mb", "gpus_per_host")


def _differing_keys(rec: PoolRecord, req: PoolRequest, prov: Provisioner) -> list[str]:
    """The spec keys where what a run asks differs from what the pool has."""
    keys = (*prov.fingerprint, *CAPACITY_KEYS)
    return [k for k in keys if req.spec.get(k) is not None and req.spec.get(k) != rec.spec.get(k)]


def _fingerprint_diff(rec: PoolRecord, req: PoolRequest, prov: Provisioner) -> list[str]:
    diffs = []
    for k in _differing_keys(rec, req, prov):
        name = prov.hosts_option if k == "hosts" else k
        diffs.append(f"{name}={rec.spec.get(k)!r} (you asked {name}={req.spec.get(k)!r})")
    return diffs


# scheduler name -> "module:class" of its provisioner, imported only when used: the engines plug in
# above this layer (``monarch_torchx.schedulers``), and a CLI run loads only the one it names
PROVISIONERS = {
    "monarch_local": "monarch_torchx.schedulers.local:LocalProvisioner",
    "monarch_slurm": "monarch_torchx.schedulers.slurm:SlurmProvisioner",
    "monarch_kubernetes": "monarch_torchx.schedulers.kubernetes:KubernetesProvisioner",
}
# engines with no TorchX scheduler of their own (pools made from Python, not by `torchx run`)
ENGINES = {
    "monarch_workers": "monarch_torchx.schedulers.workers:WorkersProvisioner",  # attach_to_workers
}


def get_provisioner(scheduler: str) -> Provisioner:
    import importlib

    target = PROVISIONERS.get(scheduler) or ENGINES.get(scheduler)
    if target is None:
        raise MonarchError(f"unknown scheduler {scheduler!r}: use one of {', '.join(PROVISIONERS)}")
    mod, _, cls = target.partition(":")
    return getattr(importlib.import_module(mod), cls)()


def _new_spec(req: PoolRequest, prov: Provisioner, defaults: dict[str, Any] | None) -> dict[str, Any]:
    """A new pool's spec: the engine's TLS default, then the caller's defaults, then what was asked."""
    return {"tls": prov.tls_default, **(defaults or {}), **{k: v for k, v in req.spec.items() if v is not None}}


def plan_pool(req: PoolRequest, registry: Registry | None = None, defaults: dict[str, Any] | None = None) -> PoolPlan:
    """What ``ensure_pool(req)`` would do, decided the same way, with nothing made or changed:
    for a pool it would create (or replace), what its engine would submit."""
    from .submission import PoolPlan, draft_record

    registry = registry or Registry()
    check_pool_name(req.name)
    prov = get_provisioner(req.scheduler)
    rec = registry.get(req.name)
    if rec is not None and rec.scheduler != req.scheduler:
        return PoolPlan("refused", f"pool {req.name!r} runs on {rec.scheduler}, not {req.scheduler}")
    action, reason = "create", ""
    if rec is not None:
        diffs = _fingerprint_diff(rec, req, prov)
        if not diffs:
            why = reuse_refusal(rec, req, prov)
            if why:
                return PoolPlan("refused", why)
            notes = "".join(f"; warning: {w}" for w in reuse_warnings(rec, req, prov))
            return PoolPlan(
                "reuse", f"pool {req.name!r} exists with {rec.num_hosts} host(s): nothing is submitted{notes}"
            )
        if _grows(rec, req, prov):
            return PoolPlan(
                "grow", f"pool {req.name!r} grows from {rec.num_hosts} to {req.spec['hosts']} host(s) in place"
            )
        if not req.replace:
            return PoolPlan("refused", f"pool {req.name!r} has {', '.join(diffs)}; use -cfg replace=True")
        action, reason = "replace", ", ".join(diffs)
    spec = _new_spec(req, prov, defaults)
    draft = draft_record(req.name, req.scheduler, spec, dict(req.options), registry)
    return PoolPlan(action, reason, prov.submission(draft))


def reuse_refusal(rec: PoolRecord, req: PoolRequest, prov: Provisioner) -> str | None:
    """Why the pool ``rec`` cannot serve ``req`` though it matches (see Provisioner), or None."""
    refuse = getattr(prov, "reuse_refusal", None)
    return refuse(rec, dict(req.options)) if refuse is not None else None


def reuse_warnings(rec: PoolRecord, req: PoolRequest, prov: Provisioner) -> list[str]:
    """What the pool ``rec``, reused for ``req``, gives less of than asked (see Provisioner)."""
    warn = getattr(prov, "reuse_warnings", None)
    return list(warn(rec, dict(req.options))) if warn is not None else []


def _check_reuse(rec: PoolRecord, req: PoolRequest, prov: Provisioner, progress: Callable[[str], None]) -> None:
    """Refuses a reuse the pool cannot serve (one line), else says what it gives less of."""
    why = reuse_refusal(rec, req, prov)
    if why:
        raise MonarchError(why)
    for w in reuse_warnings(rec, req, prov):
        progress(f"warning: {w}")


def _grows(rec: PoolRecord, req: PoolRequest, prov: Provisioner) -> bool:
    """A run with ``grow=True`` asking more hosts than the pool has, where the pool differs in
    nothing else and its engine can add hosts in place: it grows instead of being replaced."""
    want = req.spec.get("hosts")
    if not req.options.get("grow") or want is None or want <= rec.num_hosts or getattr(prov, "resize", None) is None:
        return False
    return _differing_keys(rec, req, prov) == ["hosts"]


def _grow_in_place(
    rec: PoolRecord, req: PoolRequest, registry: Registry, prov: Provisioner, progress: Callable[[str], None]
) -> None:
    progress(f"growing pool {req.name!r} from {rec.num_hosts} to {req.spec['hosts']} host(s) (grow=True)")
    _resize_locked(rec, int(req.spec["hosts"]), registry, prov, progress, req.on_join)


def ensure_pool(
    req: PoolRequest,
    registry: Registry | None = None,
    defaults: dict[str, Any] | None = None,
    progress: Callable[[str], None] = lambda _m: None,
) -> Pool:
    """Returns a healthy pool serving ``req``: reused, repaired, replaced or created.

    Serialized per pool name across processes, so two concurrent runs never create two pools.
    """
    registry = registry or Registry()
    check_pool_name(req.name)
    prov = get_provisioner(req.scheduler)
    with registry.lock(req.name, on_wait=progress):
        rec = registry.get(req.name)
        if rec is not None and rec.scheduler != req.scheduler:
            raise MonarchError(
                f"pool {req.name!r} runs on {rec.scheduler}, not {req.scheduler}: "
                f"use -s {rec.scheduler} or another pool name"
            )
        if rec is not None:
            _give_back_idled(rec, registry, prov, progress)
        if rec is not None and _grows(rec, req, prov):
            _grow_in_place(rec, req, registry, prov, progress)
        if rec is not None:
            diffs = _fingerprint_diff(rec, req, prov)
            if diffs and not req.replace:
                raise MonarchError(
                    f"pool {req.name!r} has {', '.join(diffs)}; "
                    f"use -cfg replace=True to replace it, or another pool name"
                )
            if diffs:
                progress(f"replacing pool {req.name!r} ({', '.join(diffs)})")
                _stop(Pool(rec, registry), prov, "replaced")
                rec = None
            else:
                _check_reuse(rec, req, prov, progress)
        if rec is None:
            spec = _new_spec(req, prov, defaults)
            rec = registry.new_record(req.name, req.scheduler, spec, req.options)
            registry.save(rec)
            progress(f"creating pool {req.name!r} with {rec.num_hosts} host(s) on {req.scheduler}")
            try:
                with _interrupt_after():
                    prov.create(rec)
                    registry.save(rec)
                prov.wait_ready(rec, list(range(rec.num_hosts)), {}, _start_timeout(rec), progress)
                pool = Pool(rec, registry)
                infos = wait_warm(pool, progress, _start_timeout(rec))  # (Ctrl-C here too: not ready yet)
            except BaseException as e:
                stopped = _undo_start(rec, registry, prov)
                if isinstance(e, KeyboardInterrupt):  # the CLI says what was left, in one line
                    raise CreateInterrupted(req.name, stopped) from None
                raise
            _check_preloads(pool, req, prov, infos, progress)
            return pool
        pool = Pool(rec, registry)
        health = pool.health(touch=True)
        if warming_hosts([h.info if h.ok else {} for h in health]):
            wait_warm(pool, progress, _start_timeout(rec))
        for h in health:
            if h.state == UNREACHABLE:  # never repaired (killed) on one failed connection
                progress(f"host {h.index} is unreachable but not known to be lost ({h.error}); leaving it be")
        unreachable = [h.index for h in health if h.state == UNREACHABLE]
        dead = [h.index for h in health if h.state == LOST]
        if dead:
            progress(f"repairing pool {req.name!r}: host(s) {dead} lost")
            old = {h.index: h.addr.incarnation for h in health if h.addr}
            try:
                restarting = prov.repair(rec, dead)
                unreachable = [i for i in unreachable if i not in restarting]  # (SLURM restarts every host)
                registry.save(rec)
                prov.wait_ready(rec, restarting, old, _start_timeout(rec), progress)
            except BaseException as e:
                with contextlib.suppress(Exception):
                    _stop(pool, prov, "failed to repair")
                if isinstance(e, MonarchError):
                    raise MonarchError(f"{e} (pool {req.name!r} was released; the next run creates it anew)") from None
                raise
            pool.refresh()
            wait_warm(pool, progress, _start_timeout(rec))
        pool.unreachable = unreachable
        registry.check_done(rec)
        return pool


@contextlib.contextmanager
def _interrupt_after() -> Iterator[None]:
    """Holds Ctrl-C off until the block ends, then raises it. The engine is asked for the hosts
    there (agents spawned, an sbatch): an interrupt in the middle could leave an agent started
    but not recorded, which nothing would stop. (Main thread with Python's own SIGINT handler
    only: elsewhere the handler is the caller's to keep.)"""
    import threading

    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    interrupted: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _frame: interrupted.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if interrupted:
        raise KeyboardInterrupt


def _undo_start(rec: PoolRecord, registry: Registry, prov: Provisioner) -> bool:
    """Stops a pool whose creation did not finish (it failed, or Ctrl-C): its agents, its
    allocation, its record. True once stopped; False where that failed or a second Ctrl-C cut it
    short, so the caller names the command that stops it (nothing is left warm unsaid)."""
    try:
        _stop(Pool(rec, registry), prov, "failed to start")
        return True
    except (Exception, KeyboardInterrupt):  # noqa: BLE001 (whatever it was, the pool is named to the user)
        return False


def reuse_unchecked(
    req: PoolRequest,
    registry: Registry | None = None,
    progress: Callable[[str], None] = lambda _m: None,
    min_hosts: int = 0,
) -> Pool | None:
    """The existing pool that serves ``req``, with none of its hosts asked: for a run whose first
    request to the hosts checks them too (``apps.start``'s launch, a submitit submission's ask
    for the hosts' load). None where ``ensure_pool`` checks first: no such pool, another engine
    or a changed spec, no pool view (a host moved since), a check that
    a run asked for (``Registry.want_check``: it found a host unwell), or a host with evidence of
    loss at hand without asking it (exited in the view, or gone by its engine's word: on
    ``monarch_local``, its process)."""
    registry = registry or Registry()
    check_pool_name(req.name)
    prov = get_provisioner(req.scheduler)
    with registry.lock(req.name, on_wait=progress):  # a pool being created or repaired: wait, as ensure_pool does
        rec = registry.get(req.name)
        if rec is None or rec.scheduler != req.scheduler or _fingerprint_diff(rec, req, prov):
            return None
        if rec.num_hosts < min_hosts:  # (the caller checks a pool this small first: ensure_pool says its warnings)
            return None
        if registry.read_view(rec) is None or registry.check_wanted(rec):
            return None
        pool = Pool(rec, registry)
        hosts = pool.hosts
        gone = getattr(prov, "host_gone", None)
        if any(h is None or h.exited or (gone is not None and gone(rec, h)) for h in hosts):
            return None
        _check_reuse(rec, req, prov, progress)
        return pool


def warming_hosts(infos: Sequence[dict[str, Any]]) -> list[int]:
    """Indices of hosts whose warm fork server is still importing the pool's preloads."""
    return [i for i, info in enumerate(infos) if (info or {}).get("warm", {}).get("state") == "importing"]


def preload_failure(infos: Sequence[dict[str, Any]]) -> str:
    """The first host's failed preload, as one line ("" when none failed): a module that could
    not be imported, or a warm fork server that died importing."""
    for i, info in enumerate(infos):
        warm = (info or {}).get("warm", {})
        for mod, err in (warm.get("failed") or {}).items():
            return f"preload of {mod!r} failed on host {i}: {err}"
        if warm.get("state") == "dead":
            return f"preload of {','.join(warm.get('preloads') or [])!r} failed on host {i}: {warm.get('error')}"
    return ""


def _check_preloads(
    pool: Pool, req: PoolRequest, prov: Provisioner, infos: Sequence[dict[str, Any]], progress: Callable[[str], None]
) -> None:
    """A new pool whose asked-for preloads failed is stopped and the creation fails, in one line:
    a typo would otherwise give a "healthy" pool that silently starts everything cold. The
    default preload (torch, not asked for) only warns: a pool for apps without torch is fine."""
    failure = preload_failure(infos)
    if not failure:
        return
    if req.spec.get("preload") is None:
        progress(f"warning: {failure}; Python entrypoints start cold (-cfg preload=none for no preloads)")
        return
    with contextlib.suppress(Exception):
        _stop(pool, prov, "preload failed")
    raise MonarchError(f"{failure}; fix -cfg preload=... (none = no preloads)")


def wait_warm(pool: Pool, progress: Callable[[str], None], timeout: float) -> list[dict[str, Any]]:
    """Blocks until every host has imported its preloads, so "ready" means the next run starts warm.
    Returns the hosts' last info (``{}`` for one that did not answer).

    A host that does not finish in time is reported and the wait ends: its runs start cold.
    """
    deadline = time.time() + timeout
    said = False
    while True:
        infos = [h.info if h.ok else {} for h in pool.health()]
        warming = warming_hosts(infos)
        if not warming:
            return infos
        if not said:
            mods = ",".join(infos[warming[0]].get("warm", {}).get("preloads") or []) or "preloads"
            progress(f"warming: importing {mods} on {len(warming)} host(s)")
            said = True
        if time.time() > deadline:
            progress(f"host(s) {warming} still importing after {timeout:.0f} s; their first runs start cold")
            return infos
        time.sleep(0.05)


def _start_timeout(rec: PoolRecord) -> float:
    return float(rec.options.get("start_timeout", 120))


def attach(name: str, registry: Registry | None = None) -> Pool:
    registry = registry or Registry()
    return Pool(registry.require(name), registry)


def _ending_own_procs(name: str) -> None:
    """The ends of this process's actor procs on pool ``name`` are expected, not supervision
    events. A process that never loaded the actor runtime (the CLI) owns none: nothing to import."""
    session = sys.modules.get("monarch_torchx.actor.session")
    if session is not None:
        session.pool_ending(name)


def _stop(pool: Pool, prov: Provisioner, reason: str) -> list[str]:
    """Stops the pool; returns what lost hosts had left on their nodes and was ended, a line each."""
    _ending_own_procs(pool.name)
    live = [i for i, h in enumerate(pool.hosts) if h is not None and not h.exited]
    lost = [h.index for h in pool.health() if h.state == LOST and h.addr is not None and not h.addr.exited]
    # a killed agent could not clean up: that is done for it while its node is still ours
    left = prov.end_leftovers(pool.record, lost) if lost else []
    for line in left:
        log.info("pool %s: ended what %s", pool.name, line)
    if not prov.client_cwd_on_hosts:
        _hear_ends(pool, [i for i in live if i not in lost])
    pool.ask("shutdown", [i for i in live if i not in lost], timeout=5.0, reason=reason)
    prov.release(pool.record)
    pool.registry.delete(pool.record)
    return left


def _hear_ends(pool: Pool, hosts: list[int]) -> None:
    """Hosts that do not share this file system (Kubernetes) record their replicas' ends on their
    own disks only: before they go, the ends no client asked about are recorded here, so their
    apps still read as they ended once the pool is stopped (``history.py``)."""
    from . import history
    from .specs import ReplicaStatus

    for _, res, _ in pool.ask("list", hosts, timeout=10.0):
        for st in res or []:
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # (a damaged answer: not an end)
                rs = ReplicaStatus.from_wire(st)
                if rs.state.terminal:
                    history.record_end(
                        pool.record.path, history.ReplicaEnd.from_status(rs.app_id, rs.role, rs.replica_id, rs)
                    )


def stop_pool(
    name: str, registry: Registry | None = None, on_wait: Callable[[str], None] = lambda _m: None, wait: bool = True
) -> list[str]:
    """Stops every agent (their processes with them), releases the allocation, forgets the pool.
    Returns what agents that had died left on their nodes and was ended, a line each. ``on_wait``
    is told when another process holds the pool (a grow waiting for its allocation holds it);
    ``wait=False``: a MonarchError at once instead of the wait."""
    registry = registry or Registry()
    with registry.lock(name, on_wait=on_wait, wait=wait) as held:
        if not held:
            raise MonarchError(f"another process holds pool {name!r} (a run, a resize, or a grow waiting for SLURM)")
        pool = Pool(registry.require(name), registry)
        return _stop(pool, get_provisioner(pool.record.scheduler), "pool stopped")


def force_stop(name: str, registry: Registry | None = None) -> list[str]:
    """Ends a pool whose record cannot be read, from what this machine can find of it by name:
    its local agents (by their command line), the SLURM allocation the raw record still names,
    and the record itself. Returns what it did, a line each."""
    _ending_own_procs(name)
    registry = registry or Registry()
    path = registry.record_path(name)
    raw: dict[str, Any] = {}
    try:
        loaded = json.loads(path.read_text())
        raw = loaded if isinstance(loaded, dict) else {}
    except (OSError, ValueError):
        pass
    state_dirs = {str(registry.state_dir(name))}
    if isinstance(raw.get("state_dir"), str):
        state_dirs.add(raw["state_dir"])
    done = []
    from . import procfs

    pids = [
        pid
        for pid, argv in procfs.processes()
        for cmd in [[a.decode(errors="replace") for a in argv]]
        if "monarch_torchx.agent" in cmd
        and "--pool" in cmd
        and cmd[cmd.index("--pool") + 1 : cmd.index("--pool") + 2] == [name]
        and any(d in cmd for d in state_dirs)
    ]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.time() + 5
    while time.time() < deadline and any(procfs.alive(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if pids:
        done.append(f"ended {len(pids)} local agent(s)")
    alloc = raw.get("allocation")
    if not isinstance(alloc, dict):
        alloc = {}
    listed = alloc.get("parts")
    parts: list[Any] = listed if isinstance(listed, list) else [alloc]  # (a grown SLURM pool has several)
    jobs = [  # (and a renewing allocation's successor)
        str(p[k]) for p in parts if isinstance(p, dict) for k in ("job_id", "successor") if p.get(k)
    ]
    if jobs and shutil.which("scancel"):
        subprocess.run(["scancel", *jobs], capture_output=True)
        done += [f"cancelled SLURM allocation {job}" for job in jobs]
    for p in (path, *(Path(d) / f for d in state_dirs for f in (TOKEN_FILE, TLS_FILE))):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            done.append(f"removed {p}")
    return done


def resize_pool(
    name: str,
    hosts: int,
    registry: Registry | None = None,
    progress: Callable[[str], None] = lambda _m: None,
    on_join: JoinHook | None = None,
) -> Pool:
    """Grows or shrinks a pool in place, where its engine can (``resize`` on the provisioner)."""
    registry = registry or Registry()
    with registry.lock(name, on_wait=progress):
        rec = registry.require(name)
        prov = get_provisioner(rec.scheduler)
        if getattr(prov, "resize", None) is None:
            raise MonarchError(
                f"pool {name!r} runs on {rec.scheduler}, which cannot resize in place: "
                f"use -cfg {prov.hosts_option}={hosts},replace=True on the next run"
            )
        if hosts < 1:
            raise MonarchError(f"a pool needs at least 1 host (asked {hosts}); `pool stop {name}` ends it")
        _give_back_idled(rec, registry, prov, progress)
        _resize_locked(rec, hosts, registry, prov, progress, on_join)
        return Pool(rec, registry)


def grow_pool(
    name: str,
    extra: int,
    registry: Registry | None = None,
    progress: Callable[[str], None] = lambda _m: None,
    on_join: JoinHook | None = None,
) -> int:
    """Adds ``extra`` hosts to the pool as it is when its lock is had (``resize_pool``, never a
    shrink however its size changed meanwhile); returns the pool's size. What a pool's
    allocator calls (``schedulers/slurm_allocator.py``): it waits for them up to the pool's
    ``start_timeout``, holding the pool's lock, as `pool resize` does."""
    registry = registry or Registry()
    with registry.lock(name, on_wait=progress):
        rec = registry.require(name)
        prov = get_provisioner(rec.scheduler)
        _give_back_idled(rec, registry, prov, progress)
        _resize_locked(rec, rec.num_hosts + extra, registry, prov, progress, on_join)
        return rec.num_hosts


def _resize_locked(
    rec: PoolRecord,
    hosts: int,
    registry: Registry,
    prov: Provisioner,
    progress: Callable[[str], None],
    on_join: JoinHook | None = None,
) -> None:
    """Resizes ``rec`` (its lock held). Growing waits for the new hosts and readies them
    (``on_join``); hosts that do not come up, or are not readied, are given back and the pool
    keeps its size. Shrinking refuses while apps run on a host it
    would release, naming them, and tells the released agents to stop before their engine ends them."""
    old_n = rec.num_hosts
    if hosts == old_n:
        progress(f"pool {rec.name!r} already has {hosts} host(s)")
        return
    pool = Pool(rec, registry)
    if hosts < old_n:
        released_by = getattr(prov, "released_by", None)
        if released_by is not None:
            released_by(rec, hosts)  # (refuses a size that would split what the engine releases whole)
        released = list(range(hosts, old_n))
        busy = _apps_on(pool, released)
        if busy:
            raise MonarchError(
                f"pool {rec.name!r} cannot shrink to {hosts}: app(s) {busy} run on host(s) {hosts}-{old_n - 1}; "
                f"wait for them or `torchx cancel` them first"
            )
        stranded = _stranded_by(pool, hosts)
        if stranded:
            raise MonarchError(
                f"pool {rec.name!r} cannot shrink to {hosts}: app(s) waiting in its queue could never start on "
                f"{hosts} host(s): {'; '.join(stranded)}; `torchx cancel` them first"
            )
        if released_by is not None:  # its agents end their work and mounts before the engine ends them
            pool.fan_out(lambda i: pool.call(i, "shutdown", timeout=10.0, reason="pool resized"), released)
        progress(f"pool {rec.name!r}: releasing host(s) {hosts}-{old_n - 1}")
    grow, old = prov.resize(rec, hosts)  # type: ignore[attr-defined]
    registry.save(rec)
    if not grow:
        _tell_queue(Pool(rec, registry))
        return
    progress(f"pool {rec.name!r}: waiting for host(s) {grow[0]}-{grow[-1]} to join")
    try:
        prov.wait_ready(rec, grow, old, _start_timeout(rec), progress)
        wait_warm(Pool(rec, registry), progress, _start_timeout(rec))
        if on_join is not None:
            on_join(Pool(rec, registry), grow, progress)
        _tell_queue(Pool(rec, registry))
    except BaseException as e:
        with contextlib.suppress(Exception):
            prov.resize(rec, old_n)  # type: ignore[attr-defined]
        registry.save(rec)
        if isinstance(e, MonarchError):
            raise MonarchError(f"{e}; pool {rec.name!r} keeps its {old_n} host(s)") from None
        raise


def idled_tail(rec: PoolRecord, prov: Provisioner) -> int | None:
    """The size a grown pool is left with once further allocations at its end idled out (every
    agent of theirs left by its own idle timeout while the pool's first host stayed), or None.
    Only whole allocations: the size ``released_by`` accepts."""
    released_by = getattr(prov, "released_by", None)
    if released_by is None or rec.num_hosts < 2:
        return None
    hosts = Registry.hosts(rec)
    if hosts[0] is None or hosts[0].exited:  # the whole pool idled out (or is lost): it comes back whole
        return None
    n = rec.num_hosts
    while n > 1 and (h := hosts[n - 1]) is not None and h.exited and h.exited_idle:
        n -= 1
    for size in range(n, rec.num_hosts):
        try:
            released_by(rec, size)
            return size
        except MonarchError:  # (that size would split an allocation: a smaller tail)
            continue
    return None


def _give_back_idled(rec: PoolRecord, registry: Registry, prov: Provisioner, progress: Callable[[str], None]) -> None:
    """Brings ``rec`` (its lock held) up to date with what its allocations did by themselves:
    renewed ones replaced by their successors (``settle_renewals``), and the pool shrunk past
    the further allocations that idled out (``idled_tail``)."""
    settle = getattr(prov, "settle_renewals", None)
    settled = settle(rec) if settle is not None else []
    for line in settled:
        progress(f"pool {rec.name!r}: {line}")
    if settled:
        registry.save(rec)
    size = idled_tail(rec, prov)
    if size is None:
        return
    progress(
        f"pool {rec.name!r}: host(s) {size}-{rec.num_hosts - 1} left idle (idle_timeout); "
        f"the pool has {size} host(s) now"
    )
    prov.resize(rec, size)  # type: ignore[attr-defined]
    registry.save(rec)
    _tell_queue(Pool(rec, registry))


def give_back_idled(name: str, registry: Registry | None = None) -> str | None:
    """What ``pool status`` does first: a grown pool whose further allocations idled out is shown
    at the size it has now (see ``idled_tail``); says so, or None."""
    registry = registry or Registry()
    rec = registry.get(name)
    if rec is None:
        return None
    prov = get_provisioner(rec.scheduler)
    if idled_tail(rec, prov) is None:  # (the lock only when there is something to give back)
        return None
    said: list[str] = []
    with registry.lock(name):
        rec = registry.get(name)
        if rec is not None:
            _give_back_idled(rec, registry, prov, said.append)
    return said[0] if said else None


def _tell_queue(pool: Pool) -> None:
    """Hands the pool's queue (host 0's agent) the hosts it has now, so that apps waiting there
    are placed on hosts that joined, and never on hosts that left."""
    from .app_queue import QUEUE_HOST

    targets, _, _ = pool.tree_targets(range(pool.record.num_hosts))
    with contextlib.suppress(MonarchError, OSError, net.RemoteError):  # no queue there: nothing waits
        pool.call(QUEUE_HOST, "queue.status", timeout=10.0, app_ids=[], targets=[t.as_dict() for t in targets])


def _stranded_by(pool: Pool, hosts: int) -> list[str]:
    """The queued apps a shrink to ``hosts`` would leave waiting forever, each with why."""
    from .app_queue import QUEUE_HOST

    try:
        return list(pool.call(QUEUE_HOST, "queue.stranded", timeout=15.0, hosts=hosts))
    except net.RemoteError:  # an agent of an earlier version: it cannot say
        return []


def _apps_on(pool: Pool, hosts: list[int]) -> str:
    """The apps with a replica running on any of ``hosts``, named, or ""."""
    names: set[str] = set()
    for _, res, err in pool.ask("list", hosts, timeout=10.0):
        if err is None and isinstance(res, list):
            names.update(str(r["app_id"]) for r in res if r.get("state") in (PENDING, RUNNING))
    return ", ".join(sorted(names))


def wait_for_hosts(
    rec: PoolRecord,
    indices: list[int],
    old: dict[int, str],
    timeout: float,
    check: Callable[[int], str | None] = lambda _i: None,
) -> None:
    """Polls the pool's host files until each index has a new, live incarnation.

    ``check(i)`` returns a reason when host i can no longer come up (its process died, the
    allocation was cancelled), so a failure is reported at once rather than at the timeout.
    """
    deadline = time.time() + timeout
    pending = set(indices)
    delay = 0.005
    while pending:
        hosts = Registry.hosts(rec)
        for i in list(pending):
            h = hosts[i]
            if h is not None and not h.exited and h.incarnation != old.get(i):
                pending.discard(i)
            else:
                reason = check(i)
                if reason:
                    raise MonarchError(f"pool {rec.name!r} did not start: {reason}")
        if not pending:
            return
        if time.time() > deadline:
            raise StartTimeout(f"host(s) {sorted(pending)} of pool {rec.name!r} did not start within {timeout:.0f} s")
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
