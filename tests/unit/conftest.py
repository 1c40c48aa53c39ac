"""Unit tests: no pool, agent, proc or subprocess. What they stand in for is an OS edge only: a
socketpair or a connected loopback pair, a temporary directory, an asyncio loop on a thread of this
process. Each test takes well under half a second and never sleeps; it waits on events."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from monarch_torchx.credentials import PoolCredentials
from monarch_torchx.net import aio


@pytest.fixture
def creds() -> PoolCredentials:
    """A loopback pool's credentials: a fresh secret, plaintext frames."""
    return PoolCredentials(os.urandom(32))


@pytest.fixture
def tcp_pair() -> Iterator[Callable[[], tuple[socket.socket, socket.socket]]]:
    """Makes connected loopback TCP pairs (client end, server end), closed at the end of the test.
    (The acceptor's side sets TCP options a socketpair does not have.)"""
    made: list[socket.socket] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def make() -> tuple[socket.socket, socket.socket]:
            client = socket.create_connection(listener.getsockname())
            server, _ = listener.accept()
            made.extend((client, server))
            return client, server

        yield make
    for s in made:
        s.close()


class LoopThread:
    """An asyncio loop run by a thread of this process: in-process servers for the blocking side."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="unit-test-loop", daemon=True)
        self.thread.start()
        self.servers: list[aio.Server] = []

    def run(self, coro: Any, timeout: float = 5.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def serve(self, creds: PoolCredentials, handlers: dict[str, Any], identity: bytes = b"", **kw: Any) -> int:
        """Starts an ``aio.Server`` with ``handlers`` on 127.0.0.1; returns its port."""
        server = aio.Server(creds, handlers, identity=identity, **kw)
        self.servers.append(server)
        return self.run(server.start("127.0.0.1", 0))

    def close(self) -> None:
        async def stop() -> None:
            for server in self.servers:
                await server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()
