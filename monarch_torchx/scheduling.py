"""Which hosts an app's replicas go to, and which queued apps start now: pure functions.

The client calls ``place`` on the loads its hosts reported, for an app that may start at once;
the pool's queue (``agent/queue.py``, on host 0) calls ``schedule`` for the apps that wait. Both
read the same ``HostLoad``s, so an app is placed by one rule wherever it is placed:

- a role of one replica goes to the least-loaded host it fits on (GPUs held, then CPUs, then
  how many replicas the host runs, then the lowest index);
- a role of several replicas (torchrun's nodes, a multi-node submitit job) is a gang: each
  replica on its own host, all placed or none;
- the whole app is placed or none of it.

Queue order is first come, first served, with backfill: a later app may start while an earlier
one waits, but only on what the first waiting app (the head) does not need. The head reserves
the hosts it will run on, and what is free there counts as its own.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from .resources import HostLoad, NeverFits, Resources

ReplicaKey = tuple[str, int]  # (role, replica id)


@dataclass(frozen=True)
class ReplicaAsk:
    role: str
    replica_id: int
    resources: Resources


@dataclass
class AppAsk:
    """An app as placement sees it: what each replica asks. Replicas of one role that has more
    than one go to distinct hosts."""

    app_id: str
    replicas: list[ReplicaAsk]
    # the only hosts it may go to (its workspace was synced to these), or None: any
    hosts: frozenset[int] | None = None

    @functools.cached_property
    def shape(self) -> str:
        """What it asks, as one key (a string: its hash is kept): apps alike in it fit alike, so a
        pass over a queue of 1,000 alike tasks tries one placement (``schedule``)."""
        return repr((tuple((r.role, r.resources) for r in self.replicas), sorted(self.hosts or ())))

    def roles(self) -> dict[str, list[ReplicaAsk]]:
        out: dict[str, list[ReplicaAsk]] = {}
        for r in self.replicas:
            out.setdefault(r.role, []).append(r)
        return out

    def need(self) -> str:
        """What the app waits for, in words: "4 GPUs, 2 CPUs on 2 hosts" (its largest role)."""
        parts = []
        for role, reps in self.roles().items():
            total = Resources()
            for r in reps:
                total = total + r.resources
            where = f" on {len(reps)} hosts" if len(reps) > 1 else ""
            named = f"{role}: " if len(self.roles()) > 1 else ""
            parts.append(f"{named}{total.describe()}{where}")
        return "; ".join(parts)


class _View:
    """Free resources per host while a pass places apps one after another."""

    def __init__(self, loads: list[HostLoad], empty: bool = False):
        self.capacity = {load.index: load.capacity.total for load in loads}
        self.free = {load.index: (load.capacity.total if empty else load.free) for load in loads}
        self.count = {load.index: (0 if empty else len(load.holdings)) for load in loads}

    def take(self, host: int, ask: Resources) -> None:
        self.free[host] = self.free[host] - ask
        self.count[host] += 1

    def load_key(self, host: int) -> tuple[float, float, int, int]:
        cap, free = self.capacity[host], self.free[host]
        gpu_used = 1 - free.gpus / cap.gpus if cap.gpus else 0.0
        cpu_used = 1 - free.cpus / cap.cpus if cap.cpus else 0.0
        return (round(gpu_used, 6), round(cpu_used, 6), self.count[host], host)


def place(app: AppAsk, loads: list[HostLoad]) -> dict[ReplicaKey, int] | None:
    """The host of each replica if the whole app fits now, else None."""
    return _place(app, _View(loads))


def _place(app: AppAsk, view: _View) -> dict[ReplicaKey, int] | None:
    trial = _View.__new__(_View)
    trial.capacity, trial.free, trial.count = view.capacity, dict(view.free), dict(view.count)
    out: dict[ReplicaKey, int] = {}
    for reps in app.roles().values():
        used: set[int] = set()
        for r in reps:
            fits = [
                h
                for h in trial.free
                if (len(reps) == 1 or h not in used)
                and (app.hosts is None or h in app.hosts)
                and r.resources.within(trial.capacity[h]).fits_in(trial.free[h])
            ]
            if not fits:
                return None
            host = min(fits, key=trial.load_key)
            used.add(host)
            trial.take(host, r.resources.within(trial.capacity[host]))
            out[(r.role, r.replica_id)] = host
    view.free, view.count = trial.free, trial.count
    return out


def check_fits_somewhere(app: AppAsk, loads: list[HostLoad], pool: str) -> None:
    """Raises ``NeverFits`` (one line naming the biggest host) when the app could not run even
    on an empty pool: a replica asks more than any host has, or a role more hosts than fit it."""
    if not loads:
        return
    for role, reps in app.roles().items():
        for r in reps:
            if any(r.resources.within(h.capacity.total).fits_in(h.capacity.total) for h in loads):
                continue
            for kind in ("gpus", "mem_mb"):  # (CPUs never: more than a host has is the whole host's)
                biggest = _biggest(loads, kind)
                have = _amount(biggest.capacity.total, kind)
                if _amount(r.resources, kind) > have:
                    raise NeverFits(
                        f"{role}/{r.replica_id} asks {r.resources.describe()}, more than any host of pool "
                        f"{pool!r} has: the biggest, host {biggest.index}, has {_say(kind, have)}"
                    )
            raise NeverFits(
                f"{role}/{r.replica_id} asks {r.resources.describe()}: no host of pool {pool!r} has all of it"
            )
        if len(reps) > 1:
            fit = [load for load in loads if reps[0].resources.within(load.capacity.total).fits_in(load.capacity.total)]
            if len(fit) < len(reps):
                raise NeverFits(
                    f"role {role} asks {reps[0].resources.describe()} on each of {len(reps)} distinct hosts, "
                    f"but only {len(fit)} host(s) of pool {pool!r} have that much"
                )


def with_empty_hosts(loads: list[HostLoad], total: int) -> list[HostLoad]:
    """``loads`` and, up to ``total`` hosts, empty ones like the first (a pool that may grow: the
    hosts a further allocation of the same partition would bring)."""
    if not loads or total <= len(loads):
        return list(loads)
    like = min(loads, key=lambda h: h.index)
    top = max(h.index for h in loads)
    return [*loads, *(HostLoad(top + 1 + k, like.capacity) for k in range(total - len(loads)))]


def hosts_to_add(app: AppAsk, loads: list[HostLoad], most: int) -> int | None:
    """The fewest empty hosts (like the first of ``loads``), at most ``most``, that let ``app``
    start beside what runs now; None when even ``most`` would not (or it may go only to hosts
    there are now: a workspace synced to them)."""
    if app.hosts is not None:
        return None
    for extra in range(1, most + 1):
        if place(app, with_empty_hosts(loads, len(loads) + extra)) is not None:
            return extra
    return None


def _biggest(loads: list[HostLoad], kind: str) -> HostLoad:
    return max(loads, key=lambda h: _amount(h.capacity.total, kind))


def _amount(r: Resources, kind: str) -> float:
    return float(getattr(r, kind))


def _say(kind: str, amount: float) -> str:
    return {"gpus": f"{amount:g} GPU(s)", "cpus": f"{amount:g} CPU(s)", "mem_mb": f"{amount:g} MB of memory"}[kind]


@dataclass
class Schedule:
    """One pass over the queue: the apps that start now (with their hosts) and why each other
    one waits."""

    start: list[tuple[str, dict[ReplicaKey, int]]] = field(default_factory=list)
    waiting: dict[str, str] = field(default_factory=dict)


def schedule(queue: list[AppAsk], loads: list[HostLoad]) -> Schedule:
    """First come, first served with backfill (see the module's docstring)."""
    view = _View(loads)
    out = Schedule()
    head = False
    # what is free only shrinks during a pass: an ask like one that did not fit does not fit either
    # (a map_array of 1,000 alike tasks is one placement tried, not 1,000)
    failed: dict[str, str] = {}
    for pos, app in enumerate(queue, 1):
        shape = app.shape
        placed = None if shape in failed else _place(app, view)
        if placed is not None:
            out.start.append((app.app_id, placed))
            continue
        need = failed.get(shape) or app.need()
        out.waiting[app.app_id] = f"waits for {need}; {_ordinal(pos - len(out.start))} in queue"
        failed[shape] = need
        if not head:  # (the first that does not fit: nothing failed before it)
            head = True
            # the head's hosts: where it would go on the pool as it is when empty; what is free
            # there is its own from now on (it may go below zero: nothing else fits there)
            future = _place(app, _View(loads, empty=True))
            if future is not None:
                asks = {(r.role, r.replica_id): r.resources for r in app.replicas}
                for key, host in future.items():
                    view.take(host, asks[key].within(view.capacity[host]))
    return out


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
