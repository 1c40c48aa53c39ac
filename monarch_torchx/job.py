"""Monarch's job API (``monarch.job``) over warm pools: the same classes, arguments and meaning.

A Monarch program starts with ``job = SlurmJob(meshes={"trainers": 2}, ...)`` and
``job.state().trainers`` (a HostMesh). Here a job is one warm pool: ``apply()`` makes sure the pool
exists (a no-op on a live pool that matches; our fingerprint reuse is the job's ``can_run``), and
each mesh is a slice of the pool's hosts, in the order the meshes are named. ``state()`` caches
the job (pickled, as Monarch's ``.monarch/job_state.pkl``), so the next run of the script reuses
the allocation while it can run the spec, and replaces it when it cannot.

    from monarch_torchx.job import SlurmJob          # was: from monarch.job import SlurmJob
    job = SlurmJob(meshes={"trainers": 2}, partition="debug", time_limit="01:00:00")
    procs = job.state().trainers.spawn_procs({"gpus": 8})

What is knowingly different from Monarch is listed in docs/actors.md ("monarch.job").
"""

from __future__ import annotations

import os
import pickle
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from .errors import MonarchError

DEFAULT_JOB_PATH = ".monarch/job_state.pkl"

__all__ = [
    "DEFAULT_JOB_PATH",
    "ImageSpec",
    "JobState",
    "JobTrait",
    "KubernetesJob",
    "LocalJob",
    "ProcessJob",
    "SlurmJob",
    "job_load",
    "job_loads",
]


class JobState:
    """The meshes of a running job, one attribute per mesh name (each a HostMesh)."""

    def __init__(self, hosts: dict[str, Any]):
        self._hosts = dict(hosts)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._hosts[name]
        except KeyError:
            raise AttributeError(f"job has no mesh {name!r} (meshes: {', '.join(self._hosts) or 'none'})") from None

    def __dir__(self) -> Iterable[str]:
        return [*super().__dir__(), *self._hosts]

    def __repr__(self) -> str:
        return f"JobState({', '.join(f'{k}={v!r}' for k, v in self._hosts.items())})"


