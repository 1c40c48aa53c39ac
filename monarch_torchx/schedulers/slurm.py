"""``monarch_slurm``: ``sbatch`` allocations, one agent per node, kept warm.

A pool starts as one allocation of N nodes; ``pool resize`` (or a run with ``grow=True``) adds
further allocations whose agents join it as hosts N, N+1, ..., and shrinking releases whole
allocations from the last. The batch script ``srun``s one agent per node; each publishes its
address in the pool's state dir, which must be on a file system the nodes share (the registry
home, or ``job_dir``). Run options use TorchX's slurm names and meanings, and a ``[slurm]``
section of ``.torchxconfig`` supplies their defaults, so existing configs carry over.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any, Callable

from ..agent import agent_argv
from ..errors import MonarchError, StartTimeout
from ..interpreter import module_argv
from ..pool import parse_duration, wait_for_hosts
from ..registry import PoolRecord, Registry, home, write_private
from ..specs import known_fields
from ..submission import Submission
from .base import MonarchScheduler

# spec keys (must match for reuse) and plain options, by TorchX slurm run-option name
SPEC_OPTS = ("partition", "account", "qos", "constraint", "gpus_per_node", "cpus_per_task", "mem", "exclusive")
PLAIN_OPTS = ("time", "comment", "mail-user", "mail-type", "job_dir", "start_timeout", "min_time_left")
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
# host 0's module that grows a pool with ``max_nodes`` (``slurm_allocator.py``), and its state file
ALLOCATOR_MODULE = "monarch_torchx.schedulers.slurm_allocator:setup"
ALLOCATOR_FILE = "allocator.json"
# how long a shrink waits for the jobs it released to end after their scancel (SLURM's KillWait
# is 30 s by default: an agent that ignored SIGTERM is not waited for until its SIGKILL)
RELEASE_SETTLE_S = 30.0
ALIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING")


class AllocatorPhase(Enum):
    WATCHING = "watching"  # nothing has waited long enough, or what waits would not fit even at max_nodes
    GROWING = "growing"  # an allocation was submitted and its hosts are awaited
    RENEWING = "renewing"  # a successor allocation was submitted: its agents are awaited and readied
    PAUSED = "paused"  # grows failed again and again: a resize by hand resumes it
    OFF = "off"  # host 0 could not take it up (the pool's record out of its reach): the reason says why


@dataclass
class AllocatorState:
    """What a pool's allocator (host 0, ``slurm_allocator.py``) is doing, for ``pool status``:
    written by it into the pool's state dir, read by clients."""

    phase: AllocatorPhase = AllocatorPhase.WATCHING
    reason: str = ""
    failures: int = 0  # grows that failed in a row
    grown: int = 0  # allocations it submitted that joined
    renewed: int = 0  # successor allocations it submitted and readied (``renew``)
    paused_at: int = 0  # the pool's size when it paused (a resize by hand changes it: resumes)

    def save(self, state_dir: str | Path) -> None:
        write_private(Path(state_dir) / ALLOCATOR_FILE, json.dumps({**asdict(self), "phase": self.phase.value}))

    @classmethod
    def read(cls, state_dir: str | Path) -> AllocatorState | None:
        try:
            data = json.loads((Path(state_dir) / ALLOCATOR_FILE).read_text())
            return cls(**{**known_fields(cls, data), "phase": AllocatorPhase(data["phase"])})
        except (OSError, ValueError, KeyError, TypeError):  # none yet, or one being replaced
            return None


