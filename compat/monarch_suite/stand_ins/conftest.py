"""The run's settings: a private home for the pools it makes, and those pools stopped at its end."""
import os
import tempfile

os.environ.setdefault("MONARCH_TORCHX_HOME", os.path.join(tempfile.mkdtemp(prefix="mtx-monarch-suite-"), "home"))


def pytest_sessionfinish(session, exitstatus):
    from monarch_torchx.pool import stop_pool
    from monarch_torchx.registry import Registry

    for rec in Registry().list():
        try:
            stop_pool(rec.name)
        except Exception as e:  # a pool a test broke on purpose: say so, do not fail the run
            print(f"could not stop pool {rec.name}: {e}")