class JobTrait:
    """A declarative job: what it asks for, and (once applied) the pool that serves it."""

    def __init__(self) -> None:
        self._status = "not_running"
        self._apply_id: str | None = None

    # ------------------------------------------------------------ what subclasses say

    def _meshes(self) -> dict[str, int]:
        """Mesh name -> hosts, in the order the meshes are laid out on the pool."""
        raise NotImplementedError

    def _pool(self) -> tuple[str, str, dict[str, Any]]:
        """(scheduler, pool name, run options as for `torchx run -cfg`) of the pool that serves the job."""
        raise NotImplementedError

    # ------------------------------------------------------------ Monarch's API

    @property
    def apply_id(self) -> str | None:
        return self._apply_id

    @property
    def active(self) -> bool:
        return self._status == "running"

    def apply(self, client_script: str | None = None) -> None:
        """Makes sure the job's pool runs and matches the spec (a no-op on a live one that does)."""
        if client_script is not None:
            raise MonarchError(
                "apply(client_script=...) is not supported: run the script where the client runs "
                "(the pool is reached from there)"
            )
        if self.active:
            return
        self._ensure()
        self._apply_id = uuid.uuid4().hex
        self._status = "running"

    def can_run(self, spec: JobTrait) -> bool:
        """Whether this (cached, running) job serves ``spec``: the same kind and arguments, and its pool alive."""
        return type(spec) is type(self) and spec._spec() == self._spec() and self._alive()

    def state(self, cached_path: str | None = DEFAULT_JOB_PATH) -> JobState:
        """The job's meshes. A cached job (``cached_path``) that can run this spec is reused (no new
        allocation); one that cannot is killed and this spec is applied, then cached."""
        if not self.active and cached_path is not None:
            cached = _load_cached(cached_path)
            if cached is not None and cached.can_run(self):
                cached_state = self._connect()  # (the same pool: its spec is this one's)
                self.__dict__.update({k: v for k, v in cached.__dict__.items() if k in ("_status", "_apply_id")})
                return cached_state
            if cached is not None:
                try:
                    cached.kill()
                except (MonarchError, NotImplementedError, OSError):
                    pass
                Path(os.path.realpath(cached_path)).unlink(missing_ok=True)
        if not self.active:
            self.apply()
            if cached_path is not None:
                Path(cached_path).parent.mkdir(parents=True, exist_ok=True)
                self.dump(cached_path)
        return self._connect()

    def kill(self) -> None:
        """Ends the job: its pool is stopped (the allocation released)."""
        from .pool import stop_pool
        from .registry import Registry

        _, name, _ = self._pool()
        if Registry().get(name) is not None:
            stop_pool(name)
        self._status = "not_running"

    def dump(self, filename: str) -> None:
        from .private import write_private_bytes

        write_private_bytes(Path(os.path.realpath(filename)), self.dumps())

    def dumps(self) -> bytes:
        return pickle.dumps(self)

    # ------------------------------------------------------------ ours

    def _spec(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def _alive(self) -> bool:
        from .pool import attach

        try:
            return all(h.ok for h in attach(self._pool()[1]).health())
        except MonarchError:
            return False

    def _ensure(self) -> Any:
        scheduler, name, cfg = self._pool()
        return ensure_job_pool(scheduler, name, cfg, sum(self._meshes().values()))

    def _connect(self) -> JobState:
        from .actor.mesh import attach

        hosts = attach(self._pool()[1])
        meshes, start = {}, 0
        for name, n in self._meshes().items():
            meshes[name] = hosts.slice(hosts=slice(start, start + n))
            start += n
        return JobState(meshes)


def ensure_job_pool(scheduler: str, name: str, cfg: dict[str, Any], hosts: int) -> Any:
    """The running pool of a job: ``hosts`` hosts, made with ``cfg`` (run options, as for
    ``torchx run -cfg``). A pool that differs is replaced, as Monarch replaces a job's allocation."""
    from .pool import ensure_pool
    from .schedulers.base import MonarchScheduler

    sched = MonarchScheduler("monarch_torchx.job", scheduler)
    resolved = sched.run_opts().resolve({k: v for k, v in cfg.items() if v is not None})
    resolved["pool"] = name
    req = sched._pool_request(dict(resolved), hosts)
    req.spec["hosts"] = hosts
    req.replace = True
    return ensure_pool(req, defaults={"preload": "torch"})


def check_meshes(meshes: dict[str, int]) -> dict[str, int]:
    if not isinstance(meshes, dict) or not meshes:
        raise ValueError("meshes must be a non-empty dict of mesh name -> number of hosts")
    for name, n in meshes.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"mesh name {name!r} must be a Python identifier (it is an attribute of job.state())")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"mesh {name!r} needs a positive number of hosts, not {n!r}")
    return dict(meshes)


def _pool_name(job_name: str, kind: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{job_name}-{kind}").strip("-.")[:60] or f"job-{kind}"


class LocalJob(JobTrait):
    """Every mesh is this host (``this_host()``), as Monarch's LocalJob; it is never reused from a cache."""

    def __init__(self, hosts: Sequence[str] = ("hosts",)):
        super().__init__()
        self.hosts = tuple(hosts)
        check_meshes({h: 1 for h in self.hosts})

    def _meshes(self) -> dict[str, int]:
        return {h: 1 for h in self.hosts}

    def apply(self, client_script: str | None = None) -> None:
        if client_script is not None:
            raise MonarchError("apply(client_script=...) is not supported: run the script where the client runs")
        self._apply_id = uuid.uuid4().hex
        self._status = "running"

    def can_run(self, spec: JobTrait) -> bool:
        return False  # as Monarch's: the current spec is always applied

    def kill(self) -> None:
        self._status = "not_running"  # this host is not ours to end

    def _connect(self) -> JobState:
        from .actor.mesh import this_host

        return JobState({h: this_host() for h in self.hosts})


class ProcessJob(JobTrait):
    """Meshes of local hosts (``monarch_local`` agents on this machine): mesh name -> hosts."""

    def __init__(self, meshes: dict[str, int], env: dict[str, str] | None = None):
        super().__init__()
        self.meshes = check_meshes(meshes)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in (env or {}).items()):
            raise ValueError("ProcessJob env must map strings to strings")
        self.env = dict(env or {})  # added to every proc's environment on these hosts, as Monarch's workers'

    def _meshes(self) -> dict[str, int]:
        return self.meshes

    def _spec(self) -> dict[str, Any]:
        # as Monarch's: the environment does not decide whether a running job serves this one (the
        # procs of the job that serves get this job's env: it is applied where they are spawned)
        return {k: v for k, v in super()._spec().items() if k != "env"}

    def _connect(self) -> JobState:
        state = super()._connect()
        return JobState({name: mesh._with_env(self.env) for name, mesh in state._hosts.items()})

    def _pool(self) -> tuple[str, str, dict[str, Any]]:
        return "monarch_local", _pool_name("process-job-" + "-".join(self.meshes), "local"), {}


