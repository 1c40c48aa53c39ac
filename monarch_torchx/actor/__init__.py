"""Monarch's single-controller actor API on warm pools.

    from monarch_torchx import Actor, endpoint, attach, this_host

Same names and meanings as ``monarch.actor``: a Monarch user changes one import.
"""

from importlib import import_module
from typing import Any

# each public name and the submodule that defines it: loaded on first use, so that the agents'
# own part of meshes (``actor.host``, ``actor.placement``) does not import the whole runtime
_WHERE = {
    **dict.fromkeys(
        [
            "Actor",
            "ActorInstance",
            "Context",
            "concurrent_endpoint",
            "context",
            "current_actor_name",
            "current_rank",
            "current_size",
            "endpoint",
        ],
        "actor",
    ),
    **dict.fromkeys(["attach_to_workers", "run_worker_loop_forever"], "bootstrap"),
    **dict.fromkeys(["Channel", "Port", "PortReceiver"], "channel"),
    "get_or_spawn_controller": "controllers",
    **dict.fromkeys(["ActorError", "MeshFailure", "SupervisionError"], "errors"),
    "Future": "future",
    "unhandled_fault_hook": "supervision",
    **dict.fromkeys(
        [
            "Accumulator",
            "ActorMesh",
            "EndpointMesh",
            "HostMesh",
            "ProcMesh",
            "attach",
            "BootstrapCommand",
            "default_bootstrap_cmd",
            "hosts_from_config",
            "send",
            "shutdown_context",
            "this_host",
            "this_proc",
        ],
        "mesh",
    ),
    **dict.fromkeys(["Extent", "Point", "Shape", "ValueMesh"], "shape"),
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{where}", __name__), name)
    globals()[name] = value  # once: later lookups (and a user's assignment, as Monarch's hook) are plain
    return value


def load_all() -> None:
    """Imports the whole runtime now: a warm fork server does, so its procs start with all of it."""
    for name in _WHERE:
        __getattr__(name)


def __dir__() -> list:
    return sorted(set(globals()) | set(_WHERE))


__all__ = sorted(_WHERE)  # every public name, as Monarch's monarch.actor exports them
