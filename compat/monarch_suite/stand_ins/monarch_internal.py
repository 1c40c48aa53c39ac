"""What a rewritten test gets for a name only Monarch's runtime has.

Using it in any way (calling it, reading an attribute, entering it, an ``isinstance``) skips the
running test as Monarch-internal: the suite's count then says which tests ran against our public
API and which could not be run at all.

A test can also reach Monarch's internals through an object it got from the public API (a private
attribute such as ``ProcMesh._proc_mesh``), or touch a stand-in only to patch it and then fail on
what the patch expected. ``reached_internals`` names those, by the failure's type and the names the
test touched, so the report counts them apart from real failures.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

TEST_PID_ENV = "MONARCH_SUITE_TEST_PID"  # the process that runs the tests (procs inherit it, with another pid)
touched: list[str] = []  # stand-ins the running test used without being skipped (reset per test)


def in_test_process() -> bool:
    """The test's own code is running (not an actor's: actors of the controller's own proc run in
    the test process too, and a skip raised in an endpoint would fail the actor instead)."""
    if os.environ.get(TEST_PID_ENV) != str(os.getpid()):
        return False
    from monarch_torchx.actor.actor import current_context

    return current_context.get().actor_instance.actor_id == "client"


class MonarchInternal(RuntimeError):
    """A stand-in used inside an actor's proc, where the test cannot be skipped: its caller gets
    an ActorError whose ``exception_type`` says this."""


class MonarchPrivate(AttributeError):
    """A test's code, inside an actor, asked one of our objects for a private name of Monarch's
    class of that name (``this_host()._new_with_shape``): its caller gets an ActorError whose
    ``exception_type`` says this, and the test is counted as having reached Monarch's internals."""


def used_inside_an_actor(exc: BaseException) -> bool:
    from monarch_torchx.actor import ActorError

    return isinstance(exc, ActorError) and exc.exception_type == MonarchInternal.__name__


def reached_internals(exc: BaseException) -> str | None:
    """Why a failure is Monarch-internal, or None: an AttributeError for a private attribute of one
    of our objects or classes, or any failure after the test touched a stand-in."""
    if isinstance(exc, ReachedInternals):
        return str(exc)
    from monarch_torchx.actor import ActorError

    if isinstance(exc, ActorError) and exc.exception_type == MonarchPrivate.__name__:
        return "a private attribute of Monarch's, asked for inside an actor"
    if (
        isinstance(exc, AttributeError)
        and isinstance(exc.name, str)
        and exc.name.startswith("_")
        and _raised_in_a_test_file(exc)
    ):  # not one of our own bugs: the test asked for it
        owner = exc.obj if isinstance(exc.obj, type) else type(exc.obj)
        if getattr(owner, "__module__", "").startswith("monarch_torchx"):
            return f"{owner.__name__}.{exc.name}"
    if touched:
        return f"touched {touched[0]}"
    return None


def _raised_in_a_test_file(exc: BaseException) -> bool:
    """The attribute was asked for by the test's own code, not by ours: no frame of
    monarch_torchx is in the traceback but one of our ``__getattr__``s refusing the name (the
    test's helpers and context managers it passed through may be)."""
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if f"{os.sep}monarch_torchx{os.sep}" in code.co_filename and code.co_name not in (
            "__getattr__",
            "__getattribute__",
        ):
            return False
        tb = tb.tb_next
    return True


class ReachedInternals(AssertionError):
    """Raised in the test process for a failure an isolated child classified as reaching internals."""


class Internal:
    def __init__(self, name: str) -> None:
        self._name = name

    def _skip(self, *_a, **_k):
        if not in_test_process():  # in an actor's proc: an error its caller sees
            raise MonarchInternal(f"Monarch-internal: {self._name}")
        pytest.skip(f"Monarch-internal: {self._name}")

    __call__ = __enter__ = __iter__ = __instancecheck__ = __subclasscheck__ = __setitem__ = __delitem__ = _skip

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        touched.append(f"{self._name}.{attr}")
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


class MissingPublicName(NotImplementedError):
    """A test used a name Monarch exports publicly and ours lacks: a failure of ours, counted so."""


class Missing:
    """What a rewritten test gets for a name Monarch exports publicly and ours lacks: any use of it
    (a call, an attribute, an ``isinstance``, a base class) fails the test, here or in an actor."""

    def __init__(self, name: str) -> None:
        self._name = name

    def _fail(self, *_a, **_k):
        raise MissingPublicName(f"monarch_torchx lacks Monarch's public {self._name}")

    __call__ = __enter__ = __iter__ = __instancecheck__ = __subclasscheck__ = __getitem__ = _fail
    __setitem__ = __delitem__ = __or__ = __ror__ = _fail

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        self._fail()

    def __mro_entries__(self, _bases):
        self._fail()

    def __repr__(self) -> str:
        return f"<missing public {self._name}>"


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


# ------------------------------------------------------------ Monarch's private names on our classes

PRIVATE_FILE = Path(__file__).with_name("monarch_private.json")  # written by run.py from the checkout


def _asked_by_a_test(frame) -> bool:
    return frame is not None and os.path.basename(frame.f_code.co_filename).startswith(("test_", "example_"))


def guard_private_names() -> None:
    """Each of our classes that Monarch also exports answers a private name that Monarch's class
    has and ours lacks, when a test's own code asks for it, as reaching Monarch's internals: in
    the test process an AttributeError as before (``reached_internals`` counts it), inside an
    actor a ``MonarchPrivate`` (whose ActorError the test process counts the same). A test class
    that subclasses ours and overrides such a name (``ProcessJob._create``) marks the test as
    having touched Monarch's internals when it makes one."""
    if not PRIVATE_FILE.exists():
        return
    import importlib

    for cls_name, names in json.loads(PRIVATE_FILE.read_text()).items():
        for module in ("monarch_torchx.actor", "monarch_torchx.job", "monarch_torchx.rdma"):
            cls = getattr(importlib.import_module(module), cls_name, None)
            if isinstance(cls, type) and cls.__module__.startswith("monarch_torchx"):
                missing = frozenset(n for n in names if not hasattr(cls, n))
                if missing and "_monarch_suite_guard" not in cls.__dict__:
                    _guard(cls, missing)
                break


def _guard(cls: type, names: frozenset) -> None:
    prior_getattr = cls.__dict__.get("__getattr__")
    prior_subclass = cls.__dict__.get("__init_subclass__")

    def __getattr__(self, name):
        if name in names and not in_test_process() and _asked_by_a_test(sys._getframe(1)):
            raise MonarchPrivate(f"Monarch-internal: {type(self).__name__}.{name} (a private name of Monarch's)")
        if prior_getattr is not None:
            return prior_getattr(self, name)
        parent = getattr(super(cls, self), "__getattr__", None)  # a base's (never this instance's own)
        if parent is not None:
            return parent(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self)

    def __init_subclass__(sub, **kw):
        if prior_subclass is not None:
            prior_subclass.__func__(sub, **kw)
        else:
            super(cls, sub).__init_subclass__(**kw)
        overridden = sorted(n for n in vars(sub) if n in names)
        if overridden and (sub.__module__.startswith(("test_", "example_")) or sub.__module__ == "__main__"):
            init = sub.__init__

            def __init__(self, *a, **k):
                touched.append(f"{cls.__name__}.{overridden[0]} (overridden by the test)")
                init(self, *a, **k)

            sub.__init__ = __init__

    cls._monarch_suite_guard = True
    cls.__getattr__ = __getattr__
    cls.__init_subclass__ = classmethod(__init_subclass__)


guard_private_names()