class SlurmJob(JobTrait):
    """One SLURM allocation for all the meshes (a ``monarch_slurm`` pool), nodes split among them in order."""

    def __init__(
        self,
        meshes: dict[str, int],
        python_exe: str = "python",
        slurm_args: Sequence[str] = (),
        monarch_port: int = 22222,
        job_name: str = "monarch_job",
        ntasks_per_node: int = 1,
        time_limit: str | None = None,
        partition: str | None = None,
        log_dir: str | None = None,
        exclusive: bool = True,
        gpus_per_node: int | None = None,
        cpus_per_task: int | None = None,
        mem: str | None = None,
        job_start_timeout: int | None = None,
        account: str | None = None,
        qos: str | None = None,
        out_of_cluster: bool = False,
        attach_to: str | None = None,
    ):
        super().__init__()
        self.meshes = check_meshes(meshes)
        if slurm_args:
            raise MonarchError(
                "SlurmJob(slurm_args=...) is not supported: use the named arguments "
                "(partition, time_limit, account, qos, gpus_per_node, cpus_per_task, mem, exclusive)"
            )
        if ntasks_per_node != 1:
            raise MonarchError(
                "SlurmJob(ntasks_per_node=...): one agent per node serves every proc of the node; "
                "ask for procs with spawn_procs(per_host=...)"
            )
        if out_of_cluster or attach_to:
            raise MonarchError(
                "SlurmJob(out_of_cluster/attach_to): not supported; run the client where sbatch runs (a login node)"
            )
        self.python_exe, self.monarch_port, self.job_name = python_exe, monarch_port, job_name
        self.time_limit, self.partition, self.log_dir, self.exclusive = time_limit, partition, log_dir, exclusive
        self.gpus_per_node, self.cpus_per_task, self.mem = gpus_per_node, cpus_per_task, mem
        self.job_start_timeout, self.account, self.qos = job_start_timeout, account, qos

    def _meshes(self) -> dict[str, int]:
        return self.meshes

    def _spec(self) -> dict[str, Any]:  # as Monarch's can_run: exclusive and log_dir do not decide reuse
        return {k: v for k, v in super()._spec().items() if k not in ("exclusive", "log_dir")}

    def _pool(self) -> tuple[str, str, dict[str, Any]]:
        cfg = {
            "partition": self.partition,
            "time": self.time_limit,
            "account": self.account,
            "qos": self.qos,
            "gpus_per_node": self.gpus_per_node,
            "cpus_per_task": self.cpus_per_task,
            "mem": self.mem,
            "exclusive": self.exclusive,
            "job_dir": self.log_dir,
            "start_timeout": f"{self.job_start_timeout}s" if self.job_start_timeout else None,
        }
        return "monarch_slurm", _pool_name(self.job_name, "slurm"), cfg


@dataclass(frozen=True)
class ImageSpec:
    """The image of a Kubernetes mesh's pods and their resources (Monarch's ``ImageSpec``):
    ``resources`` as Kubernetes writes them, e.g. {"cpu": "2", "memory": "4Gi", "nvidia.com/gpu": 1}."""

    image: str
    resources: dict[str, Any] | None = None


def _mebibytes(quantity: Any) -> int:
    units = {
        "Ki": 1 / 1024,
        "Mi": 1,
        "Gi": 1024,
        "Ti": 1 << 20,
        "K": 1e3 / (1 << 20),
        "M": 1e6 / (1 << 20),
        "G": 1e9 / (1 << 20),
    }
    text = str(quantity)
    for unit, mib in units.items():
        if text.endswith(unit):
            return max(1, int(float(text[: -len(unit)]) * mib))
    return max(1, int(int(text) / (1 << 20)))


