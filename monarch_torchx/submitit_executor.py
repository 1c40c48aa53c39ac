"""submitit plugin: ``submitit.AutoExecutor(folder, cluster="monarch")`` runs jobs on a warm pool.

    ex = submitit.AutoExecutor(folder="logs/%j", cluster="monarch")
    ex.update_parameters(monarch_pool="dev", nodes=1, tasks_per_node=2, timeout_min=10)
    job = ex.submit(fn, 1, 2); job.result()

No sbatch: each task is ``python -u -m submitit.core._submit FOLDER`` started by the pool's agents
(from the warm fork server), with submitit's usual files in ``folder``. A job is an app on the
pool like any TorchX app (``torchx list`` shows it). ``timeout_min`` is enforced by the agent
(SIGUSR2 ``signal_delay_s`` before, so ``helpers.Checkpointable`` checkpoints, then a kill); a
requeue restarts the task in the pool, never ``scontrol requeue`` of the pool's allocation.
Requeue of a multi-task job restarts the task that asked (rank 0), not its siblings.

``monarch_workers=True`` (or a number: at most that many workers) runs each one-task job as a
call in a kept worker process instead (``task_groups.py``): many small tasks at the cost of a call
each, not of a process. What that gives up (a process of its own per task: its own timeout signal,
requeue, memory) is in ``docs/placement.md``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import time
import typing as tp
import uuid
from pathlib import Path

from submitit.core import core, job_environment, utils

from .app_queue import QUEUE_HOST, QueueState, SubmittedApp
from .errors import HostUnreachable, MonarchError
from .net import RemoteError
from .resources import Resources
from .specs import CANCELLED, FAILED, PENDING, RUNNING, SUCCEEDED, UNKNOWN, LaunchSpec, ReplicaStatus
from .task_groups import Task, TaskGroup, TaskStatus

REQUEUE_CODE = 144
STATE_EVERY_S = 0.5  # how often a waiting job asks the pool for its state (see MonarchJob.wait)
REPAIR_AFTER_S = 5.0  # a waiting job whose state is UNKNOWN this long has its pool's lost hosts repaired
REPAIR_EVERY_S = 30.0  # (and again this often while it stays UNKNOWN)
_NOT_DONE = ("PENDING", "RUNNING", "REQUEUED", "UNKNOWN")  # submitit's states of a job that may still end
_SUBMITIT_STATE = {
    PENDING: "PENDING",
    RUNNING: "RUNNING",
    SUCCEEDED: "COMPLETED",
    FAILED: "FAILED",
    CANCELLED: "CANCELLED",
    UNKNOWN: "UNKNOWN",
}
ENV_PREFIX = "MONARCH_SUBMITIT_"


def _meta_path(folder: Path, job_id: str) -> Path:
    """Where a job records its pool and app id, beside submitit's own files (``folder`` resolved)."""
    return folder / f"{job_id}_monarch.json"


