"""The names of ``monarch_torchx.net`` under their old module, ``monarch_torchx.wire``, for one
release: code outside this project that imported them keeps working. New code imports
``monarch_torchx.net`` (blocking side) or ``monarch_torchx.net.aio`` (asyncio side)."""

from __future__ import annotations

from typing import Any

from .net.blocking import *  # noqa: F403
from .net.frames import *  # noqa: F403
from .net.handshake import *  # noqa: F403


def __getattr__(name: str) -> Any:
    """The asyncio side (``Server``, ``Peer``, ``Stream``, ``read_frame``), imported on first use as
    before, so that importing this module does not import asyncio."""
    from .net import aio

    try:
        return getattr(aio, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