class KubernetesJob(JobTrait):
    """Meshes of pods in one namespace (a ``monarch_kubernetes`` pool), added with ``add_mesh``."""

    def __init__(
        self, namespace: str, timeout: int | None = None, kubeconfig: Any = None, attach_to: str | None = None
    ):
        super().__init__()
        if kubeconfig is not None or attach_to:
            raise MonarchError(
                "KubernetesJob(kubeconfig/attach_to): not supported; set KUBECONFIG (and its "
                "current context) where the client runs, with pod IPs reachable from it"
            )
        self.namespace, self.timeout = namespace, timeout
        self.meshes: dict[str, int] = {}
        self.images: dict[str, ImageSpec] = {}
        self.ports: dict[str, int] = {}

    def add_mesh(
        self,
        name: str,
        num_replicas: int,
        label_selector: str | None = None,
        pod_rank_label: str = "apps.kubernetes.io/pod-index",
        image_spec: ImageSpec | None = None,
        port: int = 26600,
        pod_template: Any = None,
        labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
    ) -> None:
        """Adds a mesh of ``num_replicas`` pods, as Monarch's. The pods are made for the job (our
        agents run in them): attaching to pods found by ``label_selector`` is not supported."""
        if not re.fullmatch(r"[a-z][a-z0-9]{0,62}", name):
            raise ValueError(f"mesh name {name!r}: lowercase letters and digits, starting with a letter, at most 63")
        if label_selector or pod_template is not None or labels or annotations:
            raise MonarchError(
                "add_mesh(label_selector/pod_template/labels/annotations): not supported; "
                "the job makes its own pods from image_spec"
            )
        if image_spec is None:
            raise MonarchError("add_mesh needs image_spec=ImageSpec(image, resources): the job makes its pods")
        if self.images and (next(iter(self.images.values())) != image_spec or next(iter(self.ports.values())) != port):
            raise MonarchError("every mesh of a job here shares one image, resources and port (one pool of pods)")
        self.meshes[name] = check_meshes({name: num_replicas})[name]
        self.images[name], self.ports[name] = image_spec, port

    def _meshes(self) -> dict[str, int]:
        if not self.meshes:
            raise MonarchError("the job has no meshes: add_mesh(name, num_replicas, image_spec=...) first")
        return self.meshes

    def _pool(self) -> tuple[str, str, dict[str, Any]]:
        spec = next(iter(self.images.values()), None)
        res = dict(spec.resources or {}) if spec else {}
        cfg: dict[str, Any] = {
            "namespace": self.namespace,
            "image": spec.image if spec else None,
            "port": next(iter(self.ports.values()), None),
            "access": "pod_ip",
            "start_timeout": f"{self.timeout}s" if self.timeout else None,
        }
        if "cpu" in res:
            cfg["cpu"] = str(res.pop("cpu"))
        if "memory" in res:
            cfg["memMB"] = _mebibytes(res.pop("memory"))
        if "nvidia.com/gpu" in res:
            cfg["gpu"] = int(res.pop("nvidia.com/gpu"))
        if res:
            raise MonarchError(f"ImageSpec resources {sorted(res)}: only cpu, memory and nvidia.com/gpu here")
        name = _pool_name("kjob-" + "-".join(self.meshes or {"none": 0}), "k8s").lower().replace("_", "-")
        return "monarch_kubernetes", name, cfg


def job_loads(data: bytes) -> JobTrait:
    job = pickle.loads(data)
    if not isinstance(job, JobTrait):
        raise MonarchError(f"not a job: {type(job).__name__}")
    return job


def job_load(filename: str = DEFAULT_JOB_PATH) -> JobTrait:
    with open(filename, "rb") as f:
        return job_loads(f.read())


def check_cache_file(path: str) -> bool:
    """Whether a cached job is at ``path``; raises unless it is ours and closed to writers: a
    pickle runs code when loaded, so one that others could have written is refused."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise MonarchError(
            f"refusing to load the cached job {path}: it is not yours or others can write it "
            "(remove it, or pass cached_path=None)"
        )
    return True


def _load_cached(path: str) -> JobTrait | None:
    """The cached job, or None (no file, or one that does not load: it is replaced)."""
    if not check_cache_file(path):
        return None
    try:
        job = job_load(path)
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, MonarchError, ImportError):
        return None
    return job if job.active else None
