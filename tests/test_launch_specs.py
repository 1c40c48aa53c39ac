"""LaunchSpec features used by submitit, tested at the agent through the apps API."""

from __future__ import annotations

import pytest

from monarch_torchx import apps
from monarch_torchx.pool import attach
from monarch_torchx.specs import LaunchSpec

from .conftest import torchx, wait_for

pytestmark = pytest.mark.integration

IGNORE_USR2 = (
    "import signal, sys, time; signal.signal(signal.SIGUSR2, lambda *a: print('got USR2', flush=True)); "
    "print('out line', flush=True); print('err line', file=sys.stderr, flush=True); time.sleep(600)"
)


def _state(pool, arec):
    return apps.replica_states(pool, arec)[("r", 0)]


def test_timeout_signals_first_then_kills_and_output_is_teed(home, pool_name, tmp_path):
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=1,preload=none")
    pool = attach(pool_name)
    spec = LaunchSpec(
        app_id="timeout-1",
        role="r",
        replica_id=0,
        argv=["python", "-c", IGNORE_USR2],
        stdout_path=str(tmp_path / "out.txt"),
        stderr_path=str(tmp_path / "err.txt"),
        timeout_s=1.5,
        signal_delay_s=1.0,
    )
    arec = apps.launch(pool, "timeout-1", "t", [], [(0, spec)])
    st = wait_for(lambda: (s := _state(pool, arec)).state == "FAILED" and s, timeout=20, what="timeout")
    assert st.msg.startswith("timed out after")
    assert (tmp_path / "out.txt").read_text() == "out line\ngot USR2\n"
    assert (tmp_path / "err.txt").read_text() == "err line\n"


def test_requeue_code_restarts_without_spending_retries(home, pool_name, tmp_path):
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=1,preload=none")
    pool = attach(pool_name)
    counter = tmp_path / "n"
    code = (
        f"import pathlib, sys; p = pathlib.Path({str(counter)!r}); n = int(p.read_text()) if p.exists() else 0; "
        "p.write_text(str(n + 1)); sys.exit(144 if n < 2 else 0)"
    )
    spec = LaunchSpec(app_id="rq-1", role="r", replica_id=0, argv=["python", "-c", code], requeue_code=144)
    arec = apps.launch(pool, "rq-1", "t", [], [(0, spec)])
    st = wait_for(lambda: (s := _state(pool, arec)).state == "SUCCEEDED" and s, timeout=20, what="requeues")
    assert st.attempts == 3 and counter.read_text() == "3"


def test_many_concurrent_launches_on_one_host(home, pool_name):
    """Requests from several clients at once share the agent's channel to its fork server."""
    from concurrent.futures import ThreadPoolExecutor

    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=1,preload=none")
    pool = attach(pool_name)
    big_env = {f"VAR{i}": "x" * 200 for i in range(300)}  # ~70 KB of env per request

    def one(i):
        spec = LaunchSpec(app_id=f"many-{i}", role="r", replica_id=0, argv=["echo", str(i)], env=big_env)
        return apps.launch(pool, f"many-{i}", "m", [], [(0, spec)])

    with ThreadPoolExecutor(8) as ex:
        recs = list(ex.map(one, range(40)))
    for arec in recs:
        wait_for(lambda a=arec: _state(pool, a).state == "SUCCEEDED", what=f"{arec.app_id}")