@dataclass(frozen=True)
class Allocation:
    """One ``sbatch`` job of a pool: it holds the pool's hosts ``first`` .. ``first + nodes - 1``.
    ``successor``: the job submitted to take those hosts over before this one's walltime ends
    (``renew``; its agents wait on standby, ``agent/handover.py``), until this one has ended."""

    job_id: str
    first: int
    nodes: int
    submitted: float = 0.0
    successor: str = ""

    @property
    def jobs(self) -> list[str]:
        return [self.job_id, self.successor] if self.successor else [self.job_id]

    @property
    def indices(self) -> range:
        return range(self.first, self.first + self.nodes)

    def hosts_text(self) -> str:
        last = self.first + self.nodes - 1
        return str(self.first) if last == self.first else f"{self.first}-{last}"

    def label(self) -> str:
        return f"host {self.first}" if self.nodes == 1 else f"hosts {self.hosts_text()}"


def allocations(rec: PoolRecord) -> list[Allocation]:
    """The pool's allocations in host order (a record from before grown pools has one, ``job_id``)."""
    a = rec.allocation
    parts = a.get("parts")
    if isinstance(parts, list):
        return [
            Allocation(
                str(p["job_id"]),
                int(p["first"]),
                int(p["nodes"]),
                float(p.get("submitted", 0)),
                str(p.get("successor") or ""),
            )
            for p in parts
        ]
    if a.get("job_id"):
        return [Allocation(str(a["job_id"]), 0, rec.num_hosts, float(a.get("submitted", 0)))]
    return []


def set_allocations(rec: PoolRecord, allocs: list[Allocation]) -> None:
    """Records the pool's allocations; ``job_id`` stays the first one's (older readers, force-stop)."""
    allocs = sorted(allocs, key=lambda a: a.first)
    rec.allocation = (
        {"job_id": allocs[0].job_id, "submitted": allocs[0].submitted, "parts": [asdict(a) for a in allocs]}
        if allocs
        else {}
    )


def allocation_of(rec: PoolRecord, index: int) -> Allocation | None:
    return next((a for a in allocations(rec) if index in a.indices), None)


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
    """A SLURM client command. Run inside a job (host 0's agent grows its pool from inside its
    own allocation), without that job's ``SLURM_*`` variables (``SLURM_CONF`` kept): a new
    allocation must not take its sizes, or its node ids, from another."""
    if shutil.which(argv[0]) is None:
        raise MonarchError(
            f"{argv[0]} not found on PATH: monarch_slurm needs the SLURM client commands "
            "(sbatch, squeue, scancel) on this machine"
        )
    try:
        env = dict(os.environ)
        if "SLURM_JOB_ID" in env:
            env = {k: v for k, v in env.items() if not k.startswith(("SLURM_", "SRUN_")) or k == "SLURM_CONF"}
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise MonarchError(
            f"`{' '.join(argv[:2])} ...` did not answer within {timeout:.0f} s: is slurmctld up?"
        ) from None
    return res.returncode, res.stdout.strip(), res.stderr.strip()


def _cancel_job(job_id: str) -> None:
    if job_id and shutil.which("scancel"):
        _run(["scancel", str(job_id)])


def end_jobs(job_ids: list[str], grace_s: float, settle_s: float = 0.0) -> None:
    """Ends jobs whose agents were told to shut down: ``grace_s`` for them to end on their own
    (their agents end their work and mounts), then scancel for the rest; with ``settle_s``, waits
    that long at most for every process of them to have ended (SLURM's SIGTERM lets an agent
    write its last words first: whoever clears a host's files after this finds none to come)."""
    if not job_ids:
        return
    deadline = time.time() + grace_s
    while time.time() < deadline and any(st[0] in ("RUNNING", "COMPLETING") for st in jobs_states(job_ids).values()):
        time.sleep(0.2)
    alive = [job for job, (state, _, _) in jobs_states(job_ids).items() if state in ALIVE]
    for job in alive:
        _cancel_job(job)
    deadline = time.time() + settle_s
    while alive and time.time() < deadline:
        time.sleep(0.2)
        alive = [job for job, (state, _, _) in jobs_states(alive).items() if state in ALIVE]


