"""An app on its way to a pool's hosts: what a client hands the pool's queue, and how a placement
turns it into one launch per replica.

The same ``SubmittedApp.launches`` serves an app that fits at once (the client places and launches
it) and one that waits (the pool's queue on host 0, ``agent/queue.py``, launches it when it fits),
so where a replica lands changes nothing else: its rank-0 host, its torchrun store and its
workspace path all follow the real placement.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .registry import Placement
from .resources import HostLoad, Resources
from .scheduling import AppAsk, ReplicaAsk, ReplicaKey
from .specs import LaunchSpec, known_fields
from .torchrun import PLAN_ENV

QUEUE_HOST = 0  # the host whose agent holds the pool's queue (see agent/queue.py)


@dataclass(frozen=True)
class WaitingApp:
    """An app in the pool's queue, as a module of host 0's agent sees it (``QueueBacklog``)."""

    app_id: str
    ask: AppAsk
    waited_s: float  # since it entered this agent's queue, on this agent's clock


@dataclass(frozen=True)
class QueueBacklog:
    """What waits in the pool's queue and the hosts it could go to: read by a module that grows
    the pool for it (``schedulers/slurm_allocator.py``)."""

    waiting: list[WaitingApp]  # in queue order: the first is the head
    loads: list[HostLoad]  # each host whose load the queue knows now
    hosts: int  # how many hosts the queue places on


@dataclass
class TorchrunRole:
    """A role run by warm torchrun: each node is told its rank and where the role's store is."""

    nnodes: int
    restarts: int = 0


@dataclass
class SubmittedApp:
    """An app ready to place: one spec per replica (``resources`` set), and what the launches
    take from the placement."""

    app_id: str
    name: str
    roles: list[dict[str, Any]]  # as the app's record keeps them (``role_record``)
    specs: list[LaunchSpec]
    torchrun: dict[str, TorchrunRole] = field(default_factory=dict)  # by role name
    rank0_env: str = ""  # set to the first replica's host in every replica's env (TorchX's rank0_env)
    path_token: str = ""  # stands for the workspace's path on a replica's host, in argv, env and cwd
    workspace_paths: dict[int, str] = field(default_factory=dict)  # host index -> that path
    # replicas k*N .. k*N+N-1 of a role share one host, its node k (submitit's tasks_per_node)
    tasks_per_node: int = 1
    hosts_env: str = ""  # set to the addresses of the app's nodes, in node order (submitit's hostnames)
    only_hosts: list[int] | None = None  # the hosts it may go to (those with min_time_left left), or None: any
    submitted: float = field(default_factory=time.time)

    def ask(self) -> AppAsk:
        """What placement sees: one ask per node (its replicas' asks together)."""
        nodes: dict[ReplicaKey, Resources] = {}
        for s in self.specs:
            key = (s.role, s.replica_id // self.tasks_per_node)
            nodes[key] = nodes.get(key, Resources()) + Resources.from_wire(s.resources)
        # a workspace was synced to the hosts there were when it was queued: it starts on those
        hosts = frozenset(self.workspace_paths) if self.path_token and self.workspace_paths else None
        if self.only_hosts is not None:
            hosts = frozenset(self.only_hosts) & hosts if hosts is not None else frozenset(self.only_hosts)
        return AppAsk(self.app_id, [ReplicaAsk(role, k, res) for (role, k), res in nodes.items()], hosts)

    def per_replica(self, placement: dict[ReplicaKey, int]) -> dict[ReplicaKey, int]:
        """Each replica's host, from a placement of the app's nodes."""
        return {(s.role, s.replica_id): placement[(s.role, s.replica_id // self.tasks_per_node)] for s in self.specs}

    def store_hosts(self, placement: dict[ReplicaKey, int]) -> dict[str, int]:
        """For each warm torchrun role, the host of its node 0 (where its store listens)."""
        return {role: placement[(role, 0)] for role in self.torchrun if (role, 0) in placement}

    def launches(
        self, placement: dict[ReplicaKey, int], addresses: dict[int, str], store_ports: dict[str, int]
    ) -> list[tuple[int, LaunchSpec]]:
        """(host, spec) for each replica, on copies: ``addresses``: each placed host's address
        (for the rank-0 variable and torchrun's store), ``store_ports``: a port reserved on each
        torchrun role's store host."""
        out = []
        hosts = self.per_replica(placement)
        first = self.specs[0] if self.specs else None
        rank0 = addresses.get(hosts[(first.role, first.replica_id)], "localhost") if first else "localhost"
        names = ",".join(addresses.get(h, "localhost") for _, h in sorted(placement.items()))
        for s in self.specs:
            host = hosts[(s.role, s.replica_id)]
            spec = dataclasses.replace(s, env=dict(s.env), argv=list(s.argv))
            if self.rank0_env:
                spec.env.setdefault(self.rank0_env, rank0)
            if self.hosts_env:
                spec.env[self.hosts_env] = names
            plan = self.torchrun.get(s.role)
            if plan is not None:
                store = placement[(s.role, 0)]
                spec.env[PLAN_ENV] = json.dumps(
                    {
                        "node_rank": s.replica_id,
                        "nnodes": plan.nnodes,
                        "store_host": addresses[store],
                        "store_port": store_ports[s.role],
                        "restarts": plan.restarts,
                    }
                )
            path = self.workspace_paths.get(host)
            if self.path_token and path is not None:
                spec.argv = [a.replace(self.path_token, path) for a in spec.argv]
                spec.env = {k: v.replace(self.path_token, path) for k, v in spec.env.items()}
                spec.cwd = None if spec.cwd is None else spec.cwd.replace(self.path_token, path)
            out.append((host, spec))
        return out

    def to_wire(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["specs"] = [dict(vars(s)) for s in self.specs]
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> SubmittedApp:
        d = dict(d)
        d["specs"] = [LaunchSpec(**s) for s in d["specs"]]
        d["torchrun"] = {k: TorchrunRole(**v) for k, v in d.get("torchrun", {}).items()}
        d["workspace_paths"] = {int(k): v for k, v in d.get("workspace_paths", {}).items()}
        return cls(**d)


class QueueState(str, Enum):
    QUEUED = "QUEUED"  # waits for capacity
    STARTED = "STARTED"  # launched: ``placement`` says where
    ENDED = "ENDED"  # left the queue without starting (cancelled, failed to launch): ``reason``
    UNKNOWN = "UNKNOWN"  # the queue has no such app (its holder lost it: see ``reason``)
    UNREACHABLE = "UNREACHABLE"  # (a client's own finding) the queue's host did not answer: asked again later


@dataclass
class QueueEntry:
    """What the pool's queue says of one app (``queue.submit``, ``queue.status``)."""

    app_id: str
    state: QueueState
    reason: str = ""  # QUEUED: what it waits for; ENDED: why it left the queue
    placement: list[Placement] = field(default_factory=list)
    cancelled: bool = False  # ENDED by a cancel or a stopped pool (else it failed to launch)
    retry_specs: list[dict[str, Any]] = field(default_factory=list)  # STARTED: see AppRecord.retry_specs

    def to_wire(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["state"] = self.state.value
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> QueueEntry:
        d = known_fields(cls, d)
        d["state"] = QueueState(d["state"])
        d["placement"] = [Placement.from_wire(p) for p in d.get("placement", [])]
        return cls(**d)
