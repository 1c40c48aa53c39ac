"""Apps on a pool: launch replicas on hosts, ask how they are doing, kill them.

One mechanism for every front end: TorchX apps (``monarch_torchx/schedulers/base.py``) and submitit jobs
(``submitit_executor.py``) are both an ``AppRecord`` in the registry plus one ``LaunchSpec`` per
replica on its host's agent, so `torchx list`, `pool status` and the telemetry see all of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from . import history, scheduling
from .app_queue import QUEUE_HOST, QueueEntry, QueueState, SubmittedApp
from .errors import AccessError, HostLost, HostUnreachable, MonarchError
from .net import RemoteError
from .net.fanout import RelayRefused
from .pool import Pool, PoolRequest, ensure_pool, reuse_unchecked, tree_min_hosts
from .registry import AppRecord, Placement, Registry
from .resources import CapacityRefused, HostLoad, Resources
from .scheduling import AppAsk, ReplicaAsk
from .specs import (
    CANCELLED,
    FAILED,
    PENDING,
    RUNNING,
    SUCCEEDED,
    UNKNOWN,
    LaunchSpec,
    ReplicaState,
    ReplicaStatus,
    may_requeue,
)

_STATE_ORDER = [FAILED, CANCELLED, UNKNOWN, RUNNING, PENDING]


def app_state(states: list[str]) -> str:
    """TorchX semantics: any failure fails the app; it succeeds only when every replica did."""
    if states and all(s == SUCCEEDED for s in states):
        return SUCCEEDED
    for s in _STATE_ORDER:
        if s in states:
            return s
    return PENDING


class LaunchFailed(MonarchError):
    """A launch that left nothing running (all or nothing). ``hosts``: those it failed on;
    ``refused``: those whose agent answered with an error (the app's or the agent's business,
    not the pool's health: ``start`` does not try again for them)."""

    def __init__(self, message: str, hosts: Sequence[int], refused: Sequence[int] = (), capacity: bool = False):
        super().__init__(message)
        self.hosts = list(hosts)
        self.refused = list(refused)
        self.capacity = capacity  # every host refused for capacity (another client took it first)


class MustWait(MonarchError):
    """The app does not fit the pool's free capacity now (or others wait before it): it goes to
    the pool's queue (``enqueue``), or is refused (``-cfg queue=False``)."""

    def __init__(self, message: str, pool: Pool):
        super().__init__(message)
        self.pool = pool


UNPLACED = -1  # the host index of a replica of an app that waits in the pool's queue


Placer = Callable[[Pool], list[tuple[int, LaunchSpec]]]


def launch(
    pool: Pool, app_id: str, name: str, roles: list[dict[str, Any]], replicas: list[tuple[int, LaunchSpec]]
) -> AppRecord:
    """Records the app, then starts each (host_index, spec) on its host; all or nothing."""
    return _launch(pool, app_id, name, roles, replicas, others=())[0]


def _launch(
    pool: Pool,
    app_id: str,
    name: str,
    roles: list[dict[str, Any]],
    replicas: list[tuple[int, LaunchSpec]],
    others: Sequence[int],
) -> tuple[AppRecord, list[tuple[int, Exception]]]:
    """``launch``, with the hosts ``others`` (none of the replicas' hosts) asked in the same pass
    to answer an empty request; returns the app and those of ``others`` that did not answer, with
    why."""
    hosts = pool.hosts
    placement = []
    for i, spec in replicas:
        host = hosts[i]
        if host is None:
            raise MonarchError(f"host {i} of pool {pool.name!r} has no agent")
        placement.append(Placement(spec.role, spec.replica_id, i, host.incarnation))
    retry = [dict(vars(spec)) for _, spec in replicas if may_requeue(vars(spec), 0)]
    arec = AppRecord(app_id, pool.name, name, roles, placement, retry_specs=retry)
    Registry.save_app(pool.record, arec)
    by_host: dict[int, list[LaunchSpec]] = {}
    for i, spec in replicas:
        by_host.setdefault(i, []).append(spec)

    calls = {i: [{"spec": spec.__dict__} for spec in specs] for i, specs in by_host.items()}
    calls.update({i: [] for i in others if i not in by_host})
    answers = pool.ask("launch", sorted(calls), timeout=30.0, calls=calls)
    errors = [(i, e) for i, _, e in answers if e and i in by_host]
    if errors:
        kill(pool, arec)
        # and ended before the error is raised (a host whose answer was lost may have started some):
        # the app started again (``start``) finds none of its replicas still running
        pool.ask("wait", sorted(by_host), timeout=15.0, app_id=app_id, within=10.0)
        raise LaunchFailed(
            f"could not start {app_id} on pool {pool.name!r}: " + "; ".join(f"host {i}: {e}" for i, e in errors),
            [i for i, _ in errors],
            [i for i, e in errors if _refused(e)],
            capacity=all(isinstance(e, CapacityRefused) for _, e in errors),
        )
    return arec, [(i, e) for i, _, e in answers if e and i not in by_host]


def _refused(e: Exception) -> bool:
    """The host's agent answered with an error of its own: not one that says it is stopping
    (``RelayRefused``, a host the pool's check counts as gone)."""
    return isinstance(e, RemoteError) and not isinstance(e, RelayRefused)


def start(
    req: PoolRequest,
    app_id: str,
    name: str,
    roles: list[dict[str, Any]],
    place: Placer,
    registry: Registry | None = None,
    defaults: dict[str, Any] | None = None,
    progress: Callable[[str], None] = lambda _m: None,
    check_first: bool = False,
) -> tuple[Pool, AppRecord]:
    """Starts an app on the pool ``req`` names, all or nothing: ``ensure_pool``, then ``launch``
    of what ``place(pool)`` gives, in one pass over the pool where it can.

    A pool whose requests go through the relay tree, that exists and shows no evidence of loss at
    hand (``reuse_unchecked``), is not health-checked first: the launch goes to every host of the
    pool, those without a replica with an empty request, so that one pass both checks the hosts
    and starts the app (and resets every agent's idle clock). When a host fails that pass:
    - a host with a replica: the launch ends what it had started (all or nothing), and the pool
      is checked as ``ensure_pool`` does (lost hosts repaired, unreachable ones reported). If
      every host the launch failed on was not reached and is well now, the app is started once
      more: replicas that had started on other hosts start a second time (a short one may have
      run to its end), and their logs hold both tries. Else the launch's error is raised.
    - only hosts without a replica: the launch stands, and nothing is repaired under it (on SLURM
      a repair replaces the whole allocation). Each such host is named, lost or unreachable, and
      the next run checks the pool before it launches.
    ``check_first``: check the pool before anything (a run that syncs a workspace first).
    ``place`` failing to reach a host it asked (``HostUnreachable``, ``HostLost``: a warm
    torchrun's port) counts as a failed launch.
    """
    # (fewer hosts than the relay tree's: direct requests, so a host without a replica would get a
    # handshake, not its idle clock reset; ensure_pool checks the pool first)
    pool = None if check_first else reuse_unchecked(req, registry, progress, min_hosts=tree_min_hosts())
    if pool is None:
        pool = ensure_pool(req, registry, defaults=defaults, progress=progress)
        return pool, launch(pool, app_id, name, roles, place(pool))
    try:
        arec, silent = _launch(pool, app_id, name, roles, place(pool), others=range(pool.record.num_hosts))
    except (LaunchFailed, HostUnreachable, HostLost) as e:
        if isinstance(e, LaunchFailed) and e.capacity:
            raise MustWait(str(e), pool) from None
        if isinstance(e, LaunchFailed) and e.refused:
            if set(e.hosts) - set(e.refused):  # others were not reached: the next run checks first
                Registry.want_check(pool.record.path, f"host(s) {sorted(set(e.hosts) - set(e.refused))} not reached")
            raise
        failed = e.hosts if isinstance(e, LaunchFailed) else [e.index]
        checked = ensure_pool(req, registry, defaults=defaults, progress=progress)
        if any(i in checked.unreachable for i in failed):
            raise  # (the check said which host, and why)
        progress(f"starting {app_id} again, on the checked pool")
        return checked, launch(checked, app_id, name, roles, place(checked))
    if silent:
        _name_unanswered(pool, silent, progress)
    return pool, arec


def _name_unanswered(pool: Pool, silent: list[tuple[int, Exception]], progress: Callable[[str], None]) -> None:
    """Hosts without a replica that did not answer a launch that stands: each named, lost (on
    evidence) or unreachable; the next run checks the pool first (``Registry.want_check``)."""
    for i, err in silent:
        try:
            evidence = pool.loss_evidence(i, err)
        except MonarchError as e:  # (the engine's word could not be had: the host stays unreachable)
            evidence, err = None, e
        if evidence:
            progress(f"{pool.lost_message(i, evidence, err)}; the next run repairs it")
        else:
            progress(f"host {i} is unreachable but not known to be lost ({err}); leaving it be")
    Registry.want_check(pool.record.path, f"host(s) {[i for i, _ in silent]} did not answer a launch")


def replica_states(pool: Pool, arec: AppRecord) -> dict[tuple[str, int], ReplicaStatus]:
    """(role, replica) -> what is known of it (its agent's answer, with the hostname).

    A replica whose end is recorded (``history.py``) is that end, whatever became of its host
    since; only the others are asked of their hosts. Of those, one whose host is lost, or was
    restarted since it launched, is FAILED with the reason (and the engine's, e.g. "allocation 12
    is CANCELLED"); one whose host is only unreachable is UNKNOWN. An end an agent reports is
    recorded here too (hosts that do not share this file system: Kubernetes).
    """
    state_dir = pool.record.path
    ends = history.read_ends(state_dir, arec.app_id, ages=True)
    out: dict[tuple[str, int], ReplicaStatus] = {k: e.status() for k, e in ends.items()}
    if unplaced(arec) and len(ends) < len(arec.placement):
        arec, entry = placed(pool, arec)
        if entry is not None:
            return queued_states(pool, arec, entry, out)
    asked = [p for p in arec.placement if (p.role, p.replica_id) not in ends]
    if not asked:
        return out
    out.update(_asked_states(pool, arec, asked))
    if arec.retry_specs and any(out[(p.role, p.replica_id)].host_lost for p in asked):
        requeue_lost(pool, arec, out)
    shared = pool.provisioner.client_cwd_on_hosts  # (else an agent's own record is on its host only)
    for p in asked:
        st = out[(p.role, p.replica_id)]
        # an agent's answer it did not record itself (hosts without this file system), or a loss on evidence
        if st.state.terminal and st.final and not (shared and st.recorded):
            with contextlib.suppress(OSError, ValueError):
                history.record_end(state_dir, history.ReplicaEnd.from_status(arec.app_id, p.role, p.replica_id, st))
    return out


def stopped_states(arec: AppRecord, state_dir: Path, pool_name: str) -> dict[tuple[str, int], ReplicaStatus]:
    """``replica_states`` of an app whose pool was stopped: its recorded ends; a replica without
    one was running when the pool went and its end was never heard."""
    ends = history.read_ends(state_dir, arec.app_id)
    return {
        (p.role, p.replica_id): ends[(p.role, p.replica_id)].status()
        if (p.role, p.replica_id) in ends
        else ReplicaStatus(
            ReplicaState.FAILED,
            msg=f"its pool {pool_name!r} was stopped before its end was recorded (it was still running)",
        )
        for p in arec.placement
    }


def _asked_states(pool: Pool, arec: AppRecord, asked: list[Placement]) -> dict[tuple[str, int], ReplicaStatus]:
    """The states of the replicas ``asked``, from their hosts (see ``replica_states``)."""
    indices = sorted({p.host_index for p in asked})
    answers = {i: (res, err) for i, res, err in pool.ask("describe", indices, timeout=10.0, app_id=arec.app_id)}
    # a host that did not answer is lost only on evidence (see Pool.loss_evidence); else UNKNOWN
    evidence = {
        i: pool.loss_evidence(i, err)
        for i, (_, err) in answers.items()
        if err is not None and not isinstance(err, AccessError)
    }
    out: dict[tuple[str, int], ReplicaStatus] = {}
    for p in asked:
        res, err = answers[p.host_index]
        host = pool.hosts[p.host_index] if p.host_index < len(pool.hosts) else None
        hostname = host.hostname if host else ""
        key = (p.role, p.replica_id)
        lost = evidence.get(p.host_index)
        if isinstance(err, AccessError):  # we cannot reach the hosts: that says nothing about the replica
            out[key] = ReplicaStatus(ReplicaState.UNKNOWN, msg=str(err), hostname=hostname)
        elif err is not None and not lost and isinstance(err, HostUnreachable):
            out[key] = ReplicaStatus(ReplicaState.UNKNOWN, msg=str(err), hostname=hostname)  # unreachable: not dead
        elif err is not None:  # (final only on the evidence of a loss: else it may be answered later)
            out[key] = ReplicaStatus(
                ReplicaState.FAILED,
                msg=pool.lost_message(p.host_index, lost, err) if lost else str(err),
                hostname=hostname,
                final=bool(lost),
                host_lost=bool(lost),
            )
        elif host is None or host.incarnation != p.incarnation:
            out[key] = ReplicaStatus(
                ReplicaState.FAILED,
                hostname=hostname,
                msg=f"host {p.host_index} was lost and restarted while the replica ran",
                host_lost=True,
            )
        else:
            st = next((s for s in res if s["role"] == p.role and s["replica_id"] == p.replica_id), None)
            out[key] = (
                ReplicaStatus.from_wire(
                    {**st, "attempts": int(st.get("attempts") or 0) + p.requeues}, hostname=hostname
                )
                if st
                else ReplicaStatus(
                    ReplicaState.FAILED, msg=f"replica not known to host {p.host_index}", hostname=hostname, final=False
                )
            )  # (its launch may not have reached it yet)
            if p.requeues and not out[key].msg:
                out[key] = dataclasses.replace(
                    out[key], msg=f"requeued {p.requeues} time(s) on another host: its host was lost"
                )
    return out


def requeue_lost(pool: Pool, arec: AppRecord, out: dict[tuple[str, int], ReplicaStatus]) -> None:
    """Starts again, on another host, each replica of ``out`` whose host was lost and whose
    launched spec allows it (``specs.may_requeue``: ``max_retries`` left, or a submitit job), as
    SLURM requeues a job whose node failed; ``out`` then says where it runs. Whoever asks first
    does it (a describe, `torchx status`, a submitit poll): under the pool's lock, and only while
    the record still places it on the lost host, so two clients never start it twice. The host:
    the least loaded one it fits on (``scheduling.place``), never the lost one nor one holding
    another replica of its role. No such host now: it stays FAILED, saying why."""
    specs = {(s["role"], s["replica_id"]): s for s in arec.retry_specs}
    due = [
        (p.role, p.replica_id)
        for p in arec.placement
        if (st := out.get((p.role, p.replica_id))) is not None
        and st.host_lost
        and (p.role, p.replica_id) in specs
        and may_requeue(specs[(p.role, p.replica_id)], p.requeues)
    ]
    if not due:
        return
    with pool.registry.lock(pool.name, wait=False) as held:
        fresh = Registry.get_app(pool.record, arec.app_id) if held else None
        if fresh is None:  # a run is at work on the pool: the next one to ask requeues them (not an end)
            for key in due:
                lost = out[key]
                out[key] = ReplicaStatus(
                    ReplicaState.PENDING,
                    msg=f"to be requeued once another run is done with the pool: {lost.msg}",
                    hostname=lost.hostname,
                    attempts=lost.attempts,
                    final=False,
                )
            return
        placement = list(fresh.placement)
        loads: list[HostLoad] | None = None
        for n, p in enumerate(placement):
            key = (p.role, p.replica_id)
            st, spec = out.get(key), specs.get(key)
            was = next((q for q in arec.placement if (q.role, q.replica_id) == key), None)
            if st is None or not st.host_lost or spec is None or p != was or not may_requeue(spec, p.requeues):
                continue  # (p != was: another client requeued it since this one read the record)
            if loads is None:
                loads = pool_loads(pool)[0]
            others = {q.host_index for q in placement if q.role == p.role and q != p}
            room = [h for h in loads if h.index != p.host_index and h.index not in others]
            ask = AppAsk(arec.app_id, [ReplicaAsk(p.role, p.replica_id, Resources.from_wire(spec.get("resources")))])
            where = scheduling.place(ask, room)
            if where is None:
                out[key] = dataclasses.replace(st, msg=f"{st.msg}; not requeued: no other host has room for it now")
                continue
            h = where[key]
            host = pool.hosts[h]
            try:
                got = pool.call(h, "launch", timeout=30.0, spec=spec)
            except (MonarchError, OSError, RemoteError) as e:
                out[key] = dataclasses.replace(st, msg=f"{st.msg}; could not be requeued on host {h}: {e}")
                continue
            assert host is not None
            placement[n] = Placement(p.role, p.replica_id, h, host.incarnation, p.requeues + 1)
            now = ReplicaStatus.from_wire(
                {**got, "attempts": int(got.get("attempts") or 1) + p.requeues}, hostname=host.hostname
            )
            out[key] = dataclasses.replace(now, msg=f"requeued on host {h} ({p.requeues + 1} of its retries): {st.msg}")
            loads = None  # (asked again for the next one: what this one holds there counts)
        if placement != fresh.placement:
            Registry.save_app(pool.record, dataclasses.replace(fresh, placement=placement))


def kill(pool: Pool, arec: AppRecord, reason: str = "cancelled") -> None:
    """Ends the app: out of the pool's queue if it waits there, its replicas if it runs."""
    if unplaced(arec):
        entry = QueueEntry.from_wire(
            pool.call(QUEUE_HOST, "queue.cancel", timeout=15.0, app_id=arec.app_id, reason=reason)
        )
        if entry.state != QueueState.STARTED:
            return
        arec = _save_placement(pool, arec, entry)
    indices = sorted({p.host_index for p in arec.placement})
    pool.ask("kill", indices, timeout=15.0, app_id=arec.app_id, reason=reason)


# ---------------------------------------------------------------- capacity and the pool's queue


def pool_loads(pool: Pool) -> tuple[list[HostLoad], dict[int, Exception]]:
    """Each host's capacity and what is held of it (those that answered), and why each other
    host did not answer."""
    loads, errors = [], {}
    for i, value, err in pool.ask("capacity", range(pool.record.num_hosts), timeout=10.0):
        if err is not None:
            errors[i] = err
        else:
            loads.append(HostLoad.from_wire(value))
    return loads, errors


def fit_to_pool(pool: Pool, sub: SubmittedApp, loads: list[HostLoad], progress: Callable[[str], None]) -> None:
    """Says how ``sub`` meets a pool whose hosts cannot give what it asks, and, on a pool with no
    GPU at all (none detected, none declared), drops its GPU asks: it runs without, as TorchX's
    ``local_cwd`` runs a GPU component on a CPU machine (a pool that has GPUs refuses more than a
    host has). CPUs above a host's own are its whole host's (``Resources.within``)."""
    if not loads:
        return
    asks = [Resources.from_wire(s.resources) for s in sub.specs]
    gpus = max((a.gpus for a in asks), default=0)
    if gpus and not any(load.capacity.gpus for load in loads):
        for s in sub.specs:
            if s.resources:
                s.resources = {**s.resources, "gpus": 0}
        progress(
            f"note: {sub.app_id} asks {gpus} GPU(s) per replica, but no host of pool {pool.name!r} has one (none "
            f"detected, none declared: -cfg gpus_per_host=N): it runs without GPUs"
        )
    cpus = max((a.cpus for a in asks), default=0)
    most = max(load.capacity.cpus for load in loads)
    if cpus > most:
        progress(
            f"note: {sub.app_id} asks {cpus:g} CPUs per replica, more than a host of pool {pool.name!r} has "
            f"({most:g}): each such replica holds all of its host's CPUs"
        )


def unplaced(arec: AppRecord) -> bool:
    return any(p.host_index == UNPLACED for p in arec.placement)


def enqueue(pool: Pool, sub: SubmittedApp) -> tuple[AppRecord, QueueEntry]:
    """Hands ``sub`` to the pool's queue (host 0); see ``enqueue_many``."""
    return enqueue_many(pool, [sub])[0]


def enqueue_many(pool: Pool, subs: list[SubmittedApp]) -> list[tuple[AppRecord, QueueEntry]]:
    """Hands ``subs`` to the pool's queue (host 0) in one request, in order: each recorded first,
    with its replicas not yet placed, so `torchx status` knows it from the moment the queue does.
    Those that fit start at once (their records then say where)."""
    arecs = [
        AppRecord(
            sub.app_id,
            pool.name,
            sub.name,
            sub.roles,
            [Placement(s.role, s.replica_id, UNPLACED, "") for s in sub.specs],
        )
        for sub in subs
    ]
    for arec in arecs:
        Registry.save_app(pool.record, arec)
    targets, _, _ = pool.tree_targets(range(pool.record.num_hosts))
    try:
        got = pool.call(
            QUEUE_HOST,
            "queue.submit",
            timeout=60.0 + 0.05 * len(subs),
            apps=[sub.to_wire() for sub in subs],
            targets=[t.as_dict() for t in targets],
        )
    except BaseException:
        for sub in subs:
            Registry.delete_app(pool.record, sub.app_id)
        raise
    out = []
    for arec, wire in zip(arecs, got):
        entry = QueueEntry.from_wire(wire)
        if entry.state == QueueState.STARTED:
            arec = _save_placement(pool, arec, entry)
        out.append((arec, entry))
    return out


def placed(pool: Pool, arec: AppRecord) -> tuple[AppRecord, QueueEntry | None]:
    """An app that was queued, as the pool's queue knows it now: started (its record then
    holds where: the entry is None), or still waiting, or ended without starting (the entry)."""
    targets, _, _ = pool.tree_targets(range(pool.record.num_hosts))
    try:
        got = pool.call(
            QUEUE_HOST, "queue.status", timeout=10.0, app_ids=[arec.app_id], targets=[t.as_dict() for t in targets]
        )
    except (MonarchError, OSError, RemoteError) as e:
        return arec, QueueEntry(
            arec.app_id, QueueState.UNREACHABLE, f"host {QUEUE_HOST}, which holds the pool's queue, did not answer: {e}"
        )
    entry = QueueEntry.from_wire(got[0])
    if entry.state == QueueState.STARTED:
        return _save_placement(pool, arec, entry), None
    return arec, entry


def _save_placement(pool: Pool, arec: AppRecord, entry: QueueEntry) -> AppRecord:
    arec = AppRecord(
        arec.app_id, arec.pool, arec.name, arec.roles, list(entry.placement), arec.created, list(entry.retry_specs)
    )
    Registry.save_app(pool.record, arec)
    return arec


def queued_states(
    pool: Pool, arec: AppRecord, entry: QueueEntry, ends: dict[tuple[str, int], ReplicaStatus]
) -> dict[tuple[str, int], ReplicaStatus]:
    """The replicas of an app the queue has not started: PENDING while it waits (with what it
    waits for); its recorded ends once it left the queue; FAILED, for good, when the queue lost it."""
    out = dict(ends)
    for p in arec.placement:
        key = (p.role, p.replica_id)
        if key in out:
            continue
        if entry.state == QueueState.QUEUED:
            out[key] = ReplicaStatus(ReplicaState.PENDING, msg=entry.reason)
        elif entry.state == QueueState.UNREACHABLE:
            out[key] = ReplicaStatus(ReplicaState.UNKNOWN, msg=entry.reason, final=False)
        else:
            st = ReplicaState.CANCELLED if entry.cancelled else ReplicaState.FAILED
            out[key] = ReplicaStatus(st, msg=entry.reason or "it left the pool's queue without starting")
            with contextlib.suppress(OSError, ValueError):  # (hosts that do not share this file system)
                history.record_end(
                    pool.record.path,
                    history.ReplicaEnd(
                        arec.app_id, p.role, p.replica_id, st.value, None, out[key].msg, 0, None, time.time()
                    ),
                )
    return out


def list_states(pool: Pool, records: Sequence[AppRecord]) -> dict[tuple[str, str, int], str]:
    """(app_id, role, replica) -> state, for ``records``' replicas: their recorded ends, and what
    the pool's live agents know of the others (the agents are not asked when every one ended)."""
    seen: dict[tuple[str, str, int], str] = {}
    open_apps = False
    for a in records:
        ends = history.read_ends(pool.record.path, a.app_id)
        seen.update({(a.app_id, role, k): e.state for (role, k), e in ends.items()})
        open_apps = open_apps or len(ends) < len(a.placement)
    if open_apps:
        for _, res, _ in pool.ask("list", range(pool.record.num_hosts), timeout=10.0):
            for st in res or []:
                seen.setdefault((st["app_id"], st["role"], st["replica_id"]), st["state"])
    return seen


FAILURE_GRACE_S = 10.0  # the other replicas of a failed app may end on their own first (a torchrun's nodes do)


def ends_with_failure(states: dict[tuple[str, int], ReplicaStatus]) -> bool:
    """The app has failed (a replica FAILED for good) while others still run: TorchX would call
    it FAILED and stop watching, and the others would run on unseen. ``end_failed`` ends them."""
    failed = any(s.failed_for_good for s in states.values())
    return failed and any(s.state in (PENDING, RUNNING) for s in states.values())


def failure_is_fresh(states: dict[tuple[str, int], ReplicaStatus]) -> bool:
    """A replica failed less than ``FAILURE_GRACE_S`` ago (on its host's or the file system's
    clock): the others get that long to end by themselves, with their own reason (the failing
    rank of a torchrun is on another node than the first to fail), before ``end_failed``."""
    ages = [s.age_s for s in states.values() if s.failed_for_good]
    return any(a is not None and a < FAILURE_GRACE_S for a in ages)


def end_failed(
    pool: Pool, arec: AppRecord, states: dict[tuple[str, int], ReplicaStatus]
) -> dict[tuple[str, int], ReplicaStatus]:
    """Ends the replicas still running of an app that failed, then reads its states again: an app
    is reported FAILED only once nothing of it runs (as a failed torchrun ends its other nodes)."""
    failed = sorted(f"{r}/{k}" for (r, k), s in states.items() if s.failed_for_good)
    pool.ask(
        "kill",
        sorted(
            {
                p.host_index
                for p in arec.placement
                if (p.role, p.replica_id) in states and states[(p.role, p.replica_id)].state in (PENDING, RUNNING)
            }
        ),
        timeout=15.0,
        app_id=arec.app_id,
        reason=f"ended because {', '.join(failed)} failed",
    )
    return replica_states(pool, arec)
