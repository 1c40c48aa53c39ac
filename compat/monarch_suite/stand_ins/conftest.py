"""The run's settings: a private home for the pools it makes, and those pools stopped at its end;
which failures reached Monarch's internals (``monarch_internal.reached_internals``), recorded on
the test's report for ``run.py`` to count."""

import os
import tempfile

import monarch_internal
import pytest

os.environ.setdefault("MONARCH_TORCHX_HOME", os.path.join(tempfile.mkdtemp(prefix="mtx-monarch-suite-"), "home"))
os.environ[monarch_internal.TEST_PID_ENV] = str(os.getpid())


def pytest_runtest_setup(item):
    monarch_internal.touched.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when == "call" and report.passed and monarch_internal.touched:
        # it passed against stand-ins it touched (a patch, an attribute read): not a pass of ours
        item.user_properties.append(("stand_ins_only", monarch_internal.touched[0]))
        return
    if call.when == "call" and report.failed and call.excinfo is not None:
        if monarch_internal.used_inside_an_actor(call.excinfo.value):
            item.user_properties.append(("monarch_internal", "used inside an actor"))
            return
        why = monarch_internal.reached_internals(call.excinfo.value)
        if why:
            item.user_properties.append(("reached_internals", why))


def pytest_sessionfinish(session, exitstatus):
    from monarch_torchx.pool import stop_pool
    from monarch_torchx.registry import Registry

    for rec in Registry().list():
        try:
            stop_pool(rec.name)
        except Exception as e:  # a pool a test broke on purpose: say so, do not fail the run
            print(f"could not stop pool {rec.name}: {e}")