class MonarchJob(core.Job[core.R]):
    """A submitit job whose tasks run on a pool's agents. Picklable; state is asked of the agents."""

    def _where(self) -> tuple[tp.Any, tp.Any]:
        from .pool import attach
        from .registry import Registry

        meta = json.loads(_meta_path(self._paths.folder, self.job_id).read_text())
        pool = attach(meta["pool"])
        arec = Registry.get_app(pool.record, meta["app_id"])
        if arec is None:
            raise MonarchError(f"job {self.job_id} is not known to pool {meta['pool']!r}")
        return pool, arec

    def _ended_on_stopped_pool(self) -> dict[tuple[str, int], ReplicaStatus] | None:
        """The job's states as recorded, if its pool was stopped (``history.py``); else None."""
        from . import apps
        from .registry import Registry

        meta = json.loads(_meta_path(self._paths.folder, self.job_id).read_text())
        reg = Registry()
        live = reg.get(meta["pool"])
        if live is not None and Registry.get_app(live, meta["app_id"]) is not None:
            return None
        for p in reg.stopped(meta["pool"]):
            arec = Registry.app_in(Path(p.state_dir), meta["app_id"])
            if arec is not None:
                return apps.stopped_states(arec, Path(p.state_dir), p.name)
        return None

    def __init__(self, folder: str | Path, job_id: str, tasks: tp.Sequence[int] = (0,)) -> None:
        self._folder_template = folder  # (worker mode: where its group's record is)
        super().__init__(folder, job_id, tasks)

    def _meta(self) -> dict[str, str]:
        """Where the job is: its own record (process mode), or its group's (worker mode, where a
        job's id is ``GROUP_N``, as submitit names the jobs of an array)."""
        if "_" in self.job_id:
            array = self.job_id.split("_", 1)[0]
            folder = utils.JobPaths(self._folder_template, job_id=array).folder
            return json.loads(_meta_path(folder, array).read_text())
        return json.loads(_meta_path(self._paths.folder, self.job_id).read_text())

    def _task_status(self, meta: dict[str, str]) -> TaskStatus:
        """A worker-mode job's state: asked of the pool's queue (host 0), or read from the files
        of its pool if that was stopped."""
        from .pool import attach
        from .registry import Registry

        try:
            pool = attach(meta["pool"])
        except MonarchError:
            ends = ended_tasks(Registry(), meta["pool"], meta["group"])
            if self.job_id in ends:
                return ends[self.job_id]
            raise
        try:
            got = pool.call(QUEUE_HOST, "tasks.status", group_id=meta["group"], task_ids=[self.job_id])
        except RemoteError as e:
            raise MonarchError(f"the pool's queue (host 0) could not say: {e}") from None
        except HostUnreachable as e:  # (the next run repairs it, and its new agent reads the group back)
            return TaskStatus(self.job_id, UNKNOWN, f"host 0, which holds the pool's task groups, did not answer: {e}")
        st = TaskStatus.from_wire(got[0])
        if st.forgotten and self.paths.result_pickle.exists():  # (its group ended long ago: its result says)
            outcome = utils.pickle_load(self.paths.result_pickle)[0]
            st.state, st.msg = (SUCCEEDED, "") if outcome == "success" else (FAILED, "its function raised")
        return st

    @property
    def state(self) -> str:
        from . import apps

        try:
            meta = self._meta()
            if "group" in meta:
                return _SUBMITIT_STATE[self._task_status(meta).state]
            states = self._ended_on_stopped_pool()
            if states is None:
                pool, arec = self._where()
                states = apps.replica_states(pool, arec)
        except (MonarchError, OSError, ValueError) as e:  # pool gone with its files: the job is lost, not pending
            self._lost = str(e)
            return "FAILED"
        if self.task_id is not None and len(states) > 1:
            st = states.get(("task", self.task_id))
            return _SUBMITIT_STATE[st.state.value] if st else "FAILED"
        return _SUBMITIT_STATE[apps.app_state([s.state.value for s in states.values()])]

    def _get_outcome_and_result(self) -> tuple[str, tp.Any]:
        """As submitit's, but a cancelled job's result is not waited for: a cancel leaves none to
        come (submitit waits up to 15 s for one to appear on a slow file system)."""
        if not self.paths.result_pickle.exists() and self.state == "CANCELLED":
            self._results_timeout_s = 0
        return super()._get_outcome_and_result()

    def get_info(self, mode: str = "force") -> dict[str, str]:  # pylint: disable=unused-argument
        return {"State": self.state}

    def done(self, force_check: bool = False) -> bool:  # pylint: disable=unused-argument
        if self._sub_jobs:
            return all(j.done() for j in self._sub_jobs)
        if self.paths.result_pickle.exists():
            return True
        return self.state not in _NOT_DONE

    def wait(self) -> None:
        """As submitit's, but warm jobs finish fast: the result file (which a task writes whether its
        function returned or raised) is looked for from every 5 ms up to every 50 ms, and the pool is
        asked for the job's state (a killed, timed-out or lost task writes none) only every
        ``STATE_EVERY_S``: asking is a connection and a handshake with an agent, which the agents
        would otherwise pay for every job of a map_array while it runs.

        A job whose state stays UNKNOWN (the host that holds it, or the pool's queue on host 0,
        lost) has its pool repaired after REPAIR_AFTER_S, as the next submission would: a waiter
        with nothing more to submit is not left waiting forever for a host nobody restarts."""
        if self._sub_jobs:
            for job in self._sub_jobs:
                job.wait()
            return
        delay = 0.005
        ask_at = time.monotonic() + delay
        repair_at: float | None = None  # while the state is UNKNOWN: when the pool is repaired
        while not self.paths.result_pickle.exists():
            now = time.monotonic()
            if now >= ask_at:
                state = self.state
                if state not in _NOT_DONE:
                    return
                if state != "UNKNOWN":
                    repair_at = None
                elif repair_at is None:
                    repair_at = now + REPAIR_AFTER_S
                elif now >= repair_at:
                    self._repair_pool()
                    repair_at = time.monotonic() + REPAIR_EVERY_S
                ask_at = time.monotonic() + STATE_EVERY_S
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _repair_pool(self) -> None:
        """Repairs the job's pool where its engine says hosts are lost (``ensure_pool``, as a
        submission does; serialized with any other run of the pool). A failed repair is said in one
        line and tried again later: the job may still end."""
        from .pool import PoolRequest, ensure_pool
        from .registry import Registry

        try:
            name = self._meta()["pool"]
            rec = Registry().get(name)
            if rec is not None:
                ensure_pool(PoolRequest(rec.scheduler, name, spec={}), progress=_progress)
        except (MonarchError, OSError, ValueError) as e:
            _progress(f"job {self.job_id} waits on a host that did not answer; repairing its pool failed: {e}")

    def __del__(self) -> None:
        """``job.cancel_at_deletion()`` then ``del job`` cancels a job still running. (submitit's own
        ``__del__`` asks a class-level squeue watcher, which a pool's job has no use for.)"""
        if getattr(self, "_cancel_at_deletion", False) and not self._sub_jobs:
            try:
                if not self.done():
                    self.cancel(check=False)
            except (MonarchError, OSError, ValueError, ImportError):
                pass  # the pool is gone (or the interpreter is ending): nothing left to cancel

    def cancel(self, check: bool = True) -> None:  # pylint: disable=unused-argument
        from . import apps
        from .pool import attach

        try:
            meta = self._meta()
            if "group" in meta:
                try:
                    attach(meta["pool"]).call(
                        QUEUE_HOST, "tasks.cancel", group_id=meta["group"], task_ids=[self.job_id], reason="cancelled"
                    )
                except RemoteError as e:
                    raise MonarchError(f"could not cancel job {self.job_id}: {e}") from None
                return
            apps.kill(*self._where())
        except MonarchError:
            if check:
                raise


