"""monarch-torchx: warm pools of hosts for TorchX, submitit and actor meshes.

Kept import-light on purpose: the torchx CLI imports our plugins on every invocation, so the
actor API (``from monarch_torchx import Actor, endpoint, attach, this_host``) loads on first use.
"""

from typing import Any

__version__ = "0.1.0"

_ACTOR_NAMES = frozenset({
    "Accumulator", "Actor", "ActorError", "ActorInstance", "ActorMesh", "Channel", "Context", "EndpointMesh",
    "Extent", "Future", "HostMesh", "MeshFailure", "Point", "Port", "PortReceiver", "ProcMesh", "Shape",
    "SupervisionError", "ValueMesh", "attach", "concurrent_endpoint", "context", "current_actor_name", "current_rank", "current_size", "endpoint", "get_or_spawn_controller", "send", "shutdown_context", "this_host", "this_proc", "unhandled_fault_hook",
})


def __getattr__(name: str) -> Any:
    if name in _ACTOR_NAMES:
        from . import actor

        return getattr(actor, name)
    raise AttributeError(f"module 'monarch_torchx' has no attribute {name!r}")
