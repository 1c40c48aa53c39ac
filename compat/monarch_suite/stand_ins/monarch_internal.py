"""What a rewritten test gets for a name only Monarch's runtime has.

Using it in any way (calling it, reading an attribute, entering it, an ``isinstance``) skips the
running test as Monarch-internal: the suite's count then says which tests ran against our public
API and which could not be run at all.
"""
from __future__ import annotations

import os

import pytest


class Internal:
    def __init__(self, name: str) -> None:
        self._name = name

    def _skip(self, *_a, **_k):
        if "PYTEST_CURRENT_TEST" not in os.environ:  # in an actor's proc: an error its caller sees
            raise RuntimeError(f"Monarch-internal: {self._name}")
        pytest.skip(f"Monarch-internal: {self._name}")

    __call__ = __enter__ = __iter__ = __instancecheck__ = __subclasscheck__ = _skip

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Internal(f"{self._name}.{attr}")

    def __getitem__(self, _key):  # `Shared[int]` in an annotation: still the same name
        return self

    def __or__(self, _other):
        return self

    __ror__ = __or__

    def __mro_entries__(self, _bases):  # `class Foo(PythonMessage)`: a class that skips when used
        name = self._name

        class _Base:
            def __init__(self, *_a, **_k):
                Internal(name)._skip()
        return (_Base,)

    def __repr__(self) -> str:
        return f"<Monarch-internal {self._name}>"


_OURS = {"actor": "monarch_torchx.actor", "job": "monarch_torchx.job", "rdma": "monarch_torchx.rdma"}


class _Package:
    """`monarch` after `import monarch.actor`: its public parts are ours, the rest internal."""

    def __getattr__(self, attr: str):
        import importlib

        if attr in _OURS:
            return importlib.import_module(_OURS[attr])
        return Internal(f"monarch.{attr}")

    def __setattr__(self, attr: str, value) -> None:
        raise AttributeError(f"monarch.{attr} cannot be set here")


def package() -> _Package:
    return _Package()