def job_state(job_id: str) -> tuple[str, str, str]:
    """(state, reason, time left) of a job; state from sacct once squeue forgot it ("" if unknown)."""
    rc, out, _ = _run(["squeue", "-h", "-j", job_id, "-o", "%T|%r|%L"])
    if rc == 0 and out:
        state, reason, left = (out.splitlines()[0].split("|") + ["", ""])[:3]
        return state, reason, left
    return _sacct_state(job_id), "", ""


def jobs_states(job_ids: list[str]) -> dict[str, tuple[str, str, str]]:
    """``job_state`` of several jobs with one ``squeue`` (and ``sacct`` for those it forgot)."""
    if not job_ids:
        return {}
    rc, out, _ = _run(["squeue", "-h", "-j", ",".join(job_ids), "-o", "%i|%T|%r|%L"])
    found: dict[str, tuple[str, str, str]] = {}
    if rc != 0:  # (a job squeue no longer knows makes it refuse the whole list)
        return {job: job_state(job) for job in job_ids}
    for line in out.splitlines():
        job, state, reason, left = (line.split("|") + ["", "", ""])[:4]
        found[job.strip()] = (state, reason, left)
    for job in job_ids:
        if job not in found:
            found[job] = (_sacct_state(job), "", "")
    return found


def _sacct_state(job_id: str) -> str:
    if shutil.which("sacct"):
        rc, out, _ = _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"])
        if rc == 0 and out:
            return out.splitlines()[0].split()[0]
    return ""


