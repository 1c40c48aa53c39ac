"""The TorchX ``Scheduler`` contract, implemented once for every pool engine.

An app handle is ``monarch_local://SESSION/POOL:APP``; the pool part tells any later process
(``torchx status``, ``torchx log``) where to look, through the registry.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import os
import re
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping

from torchx.schedulers.api import DescribeAppResponse, ListAppResponse, Scheduler, Stream
from torchx.schedulers.ids import make_unique
from torchx.specs import AppDef, AppDryRunInfo, AppState, CfgVal, ReplicaStatus, Role, RoleStatus, macros, runopts
from torchx.workspace.api import WorkspaceMixin

from .. import apps, history, scheduling
from ..agent.logstore import POOL_MAX_MB, REPLICA_MAX_MB, STREAMS, read_files
from ..app_queue import QUEUE_HOST, QueueState, SubmittedApp, TorchrunRole
from ..debugger import POST_MORTEM_ENV
from ..errors import MonarchError
from ..net.frames import UnknownOperation
from ..pool import CAPACITY_KEYS, Pool, PoolRequest, get_provisioner, parse_duration, plan_pool, preload_list
from ..registry import AppRecord, Placement, Registry, check_pool_name
from ..resources import NeverFits, Resources
from ..scheduling import check_fits_somewhere
from ..specs import FAILED, SUCCEEDED, LaunchSpec
from ..submission import PoolPlan
from ..syncfs.replay import replay_syncs
from ..torchrun import TorchrunPlan, plan_role
from . import workspace as ws
from .role_record import role_from_record, role_to_record

if TYPE_CHECKING:
    from ..agent.log_follow import LogEvent

RANK0_ENV = "TORCHX_RANK0_HOST"
APP_LOGS_TIMEOUT_S = 15.0  # a host's logs so far, up to the agent's budget: a bounded wait for a hung host
# what one `torchx log` asks all hosts for at most (every host at least the minimum): the client and
# each relay hold their subtree's answers; the rest of a longer log comes on its replica's own stream
APP_LOGS_TOTAL, APP_LOGS_HOST_MIN, APP_LOGS_HOST_MAX = 64 << 20, 16 << 10, 1 << 20


@dataclass
class ReplicaLaunch:
    host_index: int
    spec: LaunchSpec


@dataclass
class MonarchRequest:
    """What `torchx run --dryrun` shows: the pool asked for and one launch per replica."""

    pool: PoolRequest
    app_id: str
    app_name: str
    roles: list[dict[str, Any]]
    replicas: list[ReplicaLaunch] = field(default_factory=list)
    workspace: ws.Workspace | None = None  # synced to the hosts of role 0 before it starts
    torchrun: dict[str, TorchrunPlan] = field(default_factory=dict)  # by role name, torchrun roles only
    pool_plan: PoolPlan | None = None  # what the run does to the pool, and what it would submit
    inherited_env: dict[str, str] = field(default_factory=dict)  # this shell's, under each replica's env
    queue: bool = True  # one that does not fit now waits in the pool's queue (else it is refused)

    def __repr__(self) -> str:
        spec = ", ".join(f"{k}={v}" for k, v in self.pool.spec.items() if v is not None) or "existing spec"
        lines = [
            f"pool {self.pool.name!r} on {self.pool.scheduler} ({spec}; replace={self.pool.replace})",
            *([self.pool_plan.render()] if self.pool_plan else []),
            f"app {self.app_id}:",
        ]
        if self.workspace:
            lines.append(
                f"workspace {self.workspace.src} synced to {self.workspace.mount} (shown below as {ws.MOUNT_TOKEN})"
            )
        if self.inherited_env:
            cold = cold_env_names(self.inherited_env)
            lines.append(
                f"environment: this shell's {len(self.inherited_env)} variables, under each replica's env below"
                + (f" ({', '.join(cold)}: read as Python starts; see `{COLD_ENV_DOC}`)" if cold else "")
            )
        lines.append(
            "replicas go to the least-loaded hosts that fit them when it runs (a role of several replicas: "
            + (
                "one host each); what does not fit waits in the pool's queue"
                if self.queue
                else "one host each); what does not fit is refused (queue=False)"
            )
        )
        for role, plan in self.torchrun.items():
            path = "warm torchrun" if plan.warm else "real torchrun"
            retried = f"; --max_retries {plan.restarts}: all its nodes restart together" if plan.restarts else ""
            lines.append(f"role {role}: {path}: {plan.reason}{retried}")
        for r in self.replicas:
            s = r.spec
            asks = Resources.from_wire(s.resources).describe()
            lines.append(f"  {s.role}/{s.replica_id} (asks {asks}): {' '.join(s.argv)}")
            if s.env:
                lines.append(f"    env: {' '.join(f'{k}={v}' for k, v in sorted(s.env.items()))}")
            lines.append(f"    cwd: {s.cwd}  max_retries: {s.max_retries}")
        return "\n".join(lines)


# Not passed on from the submitting shell: what names the client's own pool, job, shell or
# session on its own machine (the agent sets the pool's; a client inside a SLURM job must not hand
# its job's ids to the replicas; a host's own TMPDIR, e.g. a job's private one, stays its own)
_NOT_INHERITED_PREFIXES = ("MONARCH_TORCHX_", "SLURM_", "SLURMD_", "SBATCH_", "SALLOC_", "SSH_")
_NOT_INHERITED = frozenset({"PWD", "OLDPWD", "SHLVL", "_", "HOSTNAME", "TMPDIR", "XDG_RUNTIME_DIR", "DISPLAY"})
COLD_ENV_DOC = "README: Run options, environment"


def inherited_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What replicas get of the submitting shell's environment (all of it, but the above)."""
    return {k: v for k, v in environ.items() if k not in _NOT_INHERITED and not k.startswith(_NOT_INHERITED_PREFIXES)}


