"""The asyncio acceptor's old module name, for one release: it is ``monarch_torchx.net.aio`` now."""

from __future__ import annotations

from .net.aio import AuthenticatedConnection, ServerConnection, serve, write_frame

__all__ = ["AuthenticatedConnection", "ServerConnection", "serve", "write_frame"]
