"""Our stand-in for Monarch's test helper of that name: the test runs in a fresh Python process.

Monarch's helper isolates per-process singletons of its runtime; ours has the same need (a test
that exits its process, or sets a process-wide hook, must not take the rest of the run with it).
A fresh interpreter, not a fork: the parent holds threads and sockets a fork would share.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import pickle
import subprocess
import sys
import traceback

import cloudpickle
import pytest

_CHILD = r"""
import os, sys, pickle
sys.path[:0] = [os.getcwd()]
from isolate_in_subprocess import _run_child
_run_child(int(sys.argv[1]), int(sys.argv[2]))
"""


def _run_child(fn_fd: int, result_fd: int) -> None:
    import monarch_internal

    os.environ[monarch_internal.TEST_PID_ENV] = str(os.getpid())  # this process runs the test now
    with os.fdopen(fn_fd, "rb") as f:
        fn, args, kwargs = pickle.load(f)
    try:
        out = fn(*args, **kwargs)
        if inspect.iscoroutine(out):
            asyncio.run(out)
        result = ("ok", "")
    except pytest.skip.Exception as e:
        result = ("skip", str(e))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        if monarch_internal.used_inside_an_actor(e):
            result = ("skip", "Monarch-internal: used inside an actor")
        else:
            why = monarch_internal.reached_internals(e)
            result = ("internal" if why else "fail", why or "".join(traceback.format_exception(e)))
    with os.fdopen(result_fd, "wb") as f:
        pickle.dump(result, f)
    os._exit(0)


def isolate_in_subprocess(test_fn=None, *, env=None):
    if test_fn is None:
        return functools.partial(isolate_in_subprocess, env=env)

    @functools.wraps(test_fn)
    def wrapper(*args, **kwargs):
        fn_r, fn_w = os.pipe()
        res_r, res_w = os.pipe()
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(fn_r), str(res_w)],
            pass_fds=(fn_r, res_w),
            env={**os.environ, **(env or {})},
        )
        os.close(fn_r)
        os.close(res_w)
        try:
            with os.fdopen(fn_w, "wb") as f:
                f.write(cloudpickle.dumps((test_fn, args, kwargs)))
            with os.fdopen(res_r, "rb") as f:
                data = f.read()
            status = child.wait()
        finally:  # timed out (pytest-timeout interrupts the read) or failed: the child goes too
            if child.poll() is None:
                child.kill()
                child.wait()
        if not data:
            pytest.fail(f"the isolated test's process ended without a result (exit status {status})")
        kind, text = pickle.loads(data)
        if kind == "skip":
            pytest.skip(text)
        if kind == "internal":
            from monarch_internal import ReachedInternals

            raise ReachedInternals(text)
        if kind == "fail":
            pytest.fail(text, pytrace=False)

    wrapper.__signature__ = inspect.signature(test_fn)  # pytest still sees its fixtures
    if inspect.iscoroutinefunction(test_fn):  # pytest-asyncio must not run the wrapper itself
        wrapper.__wrapped__ = None
        del wrapper.__wrapped__
    return wrapper