def cold_env_names(env: Mapping[str, str]) -> list[str]:
    """The variables of ``env`` an interpreter reads as it starts: a Python replica given a value
    its pool's warm interpreter did not start with is started afresh (cold), not forked warm."""
    from ..agent.forkserver import INIT_ENV

    return sorted(k for k in env if k in INIT_ENV)


def _warn_cold_env_once(pool: Pool, env: Mapping[str, str]) -> None:
    """Says once per pool (and set of names) that this shell sets variables that can make Python
    replicas start cold, so a slow start is not a mystery."""
    cold = cold_env_names(env)
    if not cold:
        return
    marker = pool.record.path / "hosts" / "cold-env-said"
    said = ",".join(cold)
    with contextlib.suppress(OSError):
        if marker.read_text() == said:
            return
    _progress(
        f"note: this shell sets {', '.join(cold)}, read as Python starts: Python replicas whose value "
        f"differs from the pool's agents' start cold (no warm import); unset them, or create the pool "
        f"from a shell that sets them ({COLD_ENV_DOC})"
    )
    with contextlib.suppress(OSError):
        from ..registry import write_private

        write_private(marker, said)


def split_app_id(app_id: str) -> tuple[str, str]:
    pool, sep, app = app_id.partition(":")
    if not sep or not pool or not app:
        raise MonarchError(f"app id {app_id!r} is not of the form POOL:APP (as printed by `torchx run`)")
    return pool, app


_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


