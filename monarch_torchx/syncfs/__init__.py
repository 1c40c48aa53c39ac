"""syncfs: sync code and environments to every host of a pool, served read-only.

``sync(pool, src, target)`` (or ``monarch-torchx sync SRC --pool P --to T``) sends each host
only the content-addressed chunks it lacks and commits an immutable generation that the target
path switches to atomically. See docs/syncfs.md.
"""

from typing import Any

__all__ = ["sync", "SyncReport", "HostResult"]


def __getattr__(name: str) -> Any:
    """The client is imported on first use: a host's FUSE server imports this package for its
    store and manifest only, and it starts once per target on every host."""
    if name in __all__:
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
