"""A host agent's operations as typed calls: what ``Pool`` and the actor mesh's ``HostMesh`` ask
an agent directly, over one connection (``net.Client``), with replies as named types.

The generic ``call(op, **args)`` stays for the rest (module operations, streams); an operation
whose reply a client reads field by field gets a method here, so a reply's shape is written once.
"""

from __future__ import annotations

from typing import Any

from .net import Client
from .specs import ReplicaStatus


class AgentClient(Client):
    """One authenticated connection to a host agent (see ``net.Client``), with typed replies."""

    def describe(self, app_id: str, hostname: str = "") -> list[ReplicaStatus]:
        """The replicas of ``app_id`` on this host (with ``hostname``, which the client knows)."""
        return [ReplicaStatus.from_wire(d, hostname=hostname) for d in self.call("describe", app_id=app_id)]

    def replicas(self) -> list[ReplicaStatus]:
        """Every replica this host knows of (the agent's ``list``)."""
        return [ReplicaStatus.from_wire(d) for d in self.call("list")]

    def kill(self, app_id: str, reason: str = "cancelled") -> Any:
        return self.call("kill", app_id=app_id, reason=reason)
