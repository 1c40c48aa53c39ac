"""Real Monarch (``torchmonarch``) on a warm pool: a ``monarch.job.JobTrait`` whose hosts are a pool's.

A program written for Monarch's own runtime changes only its job object:

    from monarch_torchx.monarch_backend import WarmPoolJob    # was: from monarch.job import SlurmJob
    job = WarmPoolJob({"trainers": 2}, scheduler="monarch_slurm", pool="dev", cfg={"partition": "debug"})
    trainers = job.state().trainers                          # Monarch's own HostMesh
    procs = trainers.spawn_procs(per_host={"gpus": 8})

``apply()`` (through ``state()``) makes sure the pool runs (created with ``cfg``, the run options
of ``torchx run -cfg``; an existing pool is used as it is, never replaced), then starts Monarch's
worker loop on each host as an app of the pool (``monarch_worker.py``), and ``state()`` attaches
to the workers with Monarch's ``attach_to_workers``. Monarch caches the job
(``.monarch/job_state.pkl``); the next run of the program finds it, ``can_run`` says the workers
still run, and it attaches again: no allocation, no worker start. ``kill()`` ends the workers and
leaves the pool warm, unless the job was made with ``stop_pool_on_kill=True``.

Every worker and the client speak Monarch's ``tls`` transport with a CA and certificate made for
the job, kept in the pool's private state dir: a peer that does not hold them is refused.
Not exercised here: Kubernetes pools (the client must reach the pods' IPs: run it in the cluster).
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path
from typing import Any

from .errors import MonarchError
from .monarch_shared import REFUSAL, TRUST_ENV, private_monarch_log_dir

private_monarch_log_dir()  # before Monarch is imported: the import starts its log (monarch_shared.py)

from monarch._src.job.job import JobState, JobTrait  # noqa: E402
from monarch._src.job.service_identity import allocate_service_proc_ids, service_proc_addr  # noqa: E402
from torchx.schedulers.ids import make_unique  # noqa: E402

from .registry import MONARCH_JOBS_DIR  # noqa: E402

__all__ = ["WarmPoolJob"]

WORKER_ROLE = "monarch_worker"


class WarmPoolJob(JobTrait):
    """Monarch's job contract over one warm pool: mesh name -> hosts, laid out on the pool in order.

    Args:
        meshes: mesh name -> number of hosts (each name is an attribute of ``state()``).
        scheduler: the pool's engine: ``monarch_local``, ``monarch_slurm`` (or ``monarch_kubernetes``).
        pool: the pool's name (default: ``monarch-<mesh names>``).
        cfg: run options for a pool this job creates (``torchx runopts SCHEDULER``).
        stop_pool_on_kill: ``kill()`` also stops the pool (default: the pool stays warm).
        trust_local_users: nobody else can log into the machines of the client and the pool (or
            ``MONARCH_TORCHX_TRUST_LOCAL_USERS=1``). Required: Monarch's runtime serves every host
            and client on an unauthenticated local socket (``monarch_shared.py``).
    """

    def __init__(
        self,
        meshes: dict[str, int],
        scheduler: str = "monarch_local",
        pool: str | None = None,
        cfg: dict[str, Any] | None = None,
        stop_pool_on_kill: bool = False,
        trust_local_users: bool = False,
    ):
        from .job import check_meshes
        from .schedulers import PROVISIONERS

        if not (trust_local_users or os.environ.get(TRUST_ENV) == "1"):
            raise MonarchError(REFUSAL)
        super().__init__()
        if scheduler not in PROVISIONERS:
            raise ValueError(f"scheduler {scheduler!r}: use one of {', '.join(PROVISIONERS)}")
        self.meshes = check_meshes(meshes)
        self.scheduler = scheduler
        self.pool = pool or "monarch-" + "-".join(self.meshes)
        self.cfg = dict(cfg or {})
        self.stop_pool_on_kill = stop_pool_on_kill
        self._app_id: str | None = None
        self._workers: list[str] = []  # one proc address per host, in mesh order
        self._client_ip = "127.0.0.1"

    # ------------------------------------------------------------ Monarch's contract

    def _create(self, client_script: str | None) -> None:
        if client_script is not None:
            raise MonarchError(
                "WarmPoolJob runs no batch client (apply(client_script=...)): run the script "
                "where the client runs; it reaches the pool from there"
            )
        from . import apps
        from .credentials import new_monarch_tls
        from .specs import LaunchSpec

        total = sum(self.meshes.values())
        pool = self._ensure_pool(total)
        hosts = pool.hosts[:total]
        if any(h is None for h in hosts):
            raise MonarchError(f"pool {self.pool!r} has hosts without an agent: `torchx pool status {self.pool}`")
        self._client_ip = _route_to(hosts[0].host)
        ports = {i: port for i, port, err in pool.ask("reserve_port", range(total), timeout=15.0) if err is None}
        if len(ports) < total:
            raise MonarchError(
                f"hosts {sorted(set(range(total)) - set(ports))} of pool {self.pool!r} did not "
                "answer: `torchx pool status` says why"
            )
        app_id = make_unique("monarch-workers")
        names = [self._client_ip, "127.0.0.1", "localhost", *(h.host for h in hosts), *(h.hostname for h in hosts)]
        bundle = new_monarch_tls(app_id, [n for n in names if n])
        tls_dir = Path(pool.record.state_dir) / MONARCH_JOBS_DIR / app_id
        _write_tls(tls_dir, bundle)
        ids = allocate_service_proc_ids(total)
        workers = [service_proc_addr(f"tls://{_url_host(h.host)}:{ports[i]}", ids[i]) for i, h in enumerate(hosts)]
        from .monarch_worker import ADDRESS_ENV, TLS_ENV

        # the address (which names the worker's service proc) in its environment, which only its
        # owner can read, not on its command line, which every user of the node can
        specs = [
            (
                i,
                LaunchSpec(
                    app_id=app_id,
                    role=WORKER_ROLE,
                    replica_id=i,
                    argv=["python", "-m", "monarch_torchx.monarch_worker"],
                    env={TLS_ENV: bundle, ADDRESS_ENV: addr},
                ),
            )
            for i, addr in enumerate(workers)
        ]
        try:
            apps.launch(
                pool,
                app_id,
                "monarch-workers",
                [
                    {
                        "name": WORKER_ROLE,
                        "image": "",
                        "entrypoint": "python",
                        "args": ["-m", "monarch_torchx.monarch_worker"],
                        "num_replicas": total,
                    }
                ],
                specs,
            )
        except BaseException:
            shutil.rmtree(
                tls_dir, ignore_errors=True
            )  # all or nothing, as the launch: no keys of workers that never ran
            raise
        self._app_id, self._workers = app_id, workers

    def _state(self) -> JobState:
        """Monarch's HostMeshes of the running workers (``self`` is the job that started them, or
        its cached copy)."""
        if not self._workers:
            raise MonarchError("the job has no workers: apply() it first")
        from monarch._rust_bindings.monarch_hyperactor.config import reload_config_from_env
        from monarch.actor import attach_to_workers, enable_transport

        os.environ.update(_client_tls_env(self))  # Monarch reads its TLS files from these,
        reload_config_from_env()  # and had read its environment when it was imported
        enable_transport(f"tls://{_url_host(self._client_ip)}:0")
        meshes, start = {}, 0
        for name, n in self.meshes.items():
            meshes[name] = attach_to_workers(
                name=name, ca="trust_all_connections", workers=self._workers[start : start + n]
            )
            start += n
        return JobState(meshes)

    def can_run(self, spec: JobTrait) -> bool:
        """A cached job serves ``spec`` while it asks for the same meshes of the same pool and every
        one of its workers still runs there."""
        return (
            isinstance(spec, WarmPoolJob)
            and spec.meshes == self.meshes
            and spec.scheduler == self.scheduler
            and spec.pool == self.pool
            and spec.cfg == self.cfg
            and self._workers_running()
        )

    def _kill(self) -> None:
        from . import apps
        from .pool import attach, stop_pool
        from .registry import Registry

        reg = Registry()
        rec = reg.get(self.pool)
        if rec is not None and self._app_id:
            arec = Registry.get_app(rec, self._app_id)
            if arec is not None:
                apps.kill(attach(self.pool, reg), arec)
            shutil.rmtree(Path(rec.state_dir) / MONARCH_JOBS_DIR / self._app_id, ignore_errors=True)
        if rec is not None and self.stop_pool_on_kill:
            stop_pool(self.pool, reg)
        self._workers = []

    # ------------------------------------------------------------ the cache, kept private

    def _load_cached(self, cached_path: str | None) -> JobTrait | None:
        """Monarch's, after a check: loading a pickle runs code, so a cache that is not ours, or
        that others could have written, is refused."""
        from .job import check_cache_file

        if cached_path is not None:
            check_cache_file(cached_path)
        return super()._load_cached(cached_path)

    def dump(self, filename: str) -> None:
        """Monarch's, written 0600 (the cache names the pool's workers)."""
        from .private import write_private_bytes

        path = Path(os.path.realpath(filename))
        path.parent.mkdir(parents=True, exist_ok=True)
        write_private_bytes(path, self.dumps())

    # ------------------------------------------------------------ ours

    def _ensure_pool(self, hosts: int) -> Any:
        """The job's pool, running: created with ``cfg`` when it does not exist. An existing pool is
        used as it is (it may serve other apps: it is never replaced for a job), if it has the hosts."""
        from .job import ensure_job_pool
        from .pool import PoolRequest, ensure_pool
        from .registry import Registry, create_hint

        rec = Registry().get(self.pool)
        if rec is None:
            return ensure_job_pool(self.scheduler, self.pool, self.cfg, hosts)
        if rec.scheduler != self.scheduler:
            raise MonarchError(
                f"pool {self.pool!r} runs on {rec.scheduler}, not {self.scheduler}: pass "
                f"scheduler={rec.scheduler!r}, or another pool name"
            )
        if rec.num_hosts < hosts:
            raise MonarchError(
                f"pool {self.pool!r} has {rec.num_hosts} host(s) and the job's meshes need {hosts}: "
                f"use another pool name (it is created with them), or {create_hint(self.pool, self.scheduler)} "
                "after `torchx pool stop`"
            )
        return ensure_pool(PoolRequest(rec.scheduler, self.pool, spec={}))

    def _workers_running(self) -> bool:
        from . import apps
        from .pool import attach
        from .registry import Registry
        from .specs import RUNNING

        if not self._app_id:
            return False
        try:
            rec = Registry().get(self.pool)
            arec = Registry.get_app(rec, self._app_id) if rec else None
            if arec is None:
                return False
            states = apps.replica_states(attach(self.pool), arec)
        except MonarchError:
            return False
        return len(states) == len(self._workers) and all(s.state == RUNNING for s in states.values())


def _route_to(host: str) -> str:
    """This machine's address on the way to ``host`` (the address the workers dial back to)."""
    if host.startswith("unix:") or host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # a datagram socket's connect sends nothing: it only picks the route
        return s.getsockname()[0]


def _url_host(host: str) -> str:
    if host.startswith("unix:"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def _write_tls(directory: Path, bundle: str) -> None:
    from .monarch_worker import install_tls
    from .private import private_dir

    install_tls(bundle, private_dir(directory, from_=directory.parent))


def _client_tls_env(job: WarmPoolJob) -> dict[str, str]:
    from .monarch_worker import tls_env
    from .registry import Registry

    env = tls_env(Path(Registry().require(job.pool).state_dir) / MONARCH_JOBS_DIR / str(job._app_id))
    missing = [p for p in env.values() if not os.path.exists(p)]
    if missing:
        raise MonarchError(f"the job's TLS files are gone ({missing[0]}): kill the job and apply it again")
    return env
