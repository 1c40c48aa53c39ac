"""The seam between a host agent and the modules loaded into it (group ``monarch_torchx.modules``).

A module's ``setup(agent)`` gets an ``AgentHost``: what a module may use of its agent, and no
more. It plugs itself in with ``agent.install(module)``, where ``module`` is an ``AgentModule``:
its operations, background tasks, warm imports and cleanup. Both sides are written against this
file only, so a module (the actor mesh, syncfs, telemetry) never imports the agent's code and
the agent never imports a module's.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Callable, Coroutine, Mapping, Protocol

from .credentials import PoolCredentials
from .specs import LaunchSpec

Handler = Callable[..., Any]  # async (peer, **args) -> value, or a net.aio.Stream
Combine = Callable[[dict, list[Any]], Any]  # (the request's args, answered values) -> one value
Operation = tuple[Handler, "Combine | None"]
ReplicaKey = tuple[str, str, int]  # (app id, role, replica id)


class ReplicaTable(Protocol):
    """The agent's replicas, as a module may use them: read them, start one, end some."""

    @property
    def replicas(self) -> Mapping[ReplicaKey, Any]: ...

    @property
    def gpus_here(self) -> int:
        """How many GPUs this host hands out (0: none, or none detected nor declared)."""
        ...

    async def launch(self, spec: LaunchSpec) -> dict: ...

    def select(self, app_id: str | None, role: str | None = None, replica_id: int | None = None) -> list[Any]: ...

    async def kill(
        self, reps: list[Any], grace: float = 5.0, reason: str = "cancelled", record: bool = True
    ) -> int: ...


class AgentHost(Protocol):
    """What a module may use of the agent it is loaded into."""

    @property
    def index(self) -> int: ...

    @property
    def pool(self) -> str: ...

    @property
    def incarnation(self) -> str: ...

    @property
    def successor(self) -> bool: ...  # started to take its host over from an ending allocation

    @property
    def started(self) -> float: ...

    @property
    def state_dir(self) -> Path: ...

    @property
    def creds(self) -> PoolCredentials: ...

    @property
    def key(self) -> bytes: ...

    @property
    def stop_reason(self) -> str: ...

    @property
    def stopping(self) -> asyncio.Event: ...

    @property
    def tcp_bind(self) -> str: ...

    @property
    def tcp_advertise(self) -> str: ...

    @property
    def procs(self) -> ReplicaTable: ...

    def install(self, module: AgentModule) -> None: ...

    def gpu_samples(self) -> list[dict[str, Any]]:
        """This host's GPU samples (the ``gpus`` table's rows; none without NVML)."""
        ...

    def add_handler(self, op: str, fn: Handler, combine: Combine | None = None) -> None: ...

    def queue_backlog(self) -> Any:
        """What waits in the pool's queue (an ``app_queue.QueueBacklog``: a type of a layer above
        this file's); only host 0's agent holds the queue."""
        ...


class AgentModule(Protocol):
    """What a module plugs into an agent, in one typed seam.

    ``operations``: op name -> (handler, combine). A handler is ``async (peer, **args)`` and is
    served on the agent's authenticated port; ``combine`` (or None) merges a relay subtree's
    answers into one. ``background_tasks``: coroutines that run as long as the agent.
    ``warm_imports``: modules the agent's warm fork servers import after the pool's preloads, so
    the processes this module starts there begin warm ("pkg.mod" or "pkg.mod:function", the
    function called once imported). ``stop``: runs once when the agent stops, after its
    processes were stopped.
    """

    def operations(self) -> dict[str, Operation]: ...

    def background_tasks(self) -> list[Coroutine[Any, Any, None]]: ...

    def warm_imports(self) -> list[str]: ...

    def stop(self) -> None: ...
