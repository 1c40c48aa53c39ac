"""Our stand-in for Monarch's helper: a test runs over each RDMA backend this host has.

Monarch's version toggles its config knobs (``rdma_disable_ibverbs``); ours has no such knobs, so
the ibverbs case runs where ibverbs is available and is skipped otherwise, and the TCP case runs.
"""

from __future__ import annotations

import functools
import inspect

import pytest

from monarch_torchx.rdma import is_ibverbs_available

RDMA_BACKENDS = ["ibverbs", "tcp"]


def skip_if_ibverbs_unavailable() -> None:
    if not is_ibverbs_available():
        pytest.skip("ibverbs backend requested but no ibverbs device on this host")


def rdma_backends(fn):
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def run(*a, _rdma_backend, **kw):
            if _rdma_backend == "ibverbs":
                skip_if_ibverbs_unavailable()
            return await fn(*a, **kw)
    else:

        @functools.wraps(fn)
        def run(*a, _rdma_backend, **kw):
            if _rdma_backend == "ibverbs":
                skip_if_ibverbs_unavailable()
            return fn(*a, **kw)

    sig = inspect.signature(fn)
    run.__signature__ = sig.replace(
        parameters=[*sig.parameters.values(), inspect.Parameter("_rdma_backend", inspect.Parameter.KEYWORD_ONLY)]
    )
    return pytest.mark.parametrize("_rdma_backend", RDMA_BACKENDS)(run)