class _SingleFlight:
    """One computation per key at a time: callers that arrive while it runs wait for it and get
    its result; a caller that arrives after it finished computes anew (never a stale answer)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, Future[Any]] = {}

    def get(self, key: str, compute: Callable[[], Any]) -> Any:
        with self._lock:
            fut = self._running.get(key)
            mine = fut is None
            if fut is None:
                fut = self._running[key] = Future()
        if not mine:
            return fut.result()
        try:
            value = compute()
        except BaseException as e:
            fut.set_exception(e)
            raise
        else:
            fut.set_result(value)
            return value
        finally:
            with self._lock:
                self._running.pop(key, None)


class MonarchScheduler(WorkspaceMixin[None], Scheduler):
    """One TorchX scheduler per pool engine; the engine is the provisioner behind ``backend``."""

    def __init__(self, session_name: str, backend: str, registry: Registry | None = None):
        super().__init__(backend, session_name)
        self.registry = registry or Registry()
        self._describes = _SingleFlight()

    # ------------------------------------------------------------ options

    def _run_opts(self) -> runopts:
        prov = get_provisioner(self.backend)
        opts = runopts()
        opts.add("pool", type_=str, default="default", help="name of the warm pool to run on; created on first use")
        opts.add(
            prov.hosts_option,
            type_=int,
            default=None,
            help="hosts in the pool (default: the existing pool's size, else the largest role's replicas)",
        )
        opts.add(
            "replace",
            type_=bool,
            default=False,
            help="replace the pool when it differs from what is asked (else such a run is refused)",
        )
        if getattr(prov, "resize", None) is not None:
            opts.add(
                "grow",
                type_=bool,
                default=False,
                help=f"grow the pool in place to {prov.hosts_option}= when it is smaller (its hosts and apps are kept)",
            )
        opts.add(
            "idle_timeout",
            type_=str,
            default="30m",
            help="agents exit after this long with nothing running (e.g. 90s, 30m, 2h; 0 = never)",
        )
        opts.add(
            "preload",
            type_=str,
            default=None,
            help="comma-separated modules agents pre-import so Python entrypoints start warm "
            "(default: the existing pool's, else torch; none = no preloads)",
        )
        opts.add(
            "log_max_mb",
            type_=float,
            default=REPLICA_MAX_MB,
            help="MiB of output each replica keeps on its host; past it the oldest is dropped, and "
            "`torchx log` says how much (set when the pool is created)",
        )
        opts.add(
            "log_pool_max_mb",
            type_=float,
            default=POOL_MAX_MB,
            help="MiB of replica output the pool keeps in all, each host its share: the oldest output "
            "of ended replicas goes first (set when the pool is created)",
        )
        opts.add(
            "tls",
            type_=bool,
            default=None,
            help="TLS 1.3 on every connection of the pool, with a certificate made for it (default: "
            f"{'on' if prov.tls_default else 'off'} here; on for pools whose hosts are other machines)",
        )
        opts.add(
            "cpus_per_host",
            type_=float,
            default=None,
            help="CPUs each host has for replicas (default: detected: the allocation's, the cgroup's, else the "
            "affinity's); set when the pool is created",
        )
        opts.add(
            "mem_per_host_mb",
            type_=int,
            default=None,
            help="MB of memory each host has for replicas (default: detected); set when the pool is created",
        )
        opts.add(
            "gpus_per_host",
            type_=int,
            default=None,
            help="GPUs each host has for replicas, as ids 0..N-1 (default: detected through NVML, within what "
            "the allocation grants); set when the pool is created",
        )
        opts.add(
            "queue",
            type_=bool,
            default=True,
            help="an app that does not fit the pool's free capacity now waits in the pool's queue (PENDING); "
            "False: refuse it instead",
        )
        opts.add(
            "post_mortem",
            type_=bool,
            default=False,
            help="a replica whose Python program ends in an uncaught exception pauses in pdb where it was "
            "raised, for `monarch-torchx debug` (then exits with its error); it waits there, holding "
            "what it asked of its host, until `debug --continue`",
        )
        prov.add_run_opts(opts)
        return opts

    def workspace_opts(self) -> runopts:
        opts = runopts()
        opts.add(
            "workspace_mount",
            type_=str,
            default=None,
            help="sync the workspace (--workspace, default: the current directory; .torchxignore honoured) "
            "to this path on the pool's hosts and run role 0 there: relative = in the pool's own sync "
            "area, absolute = under an allowed root (/workspace, /env); default: no sync",
        )
        return opts

    def build_workspace_and_update_role(self, role: Role, workspace: str, cfg: Mapping[str, CfgVal]) -> None:
        """Marks ``role`` to run in ``workspace``; the sync itself happens once the pool is up."""
        if cfg.get("workspace_mount"):
            role.image = ws.IMAGE_PREFIX + ws.local_dir(workspace)

    def _validate(self, app: AppDef, scheduler: str, cfg: Any = None) -> None:
        if not app.roles:
            raise ValueError("the app has no roles")
        for role in app.roles:
            if role.num_replicas < 1:
                raise ValueError(f"role {role.name!r} asks for {role.num_replicas} replicas")

    # ------------------------------------------------------------ submit

    def _pool_request(self, cfg: dict[str, Any], want_hosts: int) -> PoolRequest:
        prov = get_provisioner(self.backend)
        name = check_pool_name(str(cfg.get("pool") or "default"))
        opt = prov.hosts_option
        hosts = cfg.get(opt)
        if hosts is not None:
            if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 1:
                raise MonarchError(f"{opt}={hosts!r} is invalid: a pool needs at least 1 host")
            most = cfg.get("max_nodes") or 0
            if want_hosts > max(hosts, most if isinstance(most, int) else 0):
                raise MonarchError(f"the app needs {want_hosts} hosts (one per replica) but {opt}={hosts}")
        preload = cfg.get("preload")
        if preload is not None:
            preload = preload_list(str(preload))
        tls = cfg.get("tls")
        spec: dict[str, Any] = {"hosts": hosts, "preload": preload, "tls": None if tls is None else bool(tls)}
        spec.update(_declared_capacity(cfg))
        options = {"idle_timeout": parse_duration(cfg.get("idle_timeout", "30m")), **_log_limits(cfg)}
        if cfg.get("grow"):
            options["grow"] = True
        prov.pool_spec(cfg, spec, options)
        return PoolRequest(self.backend, name, spec, options, bool(cfg.get("replace")), on_join=replay_syncs)

    def _submit_dryrun(self, app: AppDef, cfg: dict[str, Any]) -> AppDryRunInfo:
        want_hosts = max(r.num_replicas for r in app.roles) if app.roles else 1
        pool_req = self._pool_request(dict(cfg), want_hosts)
        app_id = make_unique(_SAFE.sub("-", app.name).strip("-.")[:40] or "app")
        # on engines whose hosts do not share the client's file system (Kubernetes), replicas run in
        # the agent's working directory (the image's WORKDIR), as TorchX's kubernetes scheduler does
        cwd = os.getcwd() if get_provisioner(self.backend).client_cwd_on_hosts else None
        # and there they get this shell's environment, as TorchX's local_cwd and slurm give it
        inherited = inherited_env(os.environ) if cwd is not None else {}
        req = MonarchRequest(
            pool_req, app_id, app.name, roles=[], inherited_env=inherited, queue=bool(cfg.get("queue", True))
        )
        for n, role in enumerate(app.roles):
            if cfg.get("post_mortem"):
                role.env = {**role.env, POST_MORTEM_ENV: "1"}
            workspace = ws.attached(role.image, cfg) if n == 0 else None
            req.workspace = req.workspace or workspace
            req.roles.append(role_to_record(role))
            root = ws.MOUNT_TOKEN if workspace else role.image if os.path.isdir(role.image) else (cwd or "")
            for i in range(role.num_replicas):
                values = macros.Values(
                    img_root=root, app_id=f"{pool_req.name}:{app_id}", replica_id=str(i), rank0_env=RANK0_ENV
                )
                # only args and env reach a replica: substituting them is what ``values.apply`` does
                # to them, without its deep copy of the whole role for every replica
                env = {str(k): values.substitute(str(v)) for k, v in role.env.items()}
                argv = [role.entrypoint, *(values.substitute(a) for a in role.args)]
                plan = plan_role(argv, env, role.num_replicas, role.name)
                retries = int(role.max_retries or 0)
                if plan is not None:
                    req.torchrun.setdefault(role.name, plan)
                    if plan.warm:
                        argv = list(plan.argv)
                        # its nodes restart together, as torchrun's restarts: never one alone (see NodePlan)
                        plan.restarts, retries = retries, 0
                spec = LaunchSpec(
                    app_id=app_id,
                    role=role.name,
                    replica_id=i,
                    argv=argv,
                    env=env,
                    inherited_env=inherited,
                    cwd=ws.MOUNT_TOKEN if workspace else cwd,
                    max_retries=retries,
                    resources=Resources.from_torchx(
                        role.resource.cpu, role.resource.gpu, role.resource.memMB
                    ).to_wire(),
                )
                req.replicas.append(ReplicaLaunch(host_index=i, spec=spec))
        req.pool_plan = plan_pool(pool_req, self.registry, defaults={"hosts": want_hosts, "preload": "torch"})
        return AppDryRunInfo(req, repr)

    def schedule(self, dryrun_info: AppDryRunInfo) -> str:
        req: MonarchRequest = dryrun_info.request
        want = max(r.host_index for r in req.replicas) + 1
        sub = SubmittedApp(
            app_id=req.app_id,
            name=req.app_name,
            roles=req.roles,
            specs=[replace(r.spec, env={**r.spec.env}) for r in req.replicas],
            torchrun={role: TorchrunRole(p.nnodes, p.restarts) for role, p in req.torchrun.items() if p.warm},
            rank0_env=RANK0_ENV,
            path_token=ws.MOUNT_TOKEN if req.workspace else "",
        )
        first = req.roles[0]["name"]

        def place(pool: Pool) -> list[tuple[int, LaunchSpec]]:
            """The replicas, ready to start on ``pool`` now (on copies: a launch made again places
            afresh); ``apps.MustWait`` when the app does not fit the pool's free capacity now."""
            n = pool.record.num_hosts
            sub.only_hosts = _hosts_with_time(pool, req.pool, want)
            if want > n and want <= _may_grow_to(pool) and req.workspace:
                raise MonarchError(
                    f"the app needs {want} hosts (one per replica) but pool {pool.name!r} has {n}, and with a "
                    f"workspace it cannot wait for the pool to grow by itself (the workspace goes to the hosts "
                    f"there are); use -cfg nodes={want},grow=True"
                )
            if want > n and want <= _may_grow_to(pool):
                raise apps.MustWait(f"it needs {want} hosts, the pool has {n}{_grows_for_it(pool)}", pool)
            if want > n:
                opt = get_provisioner(self.backend).hosts_option
                raise MonarchError(
                    f"the app needs {want} hosts (one per replica) but pool {pool.name!r} has {n}; "
                    f"use -cfg {opt}={want},replace=True or a bigger pool"
                )
            placement = _placement(pool, sub)
            hosts = pool.hosts
            addresses = {i: h.host if h else "localhost" for i, h in enumerate(hosts)}
            ports = {}
            for role, h in sub.store_hosts(placement).items():
                if hosts[h] is None:
                    raise MonarchError(f"host {h} of pool {pool.name!r} has no agent")
                ports[role] = pool.call(h, "reserve_port", timeout=10.0, hold_for=req.app_id)
            if req.workspace:
                hosts0 = sorted({h for (role, _), h in placement.items() if role == first})
                ws.sync_to_hosts(pool, req.workspace, hosts0, _progress)
                sub.workspace_paths = ws.workdirs(pool, req.workspace, hosts0)
            return sub.launches(placement, addresses, ports)

        try:
            # a workspace is synced before the launch: its hosts are checked before the sync
            pool, arec = apps.start(
                req.pool,
                req.app_id,
                req.app_name,
                req.roles,
                place,
                self.registry,
                defaults={"hosts": want, "preload": "torch"},
                progress=_progress,
                check_first=req.workspace is not None,
            )
        except apps.MustWait as wait:
            pool = wait.pool
            if not req.queue:
                raise MonarchError(
                    f"{req.app_id} does not fit pool {pool.name!r} now ({wait}); refused (queue=False): "
                    f"without it, it waits in the pool's queue"
                ) from None
            if req.workspace:  # (its hosts are known only when it starts: every host gets the workspace)
                every = list(range(pool.record.num_hosts))
                ws.sync_to_hosts(pool, req.workspace, every, _progress)
                sub.workspace_paths = ws.workdirs(pool, req.workspace, every)
            arec, entry = apps.enqueue(pool, sub)
            if entry.state == QueueState.QUEUED:
                _progress(f"{req.app_id} waits in the queue of pool {pool.name!r}: {entry.reason}{_grows_for_it(pool)}")
            elif entry.state == QueueState.ENDED:
                raise MonarchError(f"{req.app_id} could not start on pool {pool.name!r}: {entry.reason}") from None
        _warn_cold_env_once(pool, req.inherited_env)
        return f"{pool.name}:{arec.app_id}"

    # ------------------------------------------------------------ queries

    def _lookup(self, app_id: str, resolve: bool = True) -> tuple[Pool, AppRecord] | None:
        """The app on its live pool (one whose record exists, its agents up or not). ``resolve``:
        an app that was queued when last seen is asked of the pool's queue, and its record then
        says where it runs if it started (``describe`` leaves that to ``apps.replica_states``)."""
        try:
            pool_name, app = split_app_id(app_id)
            rec = self.registry.get(pool_name)
        except MonarchError:
            return None
        if rec is None or rec.scheduler != self.backend:
            return None
        arec = Registry.get_app(rec, app)
        if arec is None:
            return None
        pool = Pool(rec, self.registry)
        if resolve and apps.unplaced(arec):  # queued when last seen: where it runs now, if it started
            arec = apps.placed(pool, arec)[0]
        return pool, arec

    def _lookup_stopped(self, app_id: str) -> tuple[AppRecord, Path] | None:
        """The app on a stopped pool of its name (``history.py``): its record and that pool's state dir."""
        with contextlib.suppress(MonarchError):
            pool_name, app = split_app_id(app_id)
            for p in self.registry.stopped(pool_name, self.backend):
                arec = Registry.app_in(Path(p.state_dir), app)
                if arec is not None:
                    return arec, Path(p.state_dir)
        return None

    def describe(self, app_id: str) -> DescribeAppResponse | None:
        """The app's state, asked of its hosts. Threads that ask for one app at once share one
        answer: ``torchx log`` of N replicas runs N threads that each begin with a describe."""
        return self._describes.get(app_id, lambda: self._describe(app_id))

    def _describe(self, app_id: str) -> DescribeAppResponse | None:
        found = self._lookup(app_id, resolve=False)  # (replica_states asks the queue itself: once)
        failing = False
        if found is not None:
            pool, arec = found
            states = apps.replica_states(pool, arec)
            failing = apps.ends_with_failure(states) and apps.failure_is_fresh(states)
            if apps.ends_with_failure(states) and not failing:
                states = apps.end_failed(pool, arec, states)
        else:
            stopped = self._lookup_stopped(app_id)
            if stopped is None:
                return None
            arec, state_dir = stopped
            states = apps.stopped_states(arec, state_dir, split_app_id(app_id)[0])
        resp = DescribeAppResponse()
        resp.app_id = app_id
        # (failing: not FAILED while replicas run, which TorchX would take as the end)
        resp.state = AppState.RUNNING if failing else AppState[apps.app_state([s.state.value for s in states.values()])]
        resp.num_restarts = sum(max(0, s.attempts - 1) for s in states.values())
        msgs = [f"{role}/{i}: {s.msg}" for (role, i), s in states.items() if s.msg and s.state != SUCCEEDED]
        resp.msg = "; ".join(msgs)
        for r in arec.roles:
            resp.roles.append(role_from_record(r))
            replicas = [
                ReplicaStatus(
                    id=i,
                    state=AppState[states[(r["name"], i)].state.value],
                    role=r["name"],
                    hostname=states[(r["name"], i)].hostname,
                )
                for i in range(r["num_replicas"])
                if (r["name"], i) in states
            ]
            resp.roles_statuses.append(RoleStatus(role=r["name"], replicas=replicas))
        return resp

    def list(self, cfg: Any = None) -> builtins.list[ListAppResponse]:
        out: list[ListAppResponse] = []
        for rec in self.registry.list(self.backend):
            pool = Pool(rec, self.registry)
            records = Registry.list_apps(rec)
            seen = apps.list_states(pool, records) if records else {}
            for a in records:
                if apps.unplaced(a):  # (queued when last seen)
                    states = [st.state.value for st in apps.replica_states(pool, a).values()]
                else:
                    states = [seen.get((a.app_id, p.role, p.replica_id), FAILED) for p in a.placement]
                app_id = f"{rec.name}:{a.app_id}"
                out.append(
                    ListAppResponse(
                        app_id=app_id,
                        state=AppState[apps.app_state(states)],
                        app_handle=f"{self.backend}://{self.session_name}/{app_id}",
                    )
                )
        live = {Path(r.state_dir) for r in self.registry.list()}
        for p in self.registry.stopped(scheduler=self.backend):  # their apps, as their recorded ends say
            if Path(p.state_dir) in live:  # (a pool of that name made again in the same dir lists them)
                continue
            for a in Registry.apps_in(Path(p.state_dir)):
                states = [s.state.value for s in apps.stopped_states(a, Path(p.state_dir), p.name).values()]
                app_id = f"{p.name}:{a.app_id}"
                out.append(
                    ListAppResponse(
                        app_id=app_id,
                        state=AppState[apps.app_state(states)],
                        app_handle=f"{self.backend}://{self.session_name}/{app_id}",
                    )
                )
        return out

    def wait_until_done(self, app_id: str, timeout: float = 30.0) -> None:
        """Returns when every replica of the app has ended on its host, or after ``timeout`` seconds.

        The agents answer when their replicas end, so `torchx run --wait` returns then, not at
        TorchX's next one-second status poll. An unreachable host makes this return early: the
        caller's status check then says what became of the app.
        """
        found = self._lookup(app_id)
        if found is None:
            return
        pool, arec = found
        if apps.unplaced(arec):  # it waits in the pool's queue (``_lookup`` found it not started)
            time.sleep(min(timeout, 1.0))
            return
        indices = sorted({p.host_index for p in arec.placement})
        pool.ask("wait", indices, timeout=timeout + 10.0, app_id=arec.app_id, within=timeout)

    # ------------------------------------------------------------ cancel and logs

    def _cancel_existing(self, app_id: str) -> None:
        found = self._lookup(app_id)
        if found:
            apps.kill(*found)

    def delete(self, app_id: str) -> None:
        """Cancels the app if it runs, then forgets it (``torchx delete``; torchx 0.7.0 has no
        ``Scheduler.delete``, torchx-nightly's is this one)."""
        if self.exists(app_id):
            self._delete_existing(app_id)

    def _delete_existing(self, app_id: str) -> None:
        found = self._lookup(app_id)
        if found is not None:
            pool, arec = found
            apps.kill(pool, arec)
            Registry.delete_app(pool.record, arec.app_id)

    def log_iter(
        self,
        app_id: str,
        role_name: str,
        k: int = 0,
        regex: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        should_tail: bool = False,
        streams: Stream | None = None,
    ) -> Iterable[str]:
        """The replica's lines from its agent; from its files when the agent that ran it is gone
        (the pool idled out, was stopped, or the host restarted) and they are on this file system."""
        stream = streams.value if isinstance(streams, Stream) else (streams or "combined")
        names = STREAMS if stream == "combined" else (stream,)
        if any(n not in STREAMS for n in names):
            raise MonarchError(f"unknown stream {stream!r}: use stdout, stderr or combined")
        try:
            re.compile(regex or "")
        except re.error as e:
            raise MonarchError(f"--regex {regex!r} is not a regular expression ({e})") from None
        window = (since.timestamp() if since else None, until.timestamp() if until else None, regex)
        found = self._lookup(app_id)
        if found is None:
            stopped = self._lookup_stopped(app_id)
            if stopped is None:
                raise MonarchError(f"no app {app_id!r} on {self.backend}; see `torchx list -s {self.backend}`")
            arec, state_dir = stopped
            place = _replica_place(app_id, arec, role_name, k)
            return _from_files(
                state_dir,
                place,
                arec,
                names,
                window,
                MonarchError(
                    f"the logs of {role_name}/{k} are gone: its pool "
                    f"{split_app_id(app_id)[0]!r} was stopped and its files were removed"
                ),
            )
        pool, arec = found
        place = _replica_place(app_id, arec, role_name, k)
        while place.host_index == apps.UNPLACED:  # it waits in the pool's queue: its log begins when it starts
            if not should_tail or not _still_queued(pool, arec):
                return iter(())
            time.sleep(1.0)
            found = self._lookup(app_id)  # (where it runs, once it started)
            if found is None:
                return iter(())
            pool, arec = found
            place = _replica_place(app_id, arec, role_name, k)
        try:
            client = pool.connect(place.host_index)  # (reads that one host's address, not the pool's)
        except MonarchError as e:
            return _from_files(pool.record.path, place, arec, names, window, e)
        client.settimeout(None if should_tail else 60.0)
        agent_lines = _lines(
            client.stream(
                "logs",
                app_id=arec.app_id,
                role=role_name,
                replica_id=k,
                streams=stream,
                since=window[0],
                until=window[1],
                regex=regex,
                follow=should_tail,
            ),
            client,
        )
        return _or_files(agent_lines, pool.record.path, place, arec, names, window)

    def app_logs(
        self,
        app_id: str,
        replicas: builtins.list[tuple[str, int]],
        regex: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        streams: Stream | None = None,
    ) -> Iterator[tuple[str, int, Iterable[str]]]:
        """The lines so far of each of ``replicas``, in that order: one ``app_logs`` request per
        host, through the relay tree from 32 hosts on, instead of one stream per replica. A
        replica past its host's share of the request's budget, on a host not reached in time, or
        on an agent without the op, is streamed directly, as ``log_iter`` does. A replica that
        cannot be read fails alone: iterating its lines raises MonarchError, naming it and its host."""
        from ..wire import RemoteError, UnknownOperation

        if self._lookup(app_id) is None and self._lookup_stopped(app_id) is not None:  # from its files
            for role, k in replicas:
                yield (
                    role,
                    k,
                    _later(functools.partial(self.log_iter, app_id, role, k, regex, since, until, False, streams)),
                )
            return
        pool, arec, where = self._placed(app_id, replicas)
        waiting = [r for r in replicas if where[r] == apps.UNPLACED]  # in the pool's queue: no lines yet
        for role, k in waiting:
            yield role, k, []
        replicas = [r for r in replicas if r not in waiting]
        if not replicas:
            return
        hosts = sorted({where[r] for r in replicas})
        outcomes = {
            i: (value, err)
            for i, value, err in pool.ask(
                "app_logs",
                hosts,
                timeout=APP_LOGS_TIMEOUT_S,
                **_log_selection(arec, replicas, regex, since, until, streams),
                max_bytes=max(APP_LOGS_HOST_MIN, min(APP_LOGS_HOST_MAX, APP_LOGS_TOTAL // len(hosts))),
            )
        }
        for role, k in replicas:
            host = where[(role, k)]
            value, err = outcomes[host]
            if isinstance(err, RemoteError) and not isinstance(err, UnknownOperation):  # it ran there, and failed
                yield role, k, _failed(MonarchError(f"logs of {role}/{k} (host {host}) unavailable: {err}"))
                continue
            entry = next((e for e in value or [] if e["role"] == role and e["replica_id"] == k), None)
            if err is not None or entry is None or entry["more"]:  # too long, not reached in time, or an old agent
                yield role, k, self._direct_logs(app_id, role, k, host, regex, since, until, streams)
            else:
                yield role, k, entry["lines"]

    def _placed(
        self, app_id: str, replicas: builtins.list[tuple[str, int]], wait: bool = False
    ) -> tuple[Pool, AppRecord, dict[tuple[str, int], int]]:
        """The app's pool and record, and each of its replicas' host (``apps.UNPLACED`` while it
        waits in the pool's queue; ``wait``: until it starts or leaves the queue); MonarchError
        naming what is not there."""
        found = self._lookup(app_id)
        while found is not None and wait and apps.unplaced(found[1]) and _still_queued(*found):
            time.sleep(1.0)
            found = self._lookup(app_id)
        if found is None:
            raise MonarchError(f"no app {app_id!r} on {self.backend}; see `torchx list -s {self.backend}`")
        pool, arec = found
        where = {(p.role, p.replica_id): p.host_index for p in arec.placement}
        missing = [f"{r}/{k}" for r, k in replicas if (r, k) not in where]
        if missing:
            have = ", ".join(f"{p.role}/{p.replica_id}" for p in arec.placement)
            raise MonarchError(f"app {app_id!r} has no replica {', '.join(missing)} (it has {have})")
        return pool, arec, where

    def follow_logs(
        self,
        app_id: str,
        replicas: builtins.list[tuple[str, int]],
        regex: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        streams: Stream | None = None,
    ) -> Iterator[LogEvent]:
        """``torchx log --tail`` of ``replicas``: their lines as they are written, as LogEvents
        (``agent/log_follow.py``), until every replica ended. One stream per group of the relay
        tree's first level, not one per replica; a host that cannot be followed is an ``error``
        event naming it, and the others go on."""
        import queue

        from ..agent.log_follow import LogEvent, check_filters, follow_group
        from ..net import fanout as relay
        from ..wire import UnknownOperation

        stopped = self._lookup_stopped(app_id) if self._lookup(app_id) is None else None
        if stopped is not None:  # its pool was stopped: every replica ended, its lines are in its files
            where = {(p.role, p.replica_id): p.host_index for p in stopped[0].placement}
            for role, k in replicas:
                host = where.get((role, k), -1)
                try:
                    yield LogEvent(
                        host, role, k, lines=list(self.log_iter(app_id, role, k, regex, since, until, False, streams))
                    )
                    yield LogEvent(host, role, k, replica_ended=True)
                except MonarchError as e:
                    yield LogEvent(host, role, k, error=str(e), kind=type(e).__name__)
            return
        pool, arec, where = self._placed(app_id, replicas, wait=True)
        if any(where[r] == apps.UNPLACED for r in replicas):  # it left the queue without starting
            for role, k in replicas:
                yield LogEvent(-1, role, k, replica_ended=True)
            return
        args = _log_selection(arec, replicas, regex, since, until, streams)
        try:
            check_filters(args["streams"], regex)
        except ValueError as e:
            raise MonarchError(str(e)) from None
        events: queue.Queue[dict[str, Any] | None] = queue.Queue(1024)  # full: the followers wait
        hosts = sorted({where[r] for r in replicas})
        if len(hosts) > 1:
            pool.hosts  # noqa: B018 (many hosts: one read of the pool's view, not one file each)
        targets, errors, tunnel = pool.tree_targets(hosts)
        groups = relay.split(targets, relay.FANOUT)
        stop = threading.Event()
        clients: list[Any] = []

        def put(ev: dict[str, Any] | None) -> None:  # never blocks a follower once the reader has gone
            while not stop.is_set():
                try:
                    events.put(ev, timeout=0.5)
                    return
                except queue.Full:
                    continue

        def run(group: list[Any]) -> None:
            try:
                follow_group(group, pool.record.credentials, args, relay.FANOUT, put, stop, clients.append, tunnel)
            finally:
                put(None)

        def old_agent(role: str, k: int) -> None:  # a host whose agent predates app_logs_follow: its own stream
            try:
                for line in self.log_iter(app_id, role, k, regex, since, until, True, streams):
                    put({"host": where[(role, k)], "role": role, "replica_id": k, "lines": [line]})
                put({"host": where[(role, k)], "role": role, "replica_id": k, "replica_ended": True})
            except MonarchError as e:
                put({"host": where[(role, k)], "role": role, "replica_id": k, "error": str(e), "kind": "MonarchError"})
            finally:
                put(None)

        for g in groups:
            threading.Thread(target=run, args=(g,), daemon=True, name="monarch-torchx-log-follow").start()
        left = len(groups)
        ended = set()  # (role, k) whose end, or whose host's failure, was reported
        failed_hosts = set()
        try:
            recorded = history.read_ends(pool.record.path, arec.app_id)

            def host_failed(i: int, error: LogEvent) -> Iterator[LogEvent]:
                """A host that cannot be followed: its replicas that ended (recorded) from their
                files, when they are on this file system (an idled-out pool); else the error."""
                mine = [(r, k) for r, k in replicas if where[(r, k)] == i]
                if mine and all(
                    rk in recorded and _replica_dir(pool.record.path, _replica_place(app_id, arec, *rk), arec).is_dir()
                    for rk in mine
                ):
                    for r, k in mine:
                        lines = list(self.log_iter(app_id, r, k, regex, since, until, False, streams))
                        ended.add((r, k))
                        yield LogEvent(i, r, k, lines=lines)
                        yield LogEvent(i, r, k, replica_ended=True)
                    return
                failed_hosts.add(i)
                yield error

            for i, err in sorted(errors.items()):
                yield from host_failed(i, LogEvent(i, error=str(err), kind=type(err).__name__))
            while left or not events.empty():
                raw = events.get()
                if raw is None:
                    left -= 1
                    continue
                ev = LogEvent.from_wire(raw)
                if ev.error and not ev.role and ev.raised(UnknownOperation):
                    mine = [(r, k) for r, k in replicas if where[(r, k)] == ev.host]
                    for r, k in mine:
                        left += 1
                        threading.Thread(
                            target=old_agent, args=(r, k), daemon=True, name="monarch-torchx-log-follow"
                        ).start()
                    continue
                if ev.replica_ended or (ev.error and ev.role):
                    ended.add((ev.role, ev.replica_id))
                elif ev.error and not ev.role:
                    yield from host_failed(ev.host, ev)
                    continue
                yield ev
            for r, k in replicas:  # each replica ends with its end or its host's failure: anything else is a gap
                if (r, k) not in ended and where[(r, k)] not in failed_hosts:
                    yield LogEvent(
                        where[(r, k)],
                        r,
                        k,
                        error=f"its host {where[(r, k)]} stopped following it before it ended",
                        kind="LookupError",
                    )
        finally:
            stop.set()
            for c in list(clients):
                c.abort()

    def _direct_logs(
        self,
        app_id: str,
        role: str,
        k: int,
        host: int,
        regex: str | None,
        since: datetime | None,
        until: datetime | None,
        streams: Stream | None,
    ) -> Iterator[str]:
        """``log_iter``'s own stream, opened when it is read (not before), its failure naming the replica."""
        try:
            yield from self.log_iter(app_id, role, k, regex, since, until, False, streams)
        except MonarchError as e:
            raise MonarchError(f"logs of {role}/{k} (host {host}) unavailable: {e}") from None


def _replica_place(app_id: str, arec: AppRecord, role: str, k: int) -> Placement:
    place = next((p for p in arec.placement if p.role == role and p.replica_id == k), None)
    if place is None:
        have = ", ".join(f"{p.role}/{p.replica_id}" for p in arec.placement)
        raise MonarchError(f"app {app_id!r} has no replica {role}/{k} (it has {have})")
    return place


def _replica_dir(state_dir: Path, place: Placement, arec: AppRecord) -> Path:
    """Where the agent of host ``place.host_index`` wrote the replica's output (``ProcTable``)."""
    return Path(state_dir) / "logs" / f"host{place.host_index}" / arec.app_id / place.role / str(place.replica_id)


def _from_files(
    state_dir: Path,
    place: Placement,
    arec: AppRecord,
    names: tuple[str, ...],
    window: tuple[float | None, float | None, str | None],
    unavailable: Exception,
) -> Iterator[str]:
    """The replica's lines from its files; ``unavailable`` (raised when read) if there are none here."""
    d = _replica_dir(state_dir, place, arec)
    if not d.is_dir():
        return _failed(unavailable)
    return read_files(d, names, *window)


def _or_files(
    agent_lines: Iterable[str],
    state_dir: Path,
    place: Placement,
    arec: AppRecord,
    names: tuple[str, ...],
    window: tuple[float | None, float | None, str | None],
) -> Iterator[str]:
    """The agent's lines; if the agent cannot give any (it no longer knows the replica: a
    restarted host), the files' instead."""
    it = iter(agent_lines)
    try:
        first = next(it)
    except StopIteration:
        return
    except MonarchError as e:
        yield from _from_files(state_dir, place, arec, names, window, e)
        return
    yield first
    yield from it


def _log_selection(
    arec: AppRecord,
    replicas: list[tuple[str, int]],
    regex: str | None,
    since: datetime | None,
    until: datetime | None,
    streams: Stream | None,
) -> dict[str, Any]:
    """What an agent's ``app_logs`` and ``app_logs_follow`` take to pick ``replicas``' lines: a role
    and replica ids (None: all of them), the stream, the time window and the filter."""
    roles = {r for r, _ in replicas}
    every = len(replicas) == sum(1 for p in arec.placement if p.role in roles)
    return {
        "app_id": arec.app_id,
        "role": next(iter(roles)) if len(roles) == 1 else None,
        "replica_ids": None if every else sorted({k for _, k in replicas}),
        "streams": streams.value if isinstance(streams, Stream) else (streams or "combined"),
        "since": since.timestamp() if since else None,
        "until": until.timestamp() if until else None,
        "regex": regex,
    }


def _declared_capacity(cfg: dict[str, Any]) -> dict[str, Any]:
    """The capacity a run declares per host (``cpus_per_host`` ...), checked; MonarchError naming a bad one."""
    out: dict[str, Any] = {}
    for name in CAPACITY_KEYS:
        value = cfg.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise MonarchError(f"{name}={value!r} is invalid: a capacity is a number, 0 or more")
        out[name] = value
    return out


def _log_limits(cfg: dict[str, Any]) -> dict[str, float]:
    """The pool's log limits (MiB) from a run's cfg; MonarchError naming one that is not positive."""
    out = {}
    for name, default in (("log_max_mb", REPLICA_MAX_MB), ("log_pool_max_mb", POOL_MAX_MB)):
        value = cfg.get(name)
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise MonarchError(f"{name}={value!r} is invalid: a log limit is a positive number of MiB")
        out[name] = float(value)
    return out


def _later(lines: Callable[[], Iterable[str]]) -> Iterator[str]:
    """``lines()``'s lines, opened when first read (so one replica's failure is raised as its own)."""
    yield from lines()


def _failed(error: Exception) -> Iterator[str]:
    """Lines that raise ``error`` when they are read, not before (a generator)."""
    yield from ()
    raise error


def _still_queued(pool: Pool, arec: AppRecord) -> bool:
    entry = apps.placed(pool, arec)[1]
    return entry is not None and entry.state in (QueueState.QUEUED, QueueState.UNREACHABLE)


def _placement(pool: Pool, sub: SubmittedApp) -> dict[tuple[str, int], int]:
    """Where ``sub``'s replicas go now, from every host's load (``scheduling.place``); raises
    ``apps.MustWait`` when it does not fit (or apps wait in the pool's queue before it), and a
    one-line MonarchError when it never could. A host that did not answer is left out; if the app
    does not fit without it, its error is raised, so ``apps.start`` checks the pool (and repairs a
    lost host) as for a launch that did not reach it."""
    loads, errors = apps.pool_loads(pool)
    if any(isinstance(e, UnknownOperation) for e in errors.values()):  # agents of an earlier version
        return {(s.role, s.replica_id): s.replica_id for s in sub.specs}  # (replica i on host i, as they placed)
    unanswered = [errors[i] for i in sorted(errors)]
    apps.fit_to_pool(pool, sub, loads, _progress)
    ask = sub.ask()
    try:  # (on the hosts the pool may grow to, where it grows by itself)
        check_fits_somewhere(ask, scheduling.with_empty_hosts(loads, _may_grow_to(pool)), pool.name)
    except NeverFits as e:
        if unanswered:
            raise unanswered[0] from None
        raise MonarchError(f"{e}; ask for less, or use a pool with bigger hosts") from None
    queued = next((load.queued for load in loads if load.index == QUEUE_HOST), 0)
    placement = scheduling.place(ask, loads) if not queued else None
    if placement is None:
        if unanswered:
            raise unanswered[0]
        free = ", ".join(f"host {load.index}: {load.free.describe()}" for load in loads)
        why = f"{queued} app(s) wait in its queue before it" if queued else f"it asks {ask.need()}; free: {free}"
        raise apps.MustWait(why + _grows_for_it(pool), pool)
    return placement


def _hosts_with_time(pool: Pool, req: PoolRequest, want: int) -> list[int] | None:
    """The hosts a run with ``min_time_left`` may go to (those whose allocation has that much
    left: ``hosts_with_time``), or None (no such option, or every host has it); a one-line
    MonarchError when fewer than the ``want`` hosts it needs have it."""
    need = req.options.get("min_time_left_s")
    find = getattr(pool.provisioner, "hosts_with_time", None)
    if not need or find is None:
        return None
    ok = find(pool.record, need)
    if len(ok) >= pool.record.num_hosts:
        return None
    if len(ok) < want:
        short = pool.provisioner.short_of(pool.record, need)  # type: ignore[attr-defined]  # (beside hosts_with_time)
        raise MonarchError(
            f"the app needs {want} host(s) with min_time_left={req.options.get('min_time_left')} left, but pool "
            f"{pool.name!r} has {len(ok)} ({short}); an allocation cannot be extended: "
            f"`monarch-torchx pool stop {pool.name}` and run again for a new one"
        )
    return ok


def _may_grow_to(pool: Pool) -> int:
    """The most hosts the pool grows to by itself (``-cfg max_nodes`` on SLURM), else its size."""
    return max(pool.record.num_hosts, int(pool.record.options.get("max_nodes") or 0))


def _grows_for_it(pool: Pool) -> str:
    """What a waiting app is told of a pool that grows by itself, or ""."""
    most = pool.record.options.get("max_nodes")
    if not most or pool.record.num_hosts >= most:
        return ""
    after = pool.record.options.get("backlog_s", 30.0)
    return f"; the pool grows for it (max_nodes={most}) once it has waited {after:g}s"


def _progress(msg: str) -> None:
    print(f"monarch-torchx: {msg}", file=sys.stderr, flush=True)


def _lines(batches: Iterable[list[str]], client: Any) -> Iterable[str]:
    from ..wire import RemoteError, WireError

    try:
        for batch in batches:
            yield from batch
    except (RemoteError, WireError) as e:
        raise MonarchError(f"logs unavailable: {e}") from None
    finally:
        client.close()
