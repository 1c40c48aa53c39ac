"""monarch-torchx: warm pools of hosts for TorchX, submitit and actor meshes.

Kept import-light on purpose: the torchx CLI imports our plugins on every invocation, so the
actor API (``from monarch_torchx import Actor, endpoint, attach, this_host``) loads on first use.
"""

from typing import Any, List  # noqa: F401

__version__ = "0.1.0"

# Monarch's public actor names, as ``monarch.actor`` exports them: the same list as
# ``monarch_torchx.actor.__all__`` (a test holds them equal). Spelled out here rather than read
# from there, so that asking this package for anything else (``from monarch_torchx import pool``
# asks __getattr__ first) never imports the actor package: a role's clean interpreter has none.
_ACTOR_NAMES = frozenset(
    {
        "Accumulator",
        "Actor",
        "BootstrapCommand",
        "ActorError",
        "ActorInstance",
        "ActorMesh",
        "Channel",
        "Context",
        "EndpointMesh",
        "Extent",
        "Future",
        "HostMesh",
        "MeshFailure",
        "Point",
        "Port",
        "PortReceiver",
        "ProcMesh",
        "Shape",
        "SupervisionError",
        "ValueMesh",
        "attach",
        "attach_to_workers",
        "concurrent_endpoint",
        "context",
        "current_actor_name",
        "current_rank",
        "current_size",
        "default_bootstrap_cmd",
        "endpoint",
        "get_or_spawn_controller",
        "hosts_from_config",
        "run_worker_loop_forever",
        "send",
        "shutdown_context",
        "this_host",
        "this_proc",
        "unhandled_fault_hook",
    }
)


def __getattr__(name: str) -> Any:
    if name in _ACTOR_NAMES:
        from . import actor  # (safe: "actor" is not one of the names, so this does not recurse)

        return getattr(actor, name)
    raise AttributeError(f"module 'monarch_torchx' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _ACTOR_NAMES)
