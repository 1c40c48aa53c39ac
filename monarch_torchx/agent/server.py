"""The host agent: the one long-lived process per host of a pool.

It owns the host's fork servers and replica table, answers authenticated requests (launch,
describe, kill, logs, info, shutdown), heartbeats its address file, loads pluggable modules,
and exits by itself after ``idle_timeout`` seconds with nothing running and nobody asking.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import os
import shutil
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable

from .. import net
from ..app_queue import QueueBacklog
from ..credentials import TLS_FILE, PoolCredentials
from ..errors import MonarchError
from ..net import aio
from ..net.fanout import RelayRefused
from ..private import (
    PrivatePathError,
    agent_temp_dir,
    check_private_dir,
    check_trusted_parents,
    node_temp_root,
    private_dir,
    remove_empty_dirs,
)
from ..quick_exit import exit_without_finalizing
from ..registry import HostAddr, Registry
from ..seam import AgentHost, AgentModule
from ..specs import TERMINAL, LaunchSpec
from .admission import Ledger
from .capacity import Declared, detect
from .debug import DebugSessions
from .gpus import GpuWatch
from .handover import ARM_OP, hand_over, handing_over_to, take_over_due
from .launcher import Launcher
from .leftovers import remove_dead_temp_dirs
from .log_follow import OP as LOG_FOLLOW_OP
from .log_follow import LogFollow
from .logstore import POOL_MAX_MB, REPLICA_MAX_MB, LogLimits
from .nvml import Nvml, NvmlUnavailable, open_nvml
from .procs import ProcTable
from .queue import PoolQueue
from .relay import Relay
from .shell import ShellSessions
from .tasks import TaskHolder

log = logging.getLogger("monarch_torchx.agent")

MODULES_GROUP = "monarch_torchx.modules"
HEARTBEAT_S = float(os.environ.get("MONARCH_TORCHX_HEARTBEAT_S", "5"))
# how often the host file is rewritten (1,024 hosts: ~2,000 writes a minute to the pool's dir)
# a further allocation's agent stays this long after a run checked it, though idle (see Agent.touch)
TOUCH_GRACE_S = 30.0
# an agent no client has reached yet does not idle out before this: its pool may still be coming up
# (a slow pod or node holds the run back), and the run's first request is what starts its idle clock
CONTACT_GRACE_S = 600.0
HEARTBEAT_WRITE_S = float(os.environ.get("MONARCH_TORCHX_HEARTBEAT_WRITE_S", str(6 * HEARTBEAT_S)))
# asking about a pool must not keep it alive: only work (launches, module calls) resets idleness
PASSIVE_OPS = frozenset(
    {
        "relay",
        "ping",
        "info",
        "describe",
        "list",
        "logs",
        "app_logs",
        "app_logs_follow",
        "kill",
        "shutdown",
        "wait",
        "capacity",
        "queue.status",
        "telemetry.query",
        "telemetry.rows",
        "telemetry.partial",
        "telemetry.stacks",
    }
)
BIND_RETRY_S = 3.0
# per host and request: a relay holds its subtree's answers; a replica past it is streamed directly
APP_LOGS_MAX_BYTES = int(os.environ.get("MONARCH_TORCHX_APP_LOGS_MAX_BYTES", str(1 << 20)))
APP_LOGS_MAX_S = 2.0
# a successor on standby takes its host over once the serving agent's heartbeat is this old
TAKE_OVER_AFTER_S = 3 * HEARTBEAT_WRITE_S
# a host is handed over to its successor only after this long with nothing run or asked of it: a
# run that checked it (``info``) is placing work there
HANDOVER_QUIET_S = 10.0
HEARTBEAT_FIELDS = frozenset({"heartbeat", "last_work"})  # a publish of only these: the agent did not move
MAX_FINISHED_APPS = 500


HELD_PORT_MAX_WAIT_S = 300.0  # a port held for an app none of whose replicas came here is let go after this


@dataclass
class HeldPort:
    """A port reserved for one app's listener, kept bound until that app is done on this host."""

    app_id: str
    sock: socket.socket
    since: float  # monotonic