def _partition_hint(rec: PoolRecord, reason: str, nodes: int | None = None) -> str:
    if reason != "PartitionNodeLimit":
        return ""
    argv = ["sinfo", "-h", "-o", "%D"] + (["-p", rec.spec["partition"]] if rec.spec.get("partition") else [])
    rc, out, _ = _run(argv)
    total = sum(int(x) for x in out.split() if x.isdigit()) if rc == 0 else 0
    asked = rec.num_hosts if nodes is None else nodes
    return f": {asked} node(s) asked but the partition has {total}" if total else ""


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
            "min_time_left",
            type_=str,
            default=None,
            help="walltime this run needs left: it goes only to hosts whose allocation has that much (e.g. 90m)",
        )
        opts.add(
            "max_nodes",
            type_=int,
            default=None,
            help="the pool grows by itself, up to this many nodes in all, for apps that wait in its queue "
            "(set when the pool is made; see backlog)",
        )
        opts.add(
            "backlog",
            type_=str,
            default="30s",
            help="with max_nodes: how long an app waits in the pool's queue before the pool grows for it (e.g. 10s)",
        )
        opts.add(
            "renew",
            type_=bool,
            default=False,
            help="keep the pool warm across walltimes: before an allocation's time ends, a successor allocation "
            "takes its hosts over (needs time; set when the pool is made)",
        )
        opts.add(
            "renew_before",
            type_=str,
            default=None,
            help="with renew: how long before the walltime ends the successor is submitted (default: a tenth of "
            "the walltime, at least 1m; longer where allocations wait long in SLURM's queue)",
        )
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
        if options.get("min_time_left"):
            value = str(options["min_time_left"])
            options["min_time_left_s"] = (
                parse_slurm_time(value) if ":" in value or value.isdigit() else parse_duration(value, "min_time_left")
            )
        options["start_timeout"] = parse_duration(options.get("start_timeout", "10m"), "start_timeout")
        most = cfg.get("max_nodes")
        if most is not None:
            if isinstance(most, bool) or not isinstance(most, int) or most < 1:
                raise MonarchError(f"max_nodes={most!r} is invalid: give the most nodes the pool may grow to")
            if spec.get("hosts") and most < spec["hosts"]:
                raise MonarchError(f"max_nodes={most} is less than nodes={spec['hosts']}: give max_nodes >= nodes")
            options["max_nodes"] = most
            options["backlog_s"] = parse_duration(cfg.get("backlog") or "30s", "backlog")
        if cfg.get("renew_before") and not cfg.get("renew"):
            raise MonarchError("renew_before is for a pool made with renew=True: add renew=True, or leave it out")
        if cfg.get("renew"):
            if not options.get("walltime_s"):
                raise MonarchError(
                    "renew=True needs time= (the walltime each allocation is renewed before): e.g. -cfg time=02:00:00"
                )
            options["renew"] = True
            if cfg.get("renew_before"):
                before = parse_duration(cfg["renew_before"], "renew_before")
                if not 0 < before < options["walltime_s"]:
                    raise MonarchError(
                        f"renew_before={cfg['renew_before']} must be shorter than time={options['time']} (and above 0)"
                    )
                options["renew_before_s"] = before

    # ------------------------------------------------------------ allocation

    def _sbatch_argv(self, rec: PoolRecord, script: Path, nodes: int | None = None) -> list[str]:
        spec, opt = rec.spec, rec.options
        argv = [
            "sbatch",
            "--parsable",
            "-J",
            f"monarch-{rec.name}",
            "-N",
            str(rec.num_hosts if nodes is None else nodes),
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
    def batch_script(rec: PoolRecord, first: int = 0, standby: bool = False) -> str:
        """The batch script: one ``srun`` step with one agent per node, numbered from ``first``;
        ``standby``: a successor's, whose agents take those hosts over (``agent/handover.py``)."""
        argv = agent_argv(rec, index=None, bind="0.0.0.0", index_base=first)
        if standby:
            argv.append("--standby")
        env = ""
        if first == 0 and (rec.options.get("max_nodes") or rec.options.get("renew")):
            # host 0 grows or renews the pool: it edits the pool's record
            argv += ["--module", ALLOCATOR_MODULE]
            env = f"export MONARCH_TORCHX_HOME={shlex.quote(str(home()))}\n"
        agent = " ".join(shlex.quote(a) for a in argv)
        return (
            "#!/bin/bash\n"
            f"# monarch-torchx pool {rec.name}: one agent per node; agents exit when idle or told to stop\n"
            f"{env}exec srun --ntasks-per-node=1 --kill-on-bad-exit=0 {agent}\n"
        )

    @staticmethod
    def _script_path(rec: PoolRecord, first: int, standby: bool = False) -> Path:
        name = "pool" if first == 0 else f"pool-{first}"
        return Path(rec.state_dir) / f"{name}{'-next' if standby else ''}.sbatch"

    def submission(self, rec: PoolRecord) -> Submission:
        script = self._script_path(rec, 0)
        return Submission(
            "sbatch",
            commands=[self._sbatch_argv(rec, script)],
            script=self.batch_script(rec),
            notes=[f"the batch script is written to {script} (0700) before sbatch runs"],
        )

    def _submit(self, rec: PoolRecord, first: int, nodes: int, standby: bool = False) -> Allocation:
        """Submits one allocation for hosts ``first`` .. ``first + nodes - 1`` (``standby``: to
        take them over from the one holding them, ``renew``)."""
        for i in range(first, first + nodes):  # an address left from an earlier allocation is not this one's
            Registry.clear_host(rec, i, standby=standby)
        script = self._script_path(rec, first, standby)
        # a new file renamed into place: a planted symlink is replaced
        write_private(script, self.batch_script(rec, first, standby))
        script.chmod(0o700)
        rc, out, err = _run(self._sbatch_argv(rec, script, nodes))
        if rc != 0:
            reason = err.splitlines()[-1] if err else f"exit code {rc}"
            raise MonarchError(f"SLURM refused pool {rec.name!r}: {reason.removeprefix('sbatch: error: ')}")
        return Allocation(out.split(";")[0], first, nodes, time.time())

    def create(self, rec: PoolRecord) -> None:
        set_allocations(rec, [self._submit(rec, 0, rec.num_hosts)])

    def repair(self, rec: PoolRecord, indices: list[int]) -> list[int]:
        """An agent cannot be re-added to a running allocation: each allocation that holds a lost
        host is replaced (the pool's other allocations, and their warm hosts, are left alone),
        by its successor where a renewal submitted one that is still alive (its agents take the
        hosts over as they start), else by a new one."""
        kept: list[Allocation] = []
        again: list[Allocation] = []
        for a in allocations(rec):
            (again if any(i in a.indices for i in indices) else kept).append(a)
        states = jobs_states([a.successor for a in again if a.successor])
        for a in again:
            _cancel_job(a.job_id)
            if a.successor and states[a.successor][0] not in ALIVE:
                _cancel_job(a.successor)
        replaced = []
        restarting = []
        for a in again:
            if a.successor and states[a.successor][0] in ALIVE:
                # its agents take the lost hosts over at once (no agent there), the others as the
                # cancelled job's agents leave; those it serves already are left alone
                lost_here = [i for i in indices if i in a.indices]
                for i in lost_here:
                    Registry.clear_host(rec, i)
                replaced.append(Allocation(a.successor, a.first, a.nodes, time.time()))
                restarting += lost_here
            else:
                replaced.append(self._submit(rec, a.first, a.nodes))
                restarting += list(a.indices)
        set_allocations(rec, kept + replaced)
        return restarting

    def _cancel(self, rec: PoolRecord) -> None:
        for a in allocations(rec):
            for job in a.jobs:
                _cancel_job(job)

    # ------------------------------------------------------------ renewal

    def renew(self, rec: PoolRecord, alloc: Allocation) -> Allocation:
        """Submits ``alloc``'s successor: as many nodes, the pool's walltime, its agents on
        standby for the same hosts (``agent/handover.py``). Recorded in ``rec`` (the caller saves)."""
        succ = self._submit(rec, alloc.first, alloc.nodes, standby=True)
        renewed = replace(alloc, successor=succ.job_id)
        set_allocations(rec, [renewed if a.first == alloc.first else a for a in allocations(rec)])
        return renewed

    def drop_successor(self, rec: PoolRecord, alloc: Allocation) -> None:
        """A successor that could not be readied is cancelled and forgotten (the caller saves)."""
        if alloc.successor:
            _cancel_job(alloc.successor)
            for i in alloc.indices:
                Registry.clear_host(rec, i, standby=True)
        set_allocations(rec, [replace(a, successor="") if a.first == alloc.first else a for a in allocations(rec)])

    def settle_renewals(self, rec: PoolRecord) -> list[str]:
        """Each allocation whose successor took its hosts over and that has ended is replaced by
        that successor in ``rec`` (the caller saves); returns what changed, said."""
        allocs = allocations(rec)
        renewing = [a for a in allocs if a.successor]
        if not renewing:
            return []
        states = jobs_states([j for a in renewing for j in a.jobs])
        said = []
        for a in renewing:
            if states[a.job_id][0] in ALIVE or states[a.successor][0] != "RUNNING":
                continue
            allocs[allocs.index(a)] = Allocation(a.successor, a.first, a.nodes, time.time())
            said.append(f"allocation {a.successor} took {a.label()} over from allocation {a.job_id}")
        if said:
            set_allocations(rec, allocs)
        return said

    # ------------------------------------------------------------ growing and shrinking

    def resize(self, rec: PoolRecord, hosts: int) -> tuple[list[int], dict[int, str]]:
        """Grows by one further allocation for the new hosts, or shrinks by releasing whole
        allocations from the last (their agents are told to stop by the caller first). Returns the
        new hosts to wait for, and the incarnations they must not be (none: they are new)."""
        allocs = allocations(rec)
        old = rec.num_hosts
        if hosts > old:
            allocs.append(self._submit(rec, old, hosts - old))
            rec.spec["hosts"] = hosts
            set_allocations(rec, allocs)
            return list(range(old, hosts)), {}
        released = self.released_by(rec, hosts)
        # (and a successor waiting to take its hosts over, or that took them: ended before their
        # files are cleared, so no last heartbeat, exit record or takeover writes one back after)
        end_jobs([job for a in released for job in a.jobs], grace_s=5, settle_s=RELEASE_SETTLE_S)
        for a in released:
            for i in a.indices:
                Registry.clear_host(rec, i)
                Registry.clear_host(rec, i, standby=True)
            allocs.remove(a)
        rec.spec["hosts"] = hosts
        set_allocations(rec, allocs)
        return [], {}

    def released_by(self, rec: PoolRecord, hosts: int) -> list[Allocation]:
        """The allocations a shrink to ``hosts`` releases: whole ones, from the last; a size that
        would split one is refused, naming the sizes that would not."""
        allocs = allocations(rec)
        ends = [a.first for a in allocs[1:]] + [rec.num_hosts]
        if hosts not in ends:
            layout = ", ".join(f"{a.label()} (job {a.job_id})" for a in allocs)
            sizes = " or ".join(str(e) for e in ends if e < rec.num_hosts) or "none smaller"
            raise MonarchError(
                f"pool {rec.name!r} holds {layout}: a SLURM pool shrinks by whole allocations, so resize it to {sizes}"
            )
        return [a for a in allocs if a.first >= hosts]

    def end_leftovers(self, rec: PoolRecord, lost: list[int]) -> list[str]:
        """A job step on each lost host's node (the allocation still runs: its other agents do)
        ends what the dead agent left there, in that node's mount namespace."""
        from ..syncfs.host import pool_id

        if shutil.which("srun") is None:
            return []
        states = jobs_states([j for a in allocations(rec) for j in a.jobs])
        hosts = Registry.hosts(rec)
        steps = []
        for i in lost:
            h = hosts[i] if i < len(hosts) else None
            alloc = allocation_of(rec, i)
            if h is None or not h.hostname or alloc is None:
                continue
            job = alloc.job_id
            if states[job][0] != "RUNNING":
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
                    # (a successor waiting on standby keeps its node store)
                    *[
                        arg
                        for h in Registry.standby_hosts(rec.state_dir, [i]).values()
                        for arg in ("--keep", h.incarnation)
                    ],
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
        end_jobs([j for a in allocations(rec) for j in a.jobs], grace_s=5)

    def wait_ready(
        self, rec: PoolRecord, indices: list[int], old: dict[int, str], timeout: float, progress: Callable[[str], None]
    ) -> None:
        waited = [a for a in allocations(rec) if any(i in a.indices for i in indices)]
        last: dict[str, Any] = {"t": 0.0, "said": {}, "why": {}}

        def check(i: int) -> str | None:
            if time.time() - last["t"] >= 0.5:  # every allocation's state, one squeue, twice a second
                last["t"] = time.time()
                states = jobs_states([a.job_id for a in waited])
                for a in waited:
                    last["why"][a.job_id] = self._why_not_starting(rec, a, *states[a.job_id], progress, last["said"])
            alloc = allocation_of(rec, i)
            return last["why"].get(alloc.job_id) if alloc is not None else None

        try:
            wait_for_hosts(rec, indices, old, timeout, check)
        except StartTimeout:
            states = jobs_states([a.job_id for a in waited])
            still = "; ".join(
                f"allocation {a.job_id} still {states[a.job_id][0] or 'unknown'}"
                + (f" ({states[a.job_id][1]})" if states[a.job_id][1] not in ("", "None") else "")
                for a in waited
            )
            raise MonarchError(
                f"pool {rec.name!r}: {still} after {timeout:.0f} s; cancelled it (raise start_timeout to wait longer)"
            ) from None

    @staticmethod
    def _why_not_starting(
        rec: PoolRecord,
        alloc: Allocation,
        state: str,
        reason: str,
        _left: str,
        progress: Callable[[str], None],
        said: dict[str, str],
    ) -> str | None:
        """Says an allocation's state when it changes; the reason it can never start, or None."""
        job = alloc.job_id
        line = f"allocation {job}: {state or 'unknown'}" + (f" ({reason})" if reason and reason != "None" else "")
        if said.get(job) != line:
            progress(line)
            said[job] = line
        if state and state not in ALIVE:
            log = Path(rec.state_dir) / "logs" / f"slurm-{job}.out"
            tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
            return f"allocation {job} is {state}" + (f": {' | '.join(tail)}" if tail else "")
        if state == "PENDING" and reason in _HOPELESS:
            return f"allocation {job} can never start ({reason}{_partition_hint(rec, reason, alloc.nodes)})"
        return None

    @staticmethod
    def _lost_text(job: str, state: str, reason: str) -> str | None:
        if state == "COMPLETING":  # ending: the accounting record says why (CANCELLED, TIMEOUT, ...)
            final = _sacct_state(job)
            state = final if final and final not in ("RUNNING", "PENDING", "COMPLETING") else "ending (COMPLETING)"
            reason = ""
        if state == "RUNNING":
            return None
        return f"allocation {job} is {state or 'gone'}" + (f" ({reason})" if reason and reason != "None" else "")

    def lost_hosts(self, rec: PoolRecord) -> dict[int, str]:
        """Hosts whose allocation is not running, each with why (one squeue for the pool). Those
        of an allocation that ended while its successor runs are not lost: the successor's agents
        serve them."""
        allocs = allocations(rec)
        states = jobs_states([j for a in allocs for j in a.jobs])
        lost: dict[int, str] = {}
        for a in allocs:
            why = self._lost_text(a.job_id, *states[a.job_id][:2])
            if why and a.successor:
                after = self._lost_text(a.successor, *states[a.successor][:2])
                why = f"{why}; its successor {after}" if after else None
            if why:
                lost.update({i: why for i in a.indices})
        return lost

    def loss_reason(self, rec: PoolRecord) -> str | None:
        """Why the whole pool is gone (every allocation ended), or None."""
        lost = self.lost_hosts(rec)
        if not lost or len(lost) < rec.num_hosts:
            return None
        return "; ".join(dict.fromkeys(lost.values()))

    # ------------------------------------------------------------ walltime

    def time_left(self, rec: PoolRecord) -> list[tuple[Allocation, int | None]]:
        """Each allocation's walltime left in seconds (None: unlimited, or not running yet): its
        successor's once it has ended and the successor runs."""
        allocs = allocations(rec)
        states = jobs_states([j for a in allocs for j in a.jobs])
        out: list[tuple[Allocation, int | None]] = []
        for a in allocs:
            job = a.job_id
            if a.successor and states[job][0] not in ("RUNNING", "COMPLETING") and states[a.successor][0] == "RUNNING":
                job = a.successor
            try:
                out.append((a, parse_slurm_time(states[job][2])))
            except MonarchError:  # UNLIMITED, NOT_SET, INVALID
                out.append((a, None))
        return out

    def short_of(self, rec: PoolRecord, want: int) -> str:
        """The allocations with less than ``want`` seconds left, said; "" when none is short."""
        short = [(a, left) for a, left in self.time_left(rec) if left is not None and left < want]
        return ", ".join(f"allocation {a.job_id} ({a.label()}) has {_human(left)} left" for a, left in short)

    def hosts_with_time(self, rec: PoolRecord, want: float) -> list[int]:
        """The hosts whose allocation has ``want`` seconds left (or no limit)."""
        return [i for a, left in self.time_left(rec) if left is None or left >= want for i in a.indices]

    def reuse_refusal(self, rec: PoolRecord, options: dict[str, Any]) -> str | None:
        """A run that says how long it needs (``min_time_left=``) is placed only on hosts whose
        allocation has that much left (``hosts_with_time``); on a pool where none has, it is
        refused, in one line saying how much is left: an allocation cannot be extended, and the
        run would be cut short at its walltime."""
        want = options.get("min_time_left_s")
        short = self.short_of(rec, want) if want and not self.hosts_with_time(rec, want) else ""
        if not short:
            return None
        return (
            f"pool {rec.name!r}: {short}, less than min_time_left={options.get('min_time_left')} asks; an "
            f"allocation cannot be extended: `monarch-torchx pool stop {rec.name}` and run again for a new one"
        )

    def reuse_warnings(self, rec: PoolRecord, options: dict[str, Any]) -> list[str]:
        """``time=`` sizes the allocation a run would submit, and every run of a script repeats it:
        on a reused pool with less left it is said, not refused (``min_time_left=`` refuses).
        ``max_nodes``/``backlog`` are the pool's, set when it is made: another value is said."""
        out = []
        asked = (options.get("max_nodes"), options.get("backlog_s"))
        has = (rec.options.get("max_nodes"), rec.options.get("backlog_s"))
        if asked[0] is not None and asked != has:
            out.append(
                f"pool {rec.name!r} was made with max_nodes={has[0]}, backlog={has[1]}s: max_nodes and backlog "
                f"are set when a pool is made (-cfg replace=True makes it anew with these)"
            )
        if options.get("renew") and not rec.options.get("renew"):
            out.append(
                f"pool {rec.name!r} was made without renew: renew is set when a pool is made "
                f"(-cfg replace=True makes it anew with it)"
            )
        want = options.get("walltime_s")
        short = self.short_of(rec, want) if want else ""
        if short:
            out.append(
                f"pool {rec.name!r}: {short}, less than time={options.get('time')} asks; it is reused (-cfg "
                f"min_time_left=... refuses instead): for a new allocation, `monarch-torchx pool stop {rec.name}`"
            )
        return out

    def describe(self, rec: PoolRecord) -> dict[str, Any]:
        allocs = allocations(rec)
        states = jobs_states([j for a in allocs for j in a.jobs])
        parts = [
            {
                "job_id": a.job_id,
                "hosts": a.hosts_text(),
                "nodes": a.nodes,
                "state": states[a.job_id][0],
                "reason": states[a.job_id][1] if states[a.job_id][1] != "None" else "",
                "time_left": states[a.job_id][2],
                "successor": {
                    "job_id": a.successor,
                    "state": states[a.successor][0],
                    "reason": states[a.successor][1] if states[a.successor][1] != "None" else "",
                    "time_left": states[a.successor][2],
                    "armed": _armed(rec, a),
                }
                if a.successor
                else None,
            }
            for a in allocs
        ]
        first = parts[0] if parts else {"job_id": None, "state": "", "reason": "", "time_left": ""}
        return {
            "job_id": first["job_id"],
            "state": first["state"],
            "reason": first["reason"],
            "time_left": first["time_left"],
            "walltime": rec.options.get("time"),
            "allocations": parts,
            "autoscale": _autoscale(rec),
        }


def _armed(rec: PoolRecord, alloc: Allocation) -> int:
    """How many of a successor's agents wait on standby, readied (``handover.arm``)."""
    return sum(h.armed for h in Registry.standby_hosts(rec.state_dir, alloc.indices).values())


def _autoscale(rec: PoolRecord) -> dict[str, Any] | None:
    """The allocator's state for ``pool status`` (a pool made with ``max_nodes`` or ``renew``), or None."""
    most = rec.options.get("max_nodes")
    if not most and not rec.options.get("renew"):
        return None
    st = AllocatorState.read(rec.state_dir) or AllocatorState()
    return {
        "max_nodes": most,
        "backlog_s": rec.options.get("backlog_s"),
        "renew": bool(rec.options.get("renew")),
        "phase": st.phase.value,
        "reason": st.reason,
        "grown": st.grown,
        "renewed": st.renewed,
    }


def create_scheduler(session_name: str, **kwargs: Any) -> MonarchScheduler:
    return MonarchScheduler(session_name, "monarch_slurm")
