"""What a controller does with a supervision event nobody handled: ``unhandled_fault_hook``.

As in Monarch: an actor of a mesh the controller spawned failed (an endpoint called by
``broadcast`` raised, with no caller to tell), and no owner's ``__supervise__`` took it. The
default logs the report and ends the controller with exit code 1; assign
``monarch_torchx.actor.unhandled_fault_hook`` to do something else (it is looked up there each
time). The hook runs on the thread that reads the mesh's connections: the one waiting on a
Future; what it raises comes out of that ``get()``.
"""

from __future__ import annotations

import sys

from .errors import MeshFailure


def unhandled_fault_hook(failure: MeshFailure) -> None:
    print(f"monarch-torchx: unhandled supervision event: {failure.report()}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def dispatch(failure: MeshFailure) -> None:
    """Calls the hook the user installed (or the default)."""
    pkg = sys.modules.get("monarch_torchx.actor")
    hook = getattr(pkg, "unhandled_fault_hook", unhandled_fault_hook) if pkg is not None else unhandled_fault_hook
    hook(failure)
