"""``monarch_slurm``: one ``sbatch`` allocation of N nodes, one agent per node, kept warm.

The batch script ``srun``s one agent per node; each publishes its address in the pool's state
dir, which must be on a file system the nodes share (the registry home, or ``job_dir``). Run
options use TorchX's slurm names and meanings, and a ``[slurm]`` section of ``.torchxconfig``
supplies their defaults, so existing configs carry over.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

from ..agent import agent_argv
from ..errors import MonarchError, StartTimeout
from ..interpreter import module_argv
from ..pool import parse_duration, wait_for_hosts
from ..registry import PoolRecord, Registry, write_private
from ..submission import Submission
from .base import MonarchScheduler

# spec keys (must match for reuse) and plain options, by TorchX slurm run-option name
SPEC_OPTS = ("partition", "account", "qos", "constraint", "gpus_per_node", "cpus_per_task", "mem", "exclusive")
PLAIN_OPTS = ("time", "comment", "mail-user", "mail-type", "job_dir", "start_timeout")
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
# pending reasons that will not resolve by waiting: fail at once instead of an endless PENDING
_HOPELESS = (
    "PartitionNodeLimit",
    "PartitionTimeLimit",
    "PartitionConfig",
    "BadConstraints",
    "InvalidAccount",
    "InvalidQOS",
    "AccountNotAllowed",
    "QOSMaxNodePerJobLimit",
    "QOSMaxWallDurationPerJobLimit",
    "QOSMaxGRESPerJob",
    "JobHeldAdmin",
    "PartitionDown",
    "PartitionInactive",
    "NodeDown",
)
_ALIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING")


def parse_slurm_time(value: str) -> int:
    """SLURM's walltime formats (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) -> seconds."""
    m = _TIME.match(str(value).strip())
    if not m:
        raise MonarchError(f"time={value!r} is not a SLURM time limit: use e.g. 30, 01:30:00 or 1-00:00:00")
    days, a, b, c = m.groups()
    parts = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:  # D-HH[:MM[:SS]]
        h, mi, s = (parts + [0, 0])[:3]
        return int(days) * 86400 + h * 3600 + mi * 60 + s
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    return parts[0] * 3600 + parts[1] * 60 + parts[2]


def _human(seconds: int) -> str:
    """A duration as people read it: 24 min, 1 h 30 min, 2 d 3 h."""
    d, rest = divmod(int(seconds), 86400)
    h, rest = divmod(rest, 3600)
    m = rest // 60
    parts = [f"{d} d" if d else "", f"{h} h" if h else "", f"{m} min" if m or not (d or h) else ""]
    return " ".join(p for p in parts if p)


def _slurm_config_defaults() -> dict[str, Any]:
    """Values of a ``[slurm]`` section in .torchxconfig (cwd), cast as TorchX's slurm casts them.

    Read quietly: TorchX's ``config.apply`` logs "loaded configs from ..." at each call, and this
    runs at every look-up of our run options (5 per ``torchx run``); TorchX says it once itself."""
    import logging

    try:
        from torchx.runner import config

        cfg: dict[str, Any] = {}
        log = logging.getLogger(config.__name__)
        level = log.level
        log.setLevel(logging.WARNING)
        try:
            config.apply(scheduler="slurm", cfg=cfg)
        finally:
            log.setLevel(level)
        return cfg
    except Exception:  # no torchx slurm scheduler or no readable config: no defaults
        return {}


def _run(argv: list[str], timeout: float = 30) -> tuple[int, str, str]:
    if shutil.which(argv[0]) is None:
        raise MonarchError(
            f"{argv[0]} not found on PATH: monarch_slurm needs the SLURM client commands "
            "(sbatch, squeue, scancel) on this machine"
        )
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise MonarchError(
            f"`{' '.join(argv[:2])} ...` did not answer within {timeout:.0f} s: is slurmctld up?"
        ) from None
    return res.returncode, res.stdout.strip(), res.stderr.strip()