def _progress(msg: str) -> None:
    """A pool's progress (creating, repairing, warming), on stderr, as the CLI says it."""
    print(f"monarch-torchx: {msg}", file=sys.stderr, flush=True)


def _task_env(job_id: str) -> dict[str, str]:
    """What a one-task job's function sees of its job (``MonarchJobEnvironment``)."""
    return {
        "SUBMITIT_EXECUTOR": "monarch",
        f"{ENV_PREFIX}JOB_ID": job_id,
        f"{ENV_PREFIX}NTASKS": "1",
        f"{ENV_PREFIX}NUM_NODES": "1",
        f"{ENV_PREFIX}NODEID": "0",
        f"{ENV_PREFIX}GLOBALID": "0",
        f"{ENV_PREFIX}LOCALID": "0",
    }


def ended_tasks(reg: tp.Any, pool_name: str, group_id: str) -> dict[str, TaskStatus]:
    """The recorded ends of a task group of a stopped pool (its holder's ``tasks/GROUP.ends``)."""
    out: dict[str, TaskStatus] = {}
    for p in reg.stopped(pool_name):
        path = Path(p.state_dir) / "tasks" / f"{group_id}.ends"
        with contextlib.suppress(OSError):
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError, TypeError):
                    st = TaskStatus.from_wire(json.loads(line))
                    out[st.task_id] = st
    return out


