"""``monarch-torchx exec``: one command on some or all hosts of a pool, its output as it comes.

An exec is an app like any other (``apps.py``): one replica per chosen host, started by that
host's agent (warm, from its fork server's session, with the pool's environment), admitted by its
ledger when it asks CPUs or GPUs, listed by `torchx list`, its lines in the telemetry tables. Two
things differ from `torchx run`, because a command sent to every host is a tool, not a job:
- each host stands alone: a host that cannot start it (lost, unreachable, busy) is reported and
  the others still run (a run is all or nothing);
- it is never queued: a host that has not the CPUs or GPUs asked of it now refuses at once.

The command is started as the pool starts any replica: a ``python ...`` forked warm from the
host's fork server (its preloads imported), anything else as a program of its own; a program
that is not there is that host's exit code 127 with the reason, as a shell would say it.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

from .apps import kill, replica_states
from .pool import Pool
from .registry import AppRecord, Placement, Registry
from .resources import CapacityRefused, Resources
from .specs import LaunchSpec, ReplicaState

ROLE = "exec"
NOT_RUN = 255  # a host where the command did not run or its end is unknown (as ssh says it)
TIMED_OUT = 124  # a host where it ran past ``timeout_s`` and was ended (as coreutils' timeout says it)


@dataclass
class HostRun:
    """One host's part of an exec."""

    host: int
    exit_code: int  # the command's (128 + N when signal N ended it); NOT_RUN: see ``error``
    state: str  # SUCCEEDED, FAILED, CANCELLED, or NOT_STARTED
    error: str = ""  # why it did not run, or why its end is not known
    output: list[str] = field(default_factory=list)  # its lines (kept only when asked: ``keep_output``)


@dataclass
class ExecResult:
    """What ``run_exec`` returns: each chosen host's part, in host order."""

    app_id: str
    hosts: list[HostRun]

    @property
    def exit_code(self) -> int:
        """The worst of the hosts' (the largest): 0 only when the command succeeded everywhere."""
        return max((h.exit_code for h in self.hosts), default=0)

    def to_json(self) -> dict[str, Any]:
        return {"app_id": self.app_id, "exit_code": self.exit_code, "hosts": [asdict(h) for h in self.hosts]}


def choose_hosts(pool: Pool, hosts: Iterable[int] | None) -> list[int]:
    """The hosts to run on (all when ``hosts`` is None); ValueError naming one the pool lacks."""
    n = pool.record.num_hosts
    if hosts is None:
        return list(range(n))
    chosen = sorted(set(hosts))
    bad = [i for i in chosen if not 0 <= i < n]
    if bad or not chosen:
        raise ValueError(f"pool {pool.name!r} has hosts 0..{n - 1}; no host {', '.join(map(str, bad)) or 'chosen'}")
    return chosen


def _exit_code(code: int | None) -> int:
    if code is None:
        return NOT_RUN
    return 128 - code if code < 0 else min(code, 255)  # (a signal as a shell reports it)


def start_exec(
    pool: Pool, argv: list[str], hosts: list[int], resources: Resources | None = None
) -> tuple[AppRecord, dict[int, str]]:
    """Starts ``argv`` on each of ``hosts``; returns the app (the hosts it started on) and why it
    did not start on each other one."""
    if not argv:
        raise ValueError("no command: give one after --, e.g. `-- nvidia-smi -L`")
    app_id = f"exec-{uuid.uuid4().hex[:10]}"
    live = pool.hosts
    specs: dict[int, LaunchSpec] = {}
    not_started: dict[int, str] = {}
    for i in hosts:
        if i >= len(live) or live[i] is None:
            not_started[i] = f"host {i} has no agent"
            continue
        specs[i] = LaunchSpec(
            app_id,
            ROLE,
            i,
            list(argv),
            resources=resources.to_wire() if resources else None,
        )
    placement = [Placement(ROLE, i, i, live[i].incarnation) for i in specs]  # type: ignore[union-attr]
    arec = AppRecord(
        app_id, pool.name, "exec " + " ".join(argv)[:200], [{"name": ROLE, "num_replicas": len(specs)}], placement
    )
    Registry.save_app(pool.record, arec)
    answers = pool.ask("launch", sorted(specs), timeout=30.0, calls={i: [{"spec": vars(s)}] for i, s in specs.items()})
    for i, _, err in answers:
        if err is not None:
            why = f"busy: {err}" if isinstance(err, CapacityRefused) else str(err)
            not_started[i] = why
    if not_started:
        arec.placement = [p for p in arec.placement if p.host_index not in not_started]
        Registry.save_app(pool.record, arec)
    return arec, not_started


def run_exec(
    pool: Pool,
    scheduler: Any,
    argv: list[str],
    hosts: list[int],
    on_line: Callable[[int, str], None] = lambda _h, _l: None,
    on_error: Callable[[int, str], None] = lambda _h, _e: None,
    keep_output: bool = False,
    resources: Resources | None = None,
    timeout_s: float | None = None,
) -> ExecResult:
    """Runs ``argv`` on ``hosts`` and follows it to its end: each line as it is written
    (``on_line(host, line)``, through the relay tree on big pools), each host that cannot run
    or be followed as it is known (``on_error``). A KeyboardInterrupt ends it on every host
    before it goes on up. ``timeout_s``: past it, the command is ended where it still runs
    (those hosts' code: TIMED_OUT). ``scheduler``: the pool's TorchX scheduler (its log follower)."""
    arec, not_started = start_exec(pool, argv, hosts, resources)
    for i, why in sorted(not_started.items()):
        on_error(i, why)
    output: dict[int, list[str]] = {p.host_index: [] for p in arec.placement}
    follow_errors: dict[int, str] = {}
    timed_out = threading.Event()

    def time_out() -> None:
        timed_out.set()
        kill(pool, arec, f"timed out after {timeout_s:g} s")

    timer = threading.Timer(timeout_s, time_out) if timeout_s and arec.placement else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        if arec.placement:
            events = scheduler.follow_logs(f"{pool.name}:{arec.app_id}", [(ROLE, p.replica_id) for p in arec.placement])
            for ev in events:
                if ev.error:
                    follow_errors[ev.host] = ev.error
                    on_error(ev.host, ev.error)
                    continue
                for line in ev.lines:
                    line = line.rstrip("\n")
                    on_line(ev.host, line)
                    if keep_output:
                        output[ev.host].append(line)
    except KeyboardInterrupt:
        kill(pool, arec, "interrupted (Ctrl-C)")
        raise
    finally:
        if timer is not None:
            timer.cancel()
    states = replica_states(pool, arec) if arec.placement else {}
    runs = [HostRun(i, NOT_RUN, "NOT_STARTED", why) for i, why in not_started.items()]
    for p in arec.placement:
        st = states.get((ROLE, p.replica_id))
        if st is None or not st.state.terminal:
            why = follow_errors.get(p.host_index) or (st.msg if st else "its end was not heard")
            runs.append(HostRun(p.host_index, NOT_RUN, st.state.value if st else "UNKNOWN", why, output[p.host_index]))
            continue
        if timed_out.is_set() and st.state == ReplicaState.CANCELLED:
            runs.append(HostRun(p.host_index, TIMED_OUT, st.state.value, st.msg, output[p.host_index]))
            continue
        code = NOT_RUN if st.exit_code is None else _exit_code(st.exit_code)
        err = st.msg if st.exit_code is None or code == 127 else ""  # (127: the start's own reason)
        runs.append(HostRun(p.host_index, code, st.state.value, err, output[p.host_index]))
    return ExecResult(arec.app_id, sorted(runs, key=lambda r: r.host))