def job_state(job_id: str) -> tuple[str, str, str]:
    """(state, reason, time left) of a job; state from sacct once squeue forgot it ("" if unknown)."""
    rc, out, _ = _run(["squeue", "-h", "-j", job_id, "-o", "%T|%r|%L"])
    if rc == 0 and out:
        state, reason, left = (out.splitlines()[0].split("|") + ["", ""])[:3]
        return state, reason, left
    return _sacct_state(job_id), "", ""


def _sacct_state(job_id: str) -> str:
    if shutil.which("sacct"):
        rc, out, _ = _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"])
        if rc == 0 and out:
            return out.splitlines()[0].split()[0]
    return ""


def _partition_hint(rec: PoolRecord, reason: str) -> str:
    if reason != "PartitionNodeLimit":
        return ""
    argv = ["sinfo", "-h", "-o", "%D"] + (["-p", rec.spec["partition"]] if rec.spec.get("partition") else [])
    rc, out, _ = _run(argv)
    total = sum(int(x) for x in out.split() if x.isdigit()) if rc == 0 else 0
    return f": nodes={rec.num_hosts} but the partition has {total}" if total else ""


class SlurmProvisioner:
    scheduler = "monarch_slurm"
    hosts_option = "nodes"
    client_cwd_on_hosts = True  # replicas start in the client's cwd (else the agent's)
    fingerprint = ("hosts", *SPEC_OPTS, "preload", "tls")
    tls_default = True  # agents on other nodes: the network is shared

    def add_run_opts(self, opts: Any) -> None:
        d = _slurm_config_defaults()
        opts.add("partition", type_=str, default=d.get("partition"), help="SLURM partition (default: the cluster's)")
        opts.add(
            "time",
            type_=str,
            default=d.get("time"),
            help="walltime of the pool's allocation, SLURM format (e.g. 30, 02:00:00, 1-00:00:00)",
        )
        opts.add("account", type_=str, default=d.get("account"), help="SLURM account to charge")
        opts.add("qos", type_=str, default=d.get("qos"), help="SLURM quality of service")
        opts.add("constraint", type_=str, default=d.get("constraint"), help="SLURM node feature constraint")
        opts.add("comment", type_=str, default=d.get("comment"), help="comment set on the allocation")
        opts.add("mail-user", type_=str, default=d.get("mail-user"), help="user to mail on allocation events")
        opts.add("mail-type", type_=str, default=d.get("mail-type"), help="allocation events to mail about")
        opts.add(
            "job_dir",
            type_=str,
            default=d.get("job_dir"),
            help="shared directory for the pool's state and logs (default: the registry home)",
        )
        opts.add("gpus_per_node", type_=int, default=None, help="GPUs per node of the allocation")
        opts.add("cpus_per_task", type_=int, default=None, help="CPUs for each node's agent and its processes")
        opts.add("mem", type_=str, default=None, help="memory per node, SLURM format (e.g. 16G)")
        opts.add("exclusive", type_=bool, default=False, help="whole nodes for the pool (sbatch --exclusive)")
        opts.add(
            "start_timeout",
            type_=str,
            default="10m",
            help="give up when the allocation is not running its agents after this long (e.g. 5m)",
        )

    def pool_spec(self, cfg: dict[str, Any], spec: dict[str, Any], options: dict[str, Any]) -> None:
        for k in SPEC_OPTS:
            v = cfg.get(k)
            spec[k] = v if v not in ("", False) else None
        for k in PLAIN_OPTS:
            if cfg.get(k) not in (None, ""):
                options[k] = cfg[k]
        if options.get("time"):
            options["walltime_s"] = parse_slurm_time(options["time"])
        options["start_timeout"] = parse_duration(options.get("start_timeout", "10m"), "start_timeout")

    # ------------------------------------------------------------ allocation

    def _sbatch_argv(self, rec: PoolRecord, script: Path) -> list[str]:
        spec, opt = rec.spec, rec.options
        argv = [
            "sbatch",
            "--parsable",
            "-J",
            f"monarch-{rec.name}",
            "-N",
            str(rec.num_hosts),
            "--ntasks-per-node=1",
            "-o",
            str(Path(rec.state_dir) / "logs" / "slurm-%j.out"),
            "-D",
            rec.state_dir,
        ]
        flags = {
            "partition": "-p",
            "account": "-A",
            "qos": "--qos",
            "constraint": "-C",
            "gpus_per_node": "--gpus-per-node",
            "cpus_per_task": "--cpus-per-task",
            "mem": "--mem",
        }
        for k, flag in flags.items():
            if spec.get(k) not in (None, ""):
                argv += [flag, str(spec[k])]
        if spec.get("exclusive"):
            argv.append("--exclusive")
        for k, flag in (
            ("time", "-t"),
            ("comment", "--comment"),
            ("mail-user", "--mail-user"),
            ("mail-type", "--mail-type"),
        ):
            if opt.get(k):
                argv += [flag, str(opt[k])]
        return argv + [str(script)]

    @staticmethod
    def batch_script(rec: PoolRecord) -> str:
        """The batch script: one ``srun`` step with one agent per node."""
        agent = " ".join(shlex.quote(a) for a in agent_argv(rec, index=None, bind="0.0.0.0"))
        return (
            "#!/bin/bash\n"
            f"# monarch-torchx pool {rec.name}: one agent per node; agents exit when idle or told to stop\n"
            f"exec srun --ntasks-per-node=1 --kill-on-bad-exit=0 {agent}\n"
        )

    def submission(self, rec: PoolRecord) -> Submission:
        script = Path(rec.state_dir) / "pool.sbatch"
        return Submission(
            "sbatch",
            commands=[self._sbatch_argv(rec, script)],
            script=self.batch_script(rec),
            notes=[f"the batch script is written to {script} (0700) before sbatch runs"],
        )

    def _submit(self, rec: PoolRecord) -> None:
        for i in range(rec.num_hosts):  # an address left from an earlier allocation is not this one's
            Registry.clear_host(rec, i)
        script = Path(rec.state_dir) / "pool.sbatch"
        write_private(script, self.batch_script(rec))  # a new file renamed into place: a planted symlink is replaced
        script.chmod(0o700)
        rc, out, err = _run(self._sbatch_argv(rec, script))
        if rc != 0:
            reason = err.splitlines()[-1] if err else f"exit code {rc}"
            raise MonarchError(f"SLURM refused pool {rec.name!r}: {reason.removeprefix('sbatch: error: ')}")
        rec.allocation = {"job_id": out.split(";")[0], "submitted": time.time()}

    def create(self, rec: PoolRecord) -> None:
        self._submit(rec)

    def repair(self, rec: PoolRecord, indices: list[int]) -> list[int]:
        """An agent cannot be re-added to a running allocation: replace the allocation."""
        self._cancel(rec)
        self._submit(rec)
        return list(range(rec.num_hosts))

    def _cancel(self, rec: PoolRecord) -> None:
        job = rec.allocation.get("job_id")
        if job and shutil.which("scancel"):
            _run(["scancel", str(job)])

    def end_leftovers(self, rec: PoolRecord, lost: list[int]) -> list[str]:
        """A job step on each lost host's node (the allocation still runs: its other agents do)
        ends what the dead agent left there, in that node's mount namespace."""
        from ..syncfs.host import pool_id

        job = rec.allocation.get("job_id")
        if not job or job_state(job)[0] != "RUNNING" or shutil.which("srun") is None:
            return []
        hosts = Registry.hosts(rec)
        steps = []
        for i in lost:
            h = hosts[i] if i < len(hosts) else None
            if h is None or not h.hostname:
                continue
            argv = [
                "srun",
                f"--jobid={job}",
                "--overlap",
                "-N1",
                "-n1",
                f"--nodelist={h.hostname.split('.')[0]}",
                "--quiet",
                f"--chdir={rec.state_dir}",
                *module_argv(
                    "monarch_torchx.agent.leftovers",
                    "--pool",
                    rec.name,
                    "--pool-id",
                    pool_id(rec.key),
                    "--index",
                    str(i),
                ),
            ]
            steps.append(
                (
                    i,
                    subprocess.Popen(
                        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL
                    ),
                )
            )
        found = []
        for i, step in steps:
            try:
                out, err = step.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                step.kill()
                found.append(f"host {i}: the cleanup step did not finish within 60 s")
                continue
            if step.returncode != 0:
                found.append(f"host {i}: the cleanup step failed: {(err.strip().splitlines() or ['?'])[-1]}")
                continue
            try:
                found += [f"host {i}: {what}" for what in json.loads(out.strip().splitlines()[-1]).get(str(i), [])]
            except (IndexError, ValueError):
                found.append(f"host {i}: the cleanup step said nothing readable")
        return found

    def release(self, rec: PoolRecord) -> None:
        job = rec.allocation.get("job_id")
        if not job:
            return
        deadline = time.time() + 5  # agents were told to shut down: give the job a moment to end
        while time.time() < deadline and job_state(job)[0] in ("RUNNING", "COMPLETING"):
            time.sleep(0.2)
        if job_state(job)[0] in _ALIVE:
            self._cancel(rec)

    def wait_ready(
        self, rec: PoolRecord, indices: list[int], old: dict[int, str], timeout: float, progress: Callable[[str], None]
    ) -> None:
        job = rec.allocation["job_id"]
        last: dict[str, Any] = {"t": 0.0, "said": ""}
        log = Path(rec.state_dir) / "logs" / f"slurm-{job}.out"

        def check(_i: int) -> str | None:
            if time.time() - last["t"] < 0.5:
                return None
            last["t"] = time.time()
            state, reason, _ = job_state(job)
            said = f"allocation {job}: {state or 'unknown'}" + (f" ({reason})" if reason and reason != "None" else "")
            if said != last["said"]:
                progress(said)
                last["said"] = said
            if state and state not in _ALIVE:
                tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
                return f"allocation {job} is {state}" + (f": {' | '.join(tail)}" if tail else "")
            if state == "PENDING" and reason in _HOPELESS:
                return f"allocation {job} can never start ({reason}{_partition_hint(rec, reason)})"
            return None

        try:
            wait_for_hosts(rec, indices, old, timeout, check)
        except StartTimeout:
            state, reason, _ = job_state(job)
            raise MonarchError(
                f"pool {rec.name!r}: allocation {job} still {state or 'unknown'}"
                f"{f' ({reason})' if reason else ''} after {timeout:.0f} s; "
                f"cancelled it (raise start_timeout to wait longer)"
            ) from None

    def loss_reason(self, rec: PoolRecord) -> str | None:
        job = rec.allocation.get("job_id")
        if not job:
            return None
        state, reason, _ = job_state(job)
        if state == "COMPLETING":  # ending: the accounting record says why (CANCELLED, TIMEOUT, ...)
            final = _sacct_state(job)
            state = final if final and final not in ("RUNNING", "PENDING", "COMPLETING") else "ending (COMPLETING)"
            reason = ""
        if state == "RUNNING":
            return None
        return f"allocation {job} is {state or 'gone'}" + (f" ({reason})" if reason and reason != "None" else "")

    def reuse_warnings(self, rec: PoolRecord, options: dict[str, Any]) -> list[str]:
        """A run asking for more walltime (``time=``) than the reused allocation has left: said,
        since the allocation cannot be extended and the run may be cut short."""
        want = options.get("walltime_s")
        job = rec.allocation.get("job_id")
        if not want or not job:
            return []
        state, _, left = job_state(str(job))
        try:
            left_s = parse_slurm_time(left)
        except MonarchError:  # UNLIMITED, NOT_SET, or not running (the run's check repairs it)
            return []
        if left_s >= want:
            return []
        return [
            f"pool {rec.name!r} (allocation {job}) has {_human(left_s)} left, less than time={options.get('time')} "
            f"asks; it is reused: to get a new allocation, `monarch-torchx pool stop {rec.name}` and run again"
        ]

    def describe(self, rec: PoolRecord) -> dict[str, Any]:
        job = rec.allocation.get("job_id")
        state, reason, left = job_state(job) if job else ("", "", "")
        return {
            "job_id": job,
            "state": state,
            "reason": reason if reason != "None" else "",
            "time_left": left,
            "walltime": rec.options.get("time"),
        }


def create_scheduler(session_name: str, **kwargs: Any) -> MonarchScheduler:
    return MonarchScheduler(session_name, "monarch_slurm")