class MonarchJobEnvironment(job_environment.JobEnvironment):
    """What a task sees of its job (``submitit.JobEnvironment()`` inside the function)."""

    _env = {
        "job_id": f"{ENV_PREFIX}JOB_ID",
        "num_tasks": f"{ENV_PREFIX}NTASKS",
        "num_nodes": f"{ENV_PREFIX}NUM_NODES",
        "node": f"{ENV_PREFIX}NODEID",
        "global_rank": f"{ENV_PREFIX}GLOBALID",
        "local_rank": f"{ENV_PREFIX}LOCALID",
    }

    @property
    def hostnames(self) -> list[str]:
        return os.environ.get(f"{ENV_PREFIX}HOSTNAMES", self.hostname).split(",")

    def _requeue(self, countdown: int) -> None:
        """Exit with the code the agent reads as "run me again"; the pool's allocation is untouched."""
        job_environment.logger.get_logger().info(f"Requeued job {self.job_id} ({countdown} remaining timeouts)")
        sys.exit(REQUEUE_CODE)


class _Enqueuing:
    """The jobs of one submit call, handed to the pool's queue as they are made: the first few at
    once (so the pool starts on them while the rest are still being pickled), then in growing
    batches. What one call submits is all or nothing: a batch that fails cancels those sent before."""

    FIRST, LARGEST = 8, 256

    def __init__(self, pool: tp.Any, loads: list[tp.Any], progress: tp.Callable[[str], None]):
        self.pool, self.loads, self.progress = pool, loads, progress
        self.pending: list[SubmittedApp] = []
        self.sent: list[tp.Any] = []  # the app records of those the queue took
        self.size = self.FIRST
        self.waiting = 0
        self.reason = ""

    def add(self, sub: SubmittedApp) -> None:
        self.pending.append(sub)
        if len(self.pending) >= self.size:
            self.flush()
            self.size = min(self.size * 4, self.LARGEST)

    def flush(self) -> None:
        if not self.pending:
            return
        from . import apps
        from .resources import NeverFits
        from .scheduling import check_fits_somewhere

        first = not self.sent
        for n, sub in enumerate(self.pending):  # (every job of one call asks the same: said once)
            apps.fit_to_pool(self.pool, sub, self.loads, self.progress if first and n == 0 else lambda _m: None)
        if first:
            try:
                check_fits_somewhere(self.pending[0].ask(), self.loads, self.pool.name)
            except NeverFits as e:
                raise MonarchError(f"{e}; ask for less, or use a pool with bigger hosts") from None
        for arec, entry in apps.enqueue_many(self.pool, self.pending):
            self.sent.append(arec)
            if entry.state == QueueState.QUEUED:
                self.waiting += 1
                self.reason = self.reason or entry.reason
        self.pending.clear()

    def cancel_sent(self, reason: str) -> None:
        """Cancels what the queue took. Best effort, and it stops at the first host that does not
        answer (the failure was likely that): the submit call's own error is the one to show."""
        from . import apps
        from .net import WireError

        try:
            for arec in self.sent:
                apps.kill(self.pool, arec, reason=reason)
            # a batch whose answer was lost (the queue may hold it; its records are gone)
            for sub in self.pending:
                with contextlib.suppress(MonarchError, RemoteError):  # (one the queue never had)
                    self.pool.call(QUEUE_HOST, "queue.cancel", timeout=15.0, app_id=sub.app_id, reason=reason)
        except (WireError, OSError, MonarchError) as e:
            self.progress(f"could not cancel every job this call submitted ({e}); see `torchx list`")


