"""Actors for benchmarks/actors.py (a module, so procs import them rather than unpickle them)."""

from monarch_torchx import Actor, endpoint


class Echo(Actor):
    @endpoint
    def ping(self, x=None):
        return x

    @endpoint
    def numel(self, t):
        return t.numel()


class AsyncEcho(Actor):
    """An actor with an async endpoint: it runs on a loop of its own (as Monarch runs actors)."""

    @endpoint
    async def ping(self, x=None):
        return x


class TorchEcho(Actor):
    def __init__(self):
        import torch  # noqa: F401  (already imported in a warm proc: that is the point)

    @endpoint
    def ping(self, x=None):
        return x
