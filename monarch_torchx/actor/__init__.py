"""Monarch's single-controller actor API on warm pools.

    from monarch_torchx import Actor, endpoint, attach, this_host

Same names and meanings as ``monarch.actor``: a Monarch user changes one import.
"""

from .actor import Actor, ActorInstance, Context, concurrent_endpoint, context, current_actor_name, current_rank, current_size, endpoint
from .bootstrap import attach_to_workers, run_worker_loop_forever
from .channel import Channel, Port, PortReceiver
from .controllers import get_or_spawn_controller
from .errors import ActorError, MeshFailure, SupervisionError
from .future import Future
from .supervision import unhandled_fault_hook
from .mesh import (Accumulator, ActorMesh, EndpointMesh, HostMesh, ProcMesh, attach, send, shutdown_context, this_host,
                   this_proc)
from .shape import Extent, Point, Shape, ValueMesh

__all__ = [
    "Accumulator", "Actor", "ActorError", "ActorInstance", "ActorMesh", "Channel", "Context", "EndpointMesh",
    "Extent", "Future", "HostMesh", "MeshFailure", "Point", "Port", "PortReceiver", "ProcMesh", "Shape",
    "SupervisionError", "ValueMesh", "attach", "attach_to_workers", "concurrent_endpoint", "context", "current_actor_name", "current_rank", "current_size", "endpoint", "get_or_spawn_controller", "run_worker_loop_forever", "send", "shutdown_context", "this_host", "this_proc", "unhandled_fault_hook",
]
