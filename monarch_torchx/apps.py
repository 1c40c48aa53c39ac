"""Apps on a pool: launch replicas on hosts, ask how they are doing, kill them.

One mechanism for every front end: TorchX apps (``schedulers/base.py``) and submitit jobs
(``submitit_executor.py``) are both an ``AppRecord`` in the registry plus one ``LaunchSpec`` per
replica on its host's agent, so `torchx list`, `pool status` and the telemetry see all of them.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from .errors import AccessError, HostUnreachable, MonarchError
from .pool import Pool
from .registry import AppRecord, Placement, Registry
from .specs import CANCELLED, FAILED, PENDING, RUNNING, SUCCEEDED, UNKNOWN, LaunchSpec

_STATE_ORDER = [FAILED, CANCELLED, UNKNOWN, RUNNING, PENDING]


def app_state(states: List[str]) -> str:
    """TorchX semantics: any failure fails the app; it succeeds only when every replica did."""
    if states and all(s == SUCCEEDED for s in states):
        return SUCCEEDED
    for s in _STATE_ORDER:
        if s in states:
            return s
    return PENDING


def launch(pool: Pool, app_id: str, name: str, roles: List[Dict[str, Any]],
           replicas: List[Tuple[int, LaunchSpec]]) -> AppRecord:
    """Records the app, then starts each (host_index, spec) on its host; all or nothing."""
    hosts = pool.hosts
    placement = []
    for i, spec in replicas:
        host = hosts[i]
        if host is None:
            raise MonarchError(f"host {i} of pool {pool.name!r} has no agent")
        placement.append(Placement(spec.role, spec.replica_id, i, host.incarnation))
    arec = AppRecord(app_id, pool.name, name, roles, placement)
    Registry.save_app(pool.record, arec)
    by_host: Dict[int, List[LaunchSpec]] = {}
    for i, spec in replicas:
        by_host.setdefault(i, []).append(spec)

    calls = {i: [{"spec": spec.__dict__} for spec in specs] for i, specs in by_host.items()}
    errors = [(i, e) for i, _, e in pool.ask("launch", sorted(by_host), timeout=30.0, calls=calls) if e]
    if errors:
        kill(pool, arec)
        raise MonarchError(f"could not start {app_id} on pool {pool.name!r}: "
                           + "; ".join(f"host {i}: {e}" for i, e in errors))
    return arec


def replica_states(pool: Pool, arec: AppRecord) -> Dict[Tuple[str, int], Dict[str, Any]]:
    """(role, replica) -> the agent's status dict (state, msg, exit_code, attempts, ...) + hostname.

    A replica whose host is unreachable, or whose host was restarted since it launched, is
    FAILED with the reason (and the engine's, e.g. "allocation 12 is CANCELLED").
    """
    indices = sorted({p.host_index for p in arec.placement})
    answers = {i: (res, err) for i, res, err in pool.ask("describe", indices, timeout=10.0, app_id=arec.app_id)}
    # a host that did not answer is lost only on evidence (see Pool.loss_evidence); else UNKNOWN
    evidence = {i: pool.loss_evidence(i, err) for i, (_, err) in answers.items()
                if err is not None and not isinstance(err, AccessError)}
    out: Dict[Tuple[str, int], Dict[str, Any]] = {}
    for p in arec.placement:
        res, err = answers[p.host_index]
        host = pool.hosts[p.host_index] if p.host_index < len(pool.hosts) else None
        hostname = host.hostname if host else ""
        key = (p.role, p.replica_id)
        lost = evidence.get(p.host_index)
        if isinstance(err, AccessError):  # we cannot reach the hosts: that says nothing about the replica
            out[key] = {"state": UNKNOWN, "msg": str(err), "hostname": hostname}
        elif err is not None and not lost and isinstance(err, HostUnreachable):
            out[key] = {"state": UNKNOWN, "msg": str(err), "hostname": hostname}  # unreachable is not dead
        elif err is not None:
            out[key] = {"state": FAILED, "msg": pool.lost_message(p.host_index, lost, err) if lost else str(err),
                        "hostname": hostname}
        elif host is None or host.incarnation != p.incarnation:
            out[key] = {"state": FAILED, "hostname": hostname,
                        "msg": f"host {p.host_index} was lost and restarted while the replica ran"}
        else:
            st = next((s for s in res if s["role"] == p.role and s["replica_id"] == p.replica_id), None)
            out[key] = ({**st, "hostname": hostname} if st else
                        {"state": FAILED, "msg": f"replica not known to host {p.host_index}", "hostname": hostname})
    return out


def kill(pool: Pool, arec: AppRecord) -> None:
    indices = sorted({p.host_index for p in arec.placement})
    pool.ask("kill", indices, timeout=15.0, app_id=arec.app_id)


def list_states(pool: Pool) -> Dict[Tuple[str, str, int], str]:
    """(app_id, role, replica) -> state, for everything the pool's live agents know."""
    seen: Dict[Tuple[str, str, int], str] = {}
    for _, res, _ in pool.ask("list", range(pool.record.num_hosts), timeout=10.0):
        for st in res or []:
            seen[(st["app_id"], st["role"], st["replica_id"])] = st["state"]
    return seen
