"""syncfs: sync code and environments to every host of a pool, served read-only.

``sync(pool, src, target)`` (or ``monarch-torchx sync SRC --pool P --to T``) sends each host
only the content-addressed chunks it lacks and commits an immutable generation that the target
path switches to atomically. See docs/syncfs.md.
"""

from .client import HostResult, SyncReport, sync

__all__ = ["sync", "SyncReport", "HostResult"]
