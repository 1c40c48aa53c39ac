"""Actors for benchmarks/actors.py (a module, so procs import them rather than unpickle them)."""

from monarch_torchx import Actor, endpoint


class Echo(Actor):
    @endpoint
    def ping(self, x=None):
        return x

    @endpoint
    def numel(self, t):
        return t.numel()


class TorchEcho(Actor):
    def __init__(self):
        import torch  # noqa: F401  (already imported in a warm proc: that is the point)

    @endpoint
    def ping(self, x=None):
        return x
