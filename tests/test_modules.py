"""Agents load pluggable modules (entry-point group monarch_torchx.modules, or $MONARCH_TORCHX_MODULES)."""

from __future__ import annotations

from pathlib import Path

import pytest

from monarch_torchx import wire
from monarch_torchx.pool import attach

from .conftest import torchx, wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


def test_modules_add_operations_and_a_broken_one_does_not_take_the_agent_down(home, pool_name, monkeypatch, tmp_path):
    monkeypatch.setenv(
        "MONARCH_TORCHX_MODULES",
        "tests.fixtures.agent_module:setup,tests.fixtures.agent_module:bare,tests.fixtures.agent_module:broken",
    )
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("GREETER_STOPPED_DIR", str(tmp_path))
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=2,preload=none")
    pool = attach(pool_name)
    assert pool.call(1, "hello", name="you") == "hello you from host 1"  # a method of the module's object
    assert pool.call(0, "shout", text="hi") == "HI"
    first = pool.call(0, "greeter.ticks")
    wait_for(lambda: pool.call(0, "greeter.ticks") > first, what="the module's background task to run")
    mods = pool.call(0, "info")["modules"]
    assert mods["tests.fixtures.agent_module:setup"] == "loaded"
    assert mods["tests.fixtures.agent_module:broken"] == "failed: RuntimeError: this module cannot load"
    with pytest.raises(wire.RemoteError, match="unknown operation"):
        pool.call(0, "nope")
    torchx(home, "pool", "stop", pool_name)
    wait_for(lambda: {p.name for p in tmp_path.iterdir()} >= {"host0", "host1"}, what="each module's stop")