class MonarchExecutor(core.PicklingExecutor):
    """Submits to the agents of an existing pool (create one with `torchx pool create`)."""

    job_class = MonarchJob

    def __init__(
        self,
        folder: str | Path,
        pool: str = "default",
        max_num_timeout: int = 3,
        max_pickle_size_gb: float = 1.0,
        python: str = "python",
    ):
        super().__init__(folder, max_num_timeout=max_num_timeout, max_pickle_size_gb=max_pickle_size_gb)
        self.parameters["pool"] = pool
        self.python = python  # resolved on the hosts: the pool's interpreter, so tasks start warm
        self._throttling = 0.0  # no scheduler to protect: the agents take submissions at once
        self._groups: dict[str, str] = {}  # worker mode: a task group's id by what it was made for
        self._numbered: dict[str, int] = {}  # worker mode: the jobs numbered so far in each group

    @classmethod
    def affinity(cls) -> int:
        return 0  # only when asked for by name: cluster="monarch"

    @classmethod
    def _valid_parameters(cls) -> set[str]:
        return {"pool", "signal_delay_s", "env", "workers"}

    _GENERIC = {
        "name",
        "timeout_min",
        "mem_gb",
        "nodes",
        "cpus_per_task",
        "gpus_per_node",
        "tasks_per_node",
        "stderr_to_stdout",
    }

    def _internal_update_parameters(self, **kwargs: tp.Any) -> None:
        bad = sorted(set(kwargs) - self._valid_parameters() - self._GENERIC)
        if bad:
            raise ValueError(
                f"unknown parameter(s) {bad} for the monarch executor; valid: "
                f"{sorted(self._valid_parameters() | self._GENERIC)}"
            )
        for k in ("nodes", "tasks_per_node"):
            if k in kwargs and (not isinstance(kwargs[k], int) or kwargs[k] < 1):
                raise ValueError(f"{k}={kwargs[k]!r}: must be a positive integer")
        w = kwargs.get("workers", False)
        if not isinstance(w, (bool, int)) or (not isinstance(w, bool) and w < 1):
            raise ValueError(f"workers={w!r}: True (as many as fit), False, or a positive number of workers")
        super()._internal_update_parameters(**kwargs)

    def _task_argv(self) -> list[str]:
        return [self.python, "-u", "-m", "submitit.core._submit", str(self.folder)]

    @property
    def _submitit_command_str(self) -> str:
        return shlex.join(self._task_argv())

    def _num_tasks(self) -> int:
        return int(self.parameters.get("nodes", 1)) * int(self.parameters.get("tasks_per_node", 1))

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return ""

    @staticmethod
    def _get_job_id_from_submission_command(string: bytes | str) -> str:
        return "0"

    def _make_submission_command(self, submission_file_path: Path) -> list[str]:
        return []

    def _internal_process_submissions(
        self, delayed_submissions: list[utils.DelayedSubmission]
    ) -> list[core.Job[tp.Any]]:
        """Like PicklingExecutor's, but the pickle is in place before the tasks start (no 1 s wait)."""
        from .pool import PoolRequest, ensure_pool, reuse_unchecked, warming_hosts
        from .registry import Registry

        name = self.parameters["pool"]
        rec = Registry().require(name)
        req = PoolRequest(rec.scheduler, name, spec={})

        # the hosts' load, asked of every host, is the health check too: ensure_pool's own only when a
        # host is not well (repaired, reported) or still warming (waited for), then the load again
        pool = reuse_unchecked(req, progress=_progress)
        health = pool.health(touch=True) if pool is not None else []
        if pool is None or not all(h.ok for h in health) or warming_hosts([h.info for h in health]):
            pool = ensure_pool(req, progress=_progress)
            health = pool.health()
        nodes = int(self.parameters.get("nodes", 1))
        if nodes > pool.record.num_hosts:
            raise MonarchError(f"nodes={nodes} but pool {name!r} has {pool.record.num_hosts} host(s)")
        healthy = sum(1 for h in health if h.ok)
        if healthy < nodes:
            raise MonarchError(f"pool {name!r} has only {healthy} healthy host(s) for nodes={nodes}")
        from .resources import HostLoad

        timeout_min = self.parameters.get("timeout_min", 5)
        loads = [HostLoad.from_wire(h.info["load"]) for h in health if h.ok and h.info.get("load")]
        if self.parameters.get("workers"):
            return self._to_workers(pool, loads, delayed_submissions, float(timeout_min), _progress)
        jobs: list[core.Job[tp.Any]] = []
        batch = _Enqueuing(pool, loads, _progress)
        try:
            for i, delayed in enumerate(delayed_submissions):
                job_id = uuid.uuid4().hex[:16]
                paths = utils.JobPaths(self.folder, job_id=job_id)
                paths.folder.mkdir(parents=True, exist_ok=True)
                delayed.set_timeout(timeout_min, self.max_num_timeout)
                delayed.dump(paths.submitted_pickle)
                if (
                    i == 0
                    and len(delayed_submissions) * paths.submitted_pickle.stat().st_size / 1024**3
                    > self.max_pickle_size_gb
                ):
                    paths.submitted_pickle.unlink()
                    raise RuntimeError(
                        f"submitting {len(delayed_submissions)} pickles above max_pickle_size_gb="
                        f"{self.max_pickle_size_gb}; raise executor.max_pickle_size_gb if intended"
                    )
                batch.add(self._submission(pool, job_id, float(timeout_min)))
                jobs.append(MonarchJob(folder=self.folder, job_id=job_id, tasks=list(range(self._num_tasks()))))
            batch.flush()
        except BaseException:
            batch.cancel_sent("its submission failed")
            raise
        if batch.waiting:
            _progress(f"{batch.waiting} of {len(jobs)} job(s) wait in the queue of pool {name!r}: {batch.reason}")
        return jobs

    def _group(self, pool: tp.Any, timeout_min: float) -> TaskGroup:
        """This executor's task group on ``pool`` for its parameters now: one per executor and
        set of parameters, so every submit call of it shares the workers it already has."""
        env = {str(k): str(v) for k, v in (self.parameters.get("env") or {}).items()}
        worker = LaunchSpec(
            app_id="worker",  # (each worker's own is set by the pool: agent/tasks.py)
            role="worker",
            replica_id=0,
            argv=[self.python, "-u", "-m", "monarch_torchx.submitit_worker"],
            env={**env, "SUBMITIT_EXECUTOR": "monarch"},
            cwd=os.getcwd(),
            resources=self._asks().to_wire(),
        )
        workers = self.parameters["workers"]
        key = json.dumps([pool.name, vars(worker), timeout_min, workers], sort_keys=True)
        group_id = self._groups.setdefault(key, f"tasks-{uuid.uuid4().hex[:12]}")
        name = str(self.parameters.get("name", "submitit"))
        max_workers = 0 if workers is True else int(workers)
        return TaskGroup(group_id, name, str(self.folder), worker, timeout_min * 60, max_workers)

    def _to_workers(
        self,
        pool: tp.Any,
        loads: list[tp.Any],
        delayed_submissions: list[utils.DelayedSubmission],
        timeout_min: float,
        progress: tp.Callable[[str], None],
    ) -> list[core.Job[tp.Any]]:
        """Worker mode: each job a task of this executor's group, handed to the pool's queue in
        growing batches (the first at once, so workers start while the rest are pickled)."""
        from .resources import NeverFits
        from .scheduling import AppAsk, ReplicaAsk, check_fits_somewhere

        if self._num_tasks() != 1:
            raise MonarchError(
                "monarch_workers runs one-task jobs (nodes=1, tasks_per_node=1); "
                "a multi-task job needs a process per task: leave monarch_workers unset"
            )
        group = self._group(pool, timeout_min)
        try:
            ask = AppAsk(group.group_id, [ReplicaAsk("task", 0, self._asks())])
            check_fits_somewhere(ask, loads, pool.name)
        except NeverFits as e:
            raise MonarchError(f"{e}; ask for less, or use a pool with bigger hosts") from None
        targets = [t.as_dict() for t in pool.tree_targets(range(pool.record.num_hosts))[0]]
        jobs: list[core.Job[tp.Any]] = []
        batch: list[Task] = []
        size = _Enqueuing.FIRST
        sent: list[str] = []

        def send() -> None:
            nonlocal size
            if batch:
                pool.call(
                    QUEUE_HOST,
                    "tasks.submit",
                    timeout=60.0 + 0.01 * len(batch),
                    group=group.to_wire(),
                    tasks=[t.to_wire() for t in batch],
                    targets=targets,
                )
                sent.extend(t.task_id for t in batch)
                batch.clear()
            size = min(size * 4, _Enqueuing.LARGEST)

        array = group.group_id.split("-", 1)[1]  # (its jobs are ARRAY_N; its record is ARRAY's)
        where = utils.JobPaths(self.folder, job_id=array).folder
        where.mkdir(parents=True, exist_ok=True)
        _meta_path(where, array).write_text(json.dumps({"pool": pool.name, "group": group.group_id}))
        made = set()
        try:
            for delayed in delayed_submissions:
                job_id = f"{array}_{self._numbered.get(array, 0)}"
                self._numbered[array] = self._numbered.get(array, 0) + 1
                paths = utils.JobPaths(self.folder, job_id=job_id)
                if paths.folder not in made:  # (one folder for all, unless it names the job: %j)
                    paths.folder.mkdir(parents=True, exist_ok=True)
                    made.add(paths.folder)
                delayed.set_timeout(self.parameters.get("timeout_min", 5), self.max_num_timeout)
                delayed.dump(paths.submitted_pickle)
                err = paths.stdout if self.parameters.get("stderr_to_stdout") else paths.stderr
                batch.append(Task(job_id, _task_env(job_id), str(paths.stdout), str(err)))
                jobs.append(MonarchJob(folder=self.folder, job_id=job_id, tasks=[0]))
                if len(batch) >= size:
                    send()
            send()
        except BaseException:
            handed = sent + [t.task_id for t in batch]  # (a batch whose answer was lost may have been taken)
            if handed:
                with contextlib.suppress(MonarchError, OSError, RemoteError):
                    pool.call(
                        QUEUE_HOST,
                        "tasks.cancel",
                        group_id=group.group_id,
                        task_ids=handed,
                        reason="its submission failed",
                    )
            raise
        return jobs

    def _asks(self) -> Resources:
        """What one task asks of its host: ``cpus_per_task``, and its share of ``gpus_per_node``
        and ``mem_gb`` (per node, as SLURM reads them). A parameter not set asks nothing."""
        tpn = int(self.parameters.get("tasks_per_node", 1))
        gpus = int(self.parameters.get("gpus_per_node") or 0)
        if gpus % tpn:
            raise MonarchError(
                f"gpus_per_node={gpus} is not a multiple of tasks_per_node={tpn}: each task holds its own GPUs"
            )
        return Resources(
            cpus=float(self.parameters.get("cpus_per_task") or 0),
            gpus=gpus // tpn,
            mem_mb=int(float(self.parameters.get("mem_gb") or 0) * 1024 / tpn),
        )

    def _submission(self, pool: tp.Any, job_id: str, timeout_min: float) -> SubmittedApp:
        """One job as the pool's queue takes it: one replica per task, ``tasks_per_node`` of them
        on each of ``nodes`` distinct hosts."""
        tpn = int(self.parameters.get("tasks_per_node", 1))
        nodes = int(self.parameters.get("nodes", 1))
        ntasks = nodes * tpn
        app_id = f"submitit-{job_id}"
        base_env = {str(k): str(v) for k, v in (self.parameters.get("env") or {}).items()}
        asks = self._asks().to_wire()
        specs = []
        for rank in range(ntasks):
            node, local = divmod(rank, tpn)
            paths = utils.JobPaths(self.folder, job_id=job_id, task_id=rank)
            env = {
                **base_env,
                "SUBMITIT_EXECUTOR": "monarch",
                f"{ENV_PREFIX}JOB_ID": job_id,
                f"{ENV_PREFIX}NTASKS": str(ntasks),
                f"{ENV_PREFIX}NUM_NODES": str(nodes),
                f"{ENV_PREFIX}NODEID": str(node),
                f"{ENV_PREFIX}GLOBALID": str(rank),
                f"{ENV_PREFIX}LOCALID": str(local),
            }
            err = paths.stdout if self.parameters.get("stderr_to_stdout") else paths.stderr
            specs.append(
                LaunchSpec(
                    app_id=app_id,
                    role="task",
                    replica_id=rank,
                    argv=self._task_argv(),
                    env=env,
                    cwd=os.getcwd(),
                    stdout_path=str(paths.stdout),
                    stderr_path=str(err),
                    timeout_s=timeout_min * 60,
                    signal_delay_s=float(self.parameters.get("signal_delay_s", 30)),
                    requeue_code=REQUEUE_CODE,
                    resources=asks,
                )
            )
        folder = utils.JobPaths(self.folder, job_id=job_id).folder
        _meta_path(folder, job_id).write_text(json.dumps({"pool": pool.name, "app_id": app_id}))
        argv = self._task_argv()
        role = {"name": "task", "image": str(folder), "entrypoint": argv[0], "args": argv[1:], "num_replicas": ntasks}
        return SubmittedApp(
            app_id=app_id,
            name=str(self.parameters.get("name", "submitit")),
            roles=[role],
            specs=specs,
            tasks_per_node=tpn,
            hosts_env=f"{ENV_PREFIX}HOSTNAMES",
        )