class Agent:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.state_dir = Path(args.state_dir)
        self.index = args.index
        self.pool = args.pool
        self.incarnation = args.incarnation or uuid.uuid4().hex[:12]
        # started to take its index over from an allocation whose walltime ends (``handover.py``):
        # waits on standby until then; ``successor`` stays (it names this agent's own node stores)
        self.standby = self.successor = bool(args.standby)
        self._deferred: list[Any] = []  # background work held back while on standby
        if args.token_file:  # a mounted secret (Kubernetes): procs of this host read it from the state dir
            tls = Path(args.token_file).with_name(TLS_FILE)
            Registry.install_credentials(
                self.state_dir, Path(args.token_file).read_text().strip(), tls.read_text() if tls.exists() else ""
            )
        self.creds = PoolCredentials.load(self.state_dir)
        self.key = self.creds.key
        self.started = time.time()
        self.last_request = time.time()
        self.contacted = False  # no client request yet: idle time counts from the first (see touch)
        self.last_touch = 0.0  # when a run last checked this host (a grace, not work: see touch)
        self.last_asked = 0.0  # when anything but a look was last asked of it (see touch)
        self.idled_out = False
        self.modules: dict[str, str] = {}
        self.heartbeat_error = ""  # why the last heartbeat could not be written (a full disk), for `pool status`
        self.held_ports: list[HeldPort] = []  # ports reserved for an app's listener (op_reserve_port)
        self._cleanups: list[Callable[[], None]] = []
        self._background: list[Any] = []
        self.handlers: dict[str, Callable[..., Any]] = {
            "info": self.op_info,
            "launch": self.op_launch,
            "describe": self.op_describe,
            "list": self.op_list,
            "kill": self.op_kill,
            "logs": self.op_logs,
            "app_logs": self.op_app_logs,
            "shutdown": self.op_shutdown,
            "reserve_port": self.op_reserve_port,
            "wait": self.op_wait,
            "ping": self.op_ping,
            "capacity": self.op_capacity,
            ARM_OP: self.op_arm,
        }
        self.combiners: dict[str, Callable[[dict, list[Any]], Any]] = {}
        self.relay = Relay(self)
        self.handlers["relay"] = self.relay.op_relay
        self.log_follow = LogFollow(self)
        self.queue = PoolQueue(self)
        self.handlers.update(self.queue.operations())
        self.tasks = TaskHolder(self)
        self.handlers.update(self.tasks.operations())
        self.shells = ShellSessions(self)
        self.handlers.update(self.shells.operations())
        self.handlers[LOG_FOLLOW_OP] = self.log_follow.op_app_logs_follow
        self.stopping = asyncio.Event()
        self.stop_reason = ""
        self.stop_requested = False
        self.launcher = Launcher(args.preload, self._on_exit, self._on_launcher_death)
        python_dir = os.path.dirname(os.path.abspath(sys.executable))
        base_env = dict(os.environ)
        base_env["PATH"] = python_dir + os.pathsep + base_env.get("PATH", os.defpath)
        base_env.update({"MONARCH_TORCHX_POOL": self.pool, "MONARCH_TORCHX_HOST_INDEX": str(self.index)})
        base_env["MONARCH_TORCHX_STATE_DIR"] = str(self.state_dir)  # (its credentials: debugger.py)
        self.debug = DebugSessions(self, agent_temp_dir("debug", self.pool, self.index))
        self.handlers.update(self.debug.operations())
        for k, v in self.debug.env().items():  # (a PYTHONBREAKPOINT of the user's own stands)
            base_env.setdefault(k, v)
        self.nvml: Nvml | None = None
        nvml_error = ""
        try:
            self.nvml = open_nvml()
        except NvmlUnavailable as e:
            nvml_error = str(e)
        found = detect(os.environ, Declared.parse(args.declare), self.nvml, nvml_error)
        self.gpus = GpuWatch(self.nvml)
        self.ledger = Ledger(self.index, found, check_gpus=self.gpus.problems if self.nvml else None)
        self.gpus.ledger = self.ledger
        for gpu, problem in self.gpus.problems([g.visible_id for g in found.gpus]).items():  # as the host joins
            self.ledger.take_out_gpu(gpu, problem)
        self.procs = ProcTable(
            self.launcher,
            self.state_dir / "logs" / f"host{self.index}",
            base_env,
            LogLimits.from_mb(args.log_max_mb, args.log_host_max_mb),
            history_dir=self.state_dir,
            ledger=self.ledger,
        )
        self.server = aio.Server(
            self.creds,
            self.handlers,
            on_activity=self.touch,
            identity=f"{self.pool}/{self.index}/{self.incarnation}".encode(),
        )
        self.addr: HostAddr | None = None

    @property
    def tcp_bind(self) -> str:
        """Where this host's other listeners (procs, stores) bind: the agent's own address, or
        loopback for an agent on a Unix socket."""
        return "127.0.0.1" if self.args.bind.startswith(net.UNIX) else self.args.bind

    @property
    def tcp_advertise(self) -> str:
        """The address others reach those listeners at (see tcp_bind)."""
        host = self.addr.host if self.addr else "127.0.0.1"
        return "127.0.0.1" if host.startswith(net.UNIX) else host

    def on_stop(self, fn: Callable[[], None]) -> None:
        """For modules: run ``fn`` when the agent stops (after its processes were stopped)."""
        self._cleanups.append(fn)

    def background(self, coro: Any) -> None:
        """For modules: run a coroutine for the agent's life (cancelled when it stops); on
        standby, from when it takes its host over."""
        if self.standby:
            self._deferred.append(coro)
            return
        self._background.append(asyncio.get_running_loop().create_task(coro))

    def install(self, module: AgentModule) -> None:
        """For modules: plug one in through its typed seam (``AgentModule``): each of its
        operations served, its background tasks started, its ``stop`` run when the agent stops."""
        for op, (fn, combine) in module.operations().items():
            self.add_handler(op, fn, combine=combine)
        for coro in module.background_tasks():
            self.background(coro)
        self.launcher.add_warm_imports(module.warm_imports())
        self.on_stop(module.stop)

    def add_handler(
        self, op: str, fn: Callable[..., Any], combine: Callable[[dict, list[Any]], Any] | None = None
    ) -> None:
        """For modules: serve ``op`` on this agent's authenticated port. With ``combine``
        (blocking: the request's args and the values of hosts that answered -> one value), a relay
        answers for its whole subtree with one combined value instead of one per host."""
        if op in self.handlers:
            raise ValueError(f"operation {op!r} is already served")
        self.handlers[op] = fn
        if combine is not None:
            self.combiners[op] = combine

    def queue_backlog(self) -> QueueBacklog:
        return self.queue.backlog()

    def touch(self, op: str, work: bool = True) -> None:
        """A request for ``op`` arrived: work on the pool, unless ``op`` only looks. ``work=False``:
        a run checked this host without giving it anything (a launch pass's empty call, ``info``
        with touch): work for the pool's first allocation, whose agents leave only with the whole
        pool; only a grace for a further allocation's, which leave when their own hosts are idle.
        The first request of all, even a look, starts the idle clock: until then the pool was
        still coming up, and a host ready before its peers must not idle out before the run."""
        if not self.contacted:
            self.contacted = True
            self.last_request = time.time()
        if op in PASSIVE_OPS:
            return
        self.last_asked = time.time()  # (a run may be placing work here: no handover meanwhile)
        if work or not self.args.index_base:
            self.last_request = time.time()
        else:
            self.last_touch = time.time()

    def _on_exit(self, pid: int, code: int) -> None:
        if not self.shells.on_exit(pid, code):
            self.procs.on_exit(pid, code)

    def _on_launcher_death(self, reason: str, pids: list[int], fatal: bool) -> None:
        self.procs.on_launcher_death(reason, pids)
        if not fatal:  # the warm server: Python entrypoints now start cold from the plain one
            log.error(
                "%s; its starts now come from the plain fork server (an actors server is started again "
                "at the next actor proc)",
                reason,
            )
            return
        if not self.stopping.is_set():
            log.error("%s; stopping the agent", reason)
            # a signal to the whole job (scancel, walltime) reaches the fork servers too: let the
            # agent's own signal handler name the cause first
            asyncio.get_running_loop().call_later(0.2, self.stop, "launcher died")

    def gpu_samples(self) -> list[dict[str, Any]]:
        """The ``gpus`` telemetry table's rows from this host (none without NVML)."""
        return self.gpus.rows()

    def stop(self, reason: str) -> None:
        self.stop_reason = self.stop_reason or reason
        if not self.stop_requested:  # a signal, a successor, idling out: see ProcTable.ending_unrecorded
            self.procs.ending_unrecorded = True
        self.stopping.set()

    # ------------------------------------------------------------ modules

    def load_modules(self) -> None:
        """Entry points of group ``monarch_torchx.modules`` plus ``--module pkg.mod:setup``."""
        disabled = {m for m in os.environ.get("MONARCH_TORCHX_DISABLE_MODULES", "").split(",") if m}
        specs = [(ep.name, ep.value) for ep in entry_points(group=MODULES_GROUP) if ep.name not in disabled]
        specs += [(m, m) for m in self.args.module]
        for name, target in specs:
            modname, _, attr = target.partition(":")
            try:
                mod = __import__(modname, fromlist=["_"])
                setup = getattr(mod, attr or "setup")
                host: AgentHost = self  # (checked by mypy: an Agent offers all of seam.AgentHost)
                setup(host)
                self.modules[name] = "loaded"
            except Exception as e:
                self.modules[name] = f"failed: {type(e).__name__}: {e}"
                log.error("module %s failed to load: %s", name, e)

    # ------------------------------------------------------------ operations

    async def op_ping(self, peer: aio.Peer) -> bool:
        """The cheapest answer: a relay asks it on a connection it kept, before reusing it."""
        if self.stopping.is_set():  # so it is not handed a request it would drop halfway
            raise RelayRefused(f"agent {self.index} is shutting down ({self.stop_reason})")
        return True

    async def op_info(self, peer: aio.Peer, touch: bool = False) -> dict:
        if self.stopping.is_set():  # so a health check counts this host as gone, not as usable
            raise ValueError(f"agent {self.index} is shutting down ({self.stop_reason})")
        idle = self.idle_seconds()
        if touch:  # a run is about to use the pool
            self.touch("launch", work=False)
        return {
            "pool": self.pool,
            "index": self.index,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "incarnation": self.incarnation,
            "started": self.started,
            "now": time.time(),
            "running": self.procs.running,
            "idle_s": round(idle, 1),
            "idle_timeout": self.args.idle_timeout,
            "modules": self.modules,
            "warm": self.launcher.warm_info,
            "connections": self.server.connections,
            "accepted": self.server.accepted,
            "relayed": self.relay.relayed,
            "heartbeat_error": self.heartbeat_error,
            "load": self.ledger.load.to_wire(),
            "log_error": "; ".join(w for w in (self.procs.log_store.warning(), self.procs.history_error) if w),
        }

    async def op_launch(self, peer: aio.Peer, spec: dict) -> dict:
        if self.stopping.is_set():
            raise ValueError(f"agent {self.index} is shutting down ({self.stop_reason})")
        status = await self.procs.launch(LaunchSpec(**spec))
        self._trim_history()
        return status

    async def op_capacity(self, peer: aio.Peer, after: int = -1, within: float = 0.0) -> dict:
        """This host's capacity and what its replicas hold (``resources.HostLoad``), at once, or,
        with ``after``, once its generation is past it (at most ``within`` seconds later): the
        pool's queue watches hosts this way, so an ended replica starts the next at once."""
        load = await self.ledger.changed_after(int(after), min(float(within), 60.0))
        return load.to_wire()

    async def op_reserve_port(self, peer: aio.Peer, hold_for: str = "") -> int:
        """A port that is free on this host's pool address, for a role's store (a warm torchrun's).

        ``hold_for`` (an app id): the port stays bound here, with SO_REUSEPORT, until that app has
        no live replica on this host (``_release_ports``), so no one else can take it between this
        answer and the moment the app's own listener binds it (with SO_REUSEPORT too, which the
        kernel lets only a process of the same user share). Without it the port is only free now
        (a program that cannot share it, such as Monarch's worker, binds it itself).
        """
        assert self.addr is not None
        family = socket.AF_INET6 if ":" in self.tcp_advertise else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        try:
            if hold_for:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind((self.tcp_bind if self.tcp_bind not in ("", "0.0.0.0", "::") else "", 0))
            port = s.getsockname()[1]
        except BaseException:
            s.close()
            raise
        if hold_for:
            self.held_ports.append(HeldPort(hold_for, s, time.monotonic()))
        else:
            s.close()
        return port

    def _release_ports(self) -> None:
        """Closes each held port whose app has no live replica here (it ended, or never started
        here within HELD_PORT_MAX_WAIT_S)."""
        keep = []
        for held in self.held_ports:
            reps = self.procs.select(held.app_id)
            waited = time.monotonic() - held.since
            if any(r.state not in TERMINAL for r in reps) or (not reps and waited < HELD_PORT_MAX_WAIT_S):
                keep.append(held)
            else:
                held.sock.close()
        self.held_ports = keep

    async def op_describe(self, peer: aio.Peer, app_id: str) -> list[dict]:
        return [r.status() for r in self.procs.select(app_id)]

    async def op_wait(self, peer: aio.Peer, app_id: str, within: float = 30.0) -> list[dict]:
        """Answers once every replica of the app on this host has ended, or after ``within`` seconds."""
        deadline = time.time() + max(0.0, min(float(within), 300.0))
        while True:
            reps = self.procs.select(app_id)
            live = [r for r in reps if r.state not in TERMINAL]
            left = deadline - time.time()
            if not live or left <= 0:
                return [r.status() for r in reps]
            waits = [asyncio.ensure_future(r.change_event().wait()) for r in live]
            try:
                await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    async def op_list(self, peer: aio.Peer) -> list[dict]:
        return [r.status() for r in self.procs.replicas.values()]

    async def op_kill(
        self,
        peer: aio.Peer,
        app_id: str,
        role: str | None = None,
        replica_id: int | None = None,
        grace: float = 5.0,
        reason: str = "cancelled",
    ) -> int:
        """Ends the app's (or one role's, or one replica's) live replicas; ``reason``: what their
        end says. Returns how many were live."""
        return await self.procs.kill(self.procs.select(app_id, role, replica_id), grace, reason=reason)

    async def op_logs(
        self,
        peer: aio.Peer,
        app_id: str,
        role: str,
        replica_id: int,
        streams: str = "combined",
        since: float | None = None,
        until: float | None = None,
        regex: str | None = None,
        follow: bool = False,
    ) -> aio.Stream:
        reps = self.procs.select(app_id, role, replica_id)
        if not reps:
            raise LookupError(f"no replica {role}/{replica_id} of app {app_id} on host {self.index}")
        return aio.Stream(self.procs.logs(reps[0], streams, since, until, regex, follow))

    async def op_app_logs(
        self,
        peer: aio.Peer,
        app_id: str,
        role: str | None = None,
        replica_ids: list[int] | None = None,
        streams: str = "combined",
        since: float | None = None,
        until: float | None = None,
        regex: str | None = None,
        max_bytes: int = APP_LOGS_MAX_BYTES,
    ) -> list[dict[str, Any]]:
        """The logged lines so far of every replica of ``app_id`` on this host (of ``role``, of
        ``replica_ids``), one answer for the whole host, so that ``torchx log`` of N replicas is one
        request through the relay tree, not N streams. Past ``max_bytes`` characters in all (at
        most this agent's APP_LOGS_MAX_BYTES), or APP_LOGS_MAX_S of reading (a filter that keeps
        little of long logs), a replica's lines are left out and it says ``"more": True``: the
        client streams that one directly."""
        wanted = None if replica_ids is None else {int(i) for i in replica_ids}
        reps = sorted(
            (r for r in self.procs.select(app_id, role) if wanted is None or r.spec.replica_id in wanted),
            key=lambda r: (r.spec.role, r.spec.replica_id),
        )
        out: list[dict[str, Any]] = []
        budget = min(int(max_bytes), APP_LOGS_MAX_BYTES)
        deadline = time.monotonic() + APP_LOGS_MAX_S
        for rep in reps:
            lines: list[str] = []
            more = budget <= 0 or time.monotonic() > deadline
            if not more:
                async for batch in self.procs.logs(rep, streams, since, until, regex, follow=False):
                    lines += batch
                    budget -= sum(len(line) for line in batch)
                    if budget < 0 or time.monotonic() > deadline:
                        more = True
                        break
                    await asyncio.sleep(0)  # reading a long log must not hold up heartbeats and other requests
            out.append(
                {"role": rep.spec.role, "replica_id": rep.spec.replica_id, "lines": [] if more else lines, "more": more}
            )
        return out

    async def op_arm(self, peer: aio.Peer) -> bool:
        """A successor on standby got what was synced to the pool: host N's agent may hand over."""
        if not self.standby:
            raise ValueError(f"agent {self.index} is not on standby: it serves its host already")
        self._publish(armed=True)
        return True

    async def op_shutdown(self, peer: aio.Peer, reason: str = "pool stopped") -> bool:
        self.stop_requested = True  # (the ends of what it kills are recorded: see run())
        self._remove_standby_file()  # (a successor waiting for this host leaves: it is released, not handed on)
        self.stop(reason)
        return True

    # ------------------------------------------------------------ lifecycle

    def idle_seconds(self) -> float:
        """How long this host has had nothing to do. 0 while no client has reached it yet (within
        ``CONTACT_GRACE_S``): its pool is still coming up, for the idle check here, for its peers
        (its published ``last_work``) and for a Kubernetes pool's agent 0 (``k8s_idle``)."""
        if self.procs.running or self.queue.waiting or self.shells.sessions:  # (queued apps: work to come)
            return 0.0
        if not self.contacted and time.time() - self.started < max(self.args.idle_timeout, CONTACT_GRACE_S):
            return 0.0
        return time.time() - max(self.last_request, self.procs.last_change)

    def pool_idle_seconds(self) -> float:
        """Idle time of this host's allocation and every one after it, from each live agent's
        published ``last_work``: for the pool's first allocation (``--index-base`` 0), the whole pool.

        An allocation's agents leave together: one idle host of a busy allocation stays (SLURM
        gives its nodes back only whole). A grown pool's further allocation (its hosts from
        ``--index-base``) leaves once it and those after it are idle, so a pool shrinks from its
        end, and its first allocation (host 0, the queue) leaves only with the whole pool.
        """
        now = time.time()
        latest = now - self.idle_seconds()
        for p in (self.state_dir / "hosts").glob("*.json"):
            if not p.stem.isdigit() or int(p.stem) < self.args.index_base:  # (the pool's view of addresses)
                continue
            try:
                h = Registry.read_host(self.state_dir, int(p.stem))
            except (ValueError, OSError, MonarchError):
                continue
            if h is not None and not h.exited and h.incarnation != self.incarnation:
                latest = max(latest, h.last_work)
        return now - latest

    def _trim_history(self) -> None:
        apps: dict[str, float] = {}
        for (app_id, _, _), r in self.procs.replicas.items():
            if r.state in TERMINAL:
                apps[app_id] = max(apps.get(app_id, 0.0), r.ended or 0.0)
        for app_id in sorted(apps, key=apps.__getitem__)[:-MAX_FINISHED_APPS] if len(apps) > MAX_FINISHED_APPS else []:
            for key in [k for k in self.procs.replicas if k[0] == app_id]:
                self.procs.forget(key)

    def _publish(self, **extra: Any) -> None:
        assert self.addr is not None
        for k, v in extra.items():
            setattr(self.addr, k, v)
        Registry.publish_host(self.state_dir, self.addr, moved=not set(extra) <= HEARTBEAT_FIELDS, standby=self.standby)

    def _superseded(self) -> str | None:
        """Why another agent (or nobody) now owns this host's address file, or None if we do.

        A pool re-created under the same state dir (after its record was removed) starts new
        agents; an old one that kept heartbeating would overwrite their address forever."""
        try:
            current = Registry.read_host(self.state_dir, self.index, standby=self.standby)
        except (MonarchError, OSError, TypeError):
            return None  # unreadable for now: not proof of anything
        if current is None:
            return f"host {self.index}'s address file was removed (the pool was stopped or re-created)"
        if current.incarnation != self.incarnation:
            return f"another agent ({current.incarnation}, pid {current.pid}) now serves host {self.index}"
        return None

    async def _heartbeat(self) -> None:
        """Every HEARTBEAT_S: the idle check. Every HEARTBEAT_WRITE_S (sooner with a short
        idle_timeout, so a busy host's published ``last_work`` is never stale by more than a
        quarter of it): the host file, on what may be a cluster's shared file system."""
        limit = self.args.idle_timeout
        write_every = min(HEARTBEAT_WRITE_S, limit / 4) if limit > 0 else HEARTBEAT_WRITE_S
        last_write = time.monotonic()
        next_pool_check = 0.0  # others' last_work only grows: no pool-wide idle before this
        while not self.stopping.is_set():
            await asyncio.sleep(HEARTBEAT_S)
            now = time.time()
            if self.standby and self._standby_beat():
                last_write = 0.0  # (its own file now: written at once)
            if self.held_ports:
                self._release_ports()
            if time.monotonic() - last_write >= write_every:
                last_write = time.monotonic()
                why = self._superseded()
                if why:
                    log.warning("%s: exiting", why)
                    self.stop(f"superseded: {why}")
                    return
                try:
                    self._publish(heartbeat=now, last_work=now - self.idle_seconds())
                    self.heartbeat_error = ""
                except OSError as e:  # a full or flaky shared file system must not stop the idle check
                    log.warning("could not publish heartbeat: %s", e)
                    self.heartbeat_error = f"cannot write its heartbeat in {self.state_dir}: {e.strerror or e}"
            if self.standby:  # (no idle timeout while it waits: its predecessor's decides)
                continue
            checked_lately = now - self.last_touch < TOUCH_GRACE_S  # (a run may be placing work here)
            quiet = min(now - self.last_asked, self.idle_seconds()) > HANDOVER_QUIET_S
            succ = handing_over_to(self.state_dir, self.index, self.incarnation) if quiet else None
            if succ is not None:
                why = hand_over(self.state_dir, succ, now - self.idle_seconds())
                log.info("%s", why)
                self.stop(why)
                return
            if limit > 0 and self.idle_seconds() > limit and now >= next_pool_check and not checked_lately:
                pool_idle = self.pool_idle_seconds()  # reads every host's file: not every beat
                if pool_idle > limit:
                    log.info("pool idle for %.0f s: shutting down", pool_idle)
                    self.idled_out = True
                    self.stop(f"idle for more than {limit:.0f} s")
                else:
                    next_pool_check = now + (limit - pool_idle)

    def _remove_standby_file(self) -> None:
        """Host N's successor file (``hosts/N.next.json``): gone, its agent leaves or serves."""
        with contextlib.suppress(FileNotFoundError):
            Registry.host_path(self.state_dir, self.index, standby=True).unlink()

    def _standby_beat(self) -> bool:
        """A heartbeat on standby: True once it took its host over (it then goes on as any
        agent's), False while it waits (or leaves with a predecessor that left idle)."""
        why = self._superseded()  # (its standby file gone: the host was released, not handed on)
        if why:
            log.warning("%s: exiting", why)
            self.stop(f"superseded: {why}")
            return False
        due = take_over_due(self.state_dir, self.index, self.incarnation, TAKE_OVER_AFTER_S)
        if due is None or self.stopping.is_set():
            return False
        log.info("taking host %d over: %s", self.index, due.why)
        if due.leave:
            self.idled_out = True
            self.stop(due.why)
            return False
        self.standby = False
        self.contacted = True  # (it goes on with its predecessor's history)
        # its idle time counts from its host's last work, not from when it started or took over
        self.last_request = self.procs.last_change = min(due.last_work or time.time(), time.time())
        self._publish(armed=False, heartbeat=time.time(), last_work=time.time() - self.idle_seconds())
        self._remove_standby_file()
        for coro in self._deferred:
            self.background(coro)
        self._deferred.clear()
        return True

    async def _listen(self, sock: socket.socket | None) -> int:
        """Starts the server; returns its port. A given port that is briefly in use (a worker
        reopening the port its adoption listener just closed, while a stray connection still
        holds it) is tried again for up to BIND_RETRY_S."""
        deadline = time.monotonic() + BIND_RETRY_S
        while True:
            try:
                return await self.server.start(self.args.bind, self.args.port, sock=sock)
            except OSError as e:
                if sock is not None or not self.args.port or e.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                    raise
                log.info("port %d is in use; trying again", self.args.port)
                await asyncio.sleep(0.1)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop, f"signal {signal.Signals(sig).name}")
        self.load_modules()
        await self.launcher.start()
        listen = socket.socket(fileno=self.args.listen_fd) if self.args.listen_fd is not None else None
        port = await self._listen(listen)
        advertise = self.args.advertise or (
            self.args.bind if self.args.bind not in ("0.0.0.0", "") else socket.gethostname()
        )
        self.addr = HostAddr(
            index=self.index,
            host=advertise,
            port=port,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            incarnation=self.incarnation,
            started=self.started,
            heartbeat=time.time(),
        )
        self._publish()
        log.info("agent %d of pool %s listening on %s:%d", self.index, self.pool, advertise, port)
        hb = asyncio.create_task(self._heartbeat())
        self.background(self.queue.run())
        self.background(self.tasks.run())
        self.background(self.gpus.run())
        await self.stopping.wait()
        log.info("stopping: %s", self.stop_reason)
        hb.cancel()
        for task in self._background:
            task.cancel()
        await self.server.close()
        self.tasks.stop()  # (before its workers are ended: their tasks' ends are the stop's, not theirs)
        # asked to stop (`pool stop`): what it ends is recorded so. A signal (scancel, walltime) or
        # a successor: not recorded here, so the client records the engine's word for it instead
        # ("allocation 12 is CANCELLED"), as it does for an agent that was killed outright
        await self.procs.kill(
            list(self.procs.replicas.values()),
            grace=3.0,
            reason=f"ended: {self.stop_reason}",
            record=self.stop_requested,
        )
        self.launcher.close()
        self.relay.close()
        self.queue.stop()
        self.shells.stop()
        shutil.rmtree(self.debug.dir, ignore_errors=True)  # (paused processes were ended with the rest)
        remove_empty_dirs(self.debug.dir.parent, node_temp_root())
        for fn in self._cleanups:
            try:
                fn()
            except Exception as e:
                log.warning("module cleanup failed: %s", e)
        for what in remove_dead_temp_dirs(self.pool, self.index):  # what its killed processes left
            log.info("removed %s", what)
        if self.standby:  # it never served: its standby file goes; host N's is its predecessor's
            for coro in self._deferred:
                coro.close()
            self._remove_standby_file()
            return
        current = Registry.read_host(self.state_dir, self.index)
        if current is not None and current.incarnation == self.incarnation:  # not a successor's file
            self._publish(exited=time.time(), exit_reason=self.stop_reason, exited_idle=self.idled_out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m monarch_torchx.agent",
        description="Host agent of a monarch-torchx pool (started by a provisioner).",
    )
    p.add_argument("--state-dir", required=True, help="the pool's state dir (holds the token file)")
    p.add_argument("--pool", required=True)
    p.add_argument(
        "--index",
        type=int,
        default=None,
        help="host index (default: SLURM_NODEID, $MONARCH_TORCHX_HOST_INDEX, the hostname's -N suffix, or 0)",
    )
    p.add_argument(
        "--index-base",
        type=int,
        default=0,
        help="added to an index taken from the environment (a grown pool's further allocation)",
    )
    p.add_argument(
        "--incarnation",
        default=None,
        help="this agent's identity in handshakes (default: random; Kubernetes: the pod UID)",
    )
    p.add_argument(
        "--standby",
        action="store_true",
        help="start as a successor: wait to take the host's index over from the agent serving it (renewal)",
    )
    p.add_argument("--token-file", default=None, help="read the pool secret from here (default: STATE_DIR/token)")
    p.add_argument("--bind", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument(
        "--listen-fd",
        type=int,
        default=None,
        help="listen on this inherited, already bound socket instead of --bind/--port",
    )
    p.add_argument("--advertise", default=None, help="address clients use (default: bind address or hostname)")
    p.add_argument("--idle-timeout", type=float, default=1800.0, help="seconds; 0 disables")
    p.add_argument("--preload", action="append", default=None, help="module to pre-import for warm Python starts")
    p.add_argument(
        "--module",
        action="append",
        default=None,
        help="extra module setup, as pkg.mod:setup (default: $MONARCH_TORCHX_MODULES, comma-separated)",
    )
    p.add_argument(
        "--log-max-mb",
        type=float,
        default=REPLICA_MAX_MB,
        help="MiB of output each replica keeps on disk (older output is dropped)",
    )
    p.add_argument(
        "--log-host-max-mb",
        type=float,
        default=POOL_MAX_MB,
        help="MiB of replica output this host keeps on disk in all (its share of the pool's limit)",
    )
    p.add_argument(
        "--declare",
        default="",
        help="capacity the pool declares for this host, e.g. cpus=4,gpus=8,mem_mb=65536 (the rest is detected)",
    )
    args = p.parse_args(argv)
    if args.index is None:
        args.index = args.index_base + _index_from_environment()
    if args.module is None:
        args.module = [m for m in os.environ.get("MONARCH_TORCHX_MODULES", "").split(",") if m]
    if args.preload is None:
        args.preload = ["torch"]
    args.preload = [m for p_ in args.preload for m in p_.split(",") if m]
    return args


def _index_from_environment() -> int:
    """SLURM's node id, else the provisioner's variable, else a StatefulSet pod's ``name-N`` hostname."""
    for var in ("SLURM_NODEID", "MONARCH_TORCHX_HOST_INDEX"):
        value = os.environ.get(var, "").strip()
        if value:
            return int(value)
    suffix = socket.gethostname().rsplit("-", 1)
    return int(suffix[1]) if len(suffix) == 2 and suffix[1].isdigit() else 0


def check_own_dirs(state_dir: Path | None) -> None:
    """Refuses to serve (one line, exit code 2) where another user could replace what this agent
    reads or keeps: its state dir (its token, its hosts' files) or this user's node temp root
    (actors, telemetry and sync keep their sockets and stores there). Without this check such a
    host answered as healthy while each of those modules had failed to load."""
    try:
        if state_dir is not None:
            check_private_dir(state_dir)
            check_trusted_parents(state_dir)
        private_dir(node_temp_root(), from_=node_temp_root())
    except PrivatePathError as e:
        print(f"monarch-torchx agent: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s agent{args.index} %(levelname)s %(message)s")
    check_own_dirs(None if args.token_file else Path(args.state_dir))  # (a pod's state dir: made below)
    if not args.token_file:
        # what it starts without a cwd of its own starts here, not where it was started (a pod's
        # agent stays in the image's WORKDIR: its replicas run there, as the image's author meant)
        os.chdir(args.state_dir)
    asyncio.run(Agent(args).run())
    exit_without_finalizing()  # everything it owns was ended and cleaned up by run()
