"""Monarch's ``monarch.config`` knobs as ours accept them, and the compatibility harness's import
rewrite (``compat/monarch_suite``): a name Monarch exports publicly that ours lacks is a failure
of ours (``Missing``), only a name Monarch keeps to itself is left out as internal (issue 43)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from monarch_torchx.actor import config

SUITE = Path(__file__).resolve().parents[2] / "compat" / "monarch_suite"


def test_configure_takes_monarchs_knobs_and_refuses_a_misspelt_one():
    config.clear_runtime_config()
    config.configure(message_delivery_timeout="5s")
    with config.configured(mesh_orphan_timeout="10s") as now:
        assert now == {"message_delivery_timeout": "5s", "mesh_orphan_timeout": "10s"}
    assert config.get_runtime_config() == {"message_delivery_timeout": "5s"}  # the block's own is undone
    with pytest.raises(TypeError, match=r"unknown config key\(s\) \['mesage_delivery_timeout'\]"):
        config.configure(mesage_delivery_timeout="5s")
    config.clear_runtime_config()
    assert config.get_runtime_config() == {}


@pytest.fixture
def rewrite(monkeypatch):
    monkeypatch.syspath_prepend(str(SUITE))
    monkeypatch.syspath_prepend(str(SUITE / "stand_ins"))
    import rewrite as mod

    public = {"actor": {"Actor", "endpoint", "not_ours_yet"}, "config": {"configure"}}
    monkeypatch.setattr(mod, "MONARCH_PUBLIC", public)
    yield mod
    sys.modules.pop("rewrite", None)


def test_a_public_name_we_lack_fails_and_an_internal_one_is_left_out(rewrite):
    out = rewrite.rewrite(
        "from monarch.actor import Actor, not_ours_yet\n"
        "from monarch._src.actor.host_mesh import _private_helper\n"
        "from monarch.config import configure\n"
    )
    assert "from monarch_torchx.actor import Actor as Actor" in out
    assert "not_ours_yet = _M('monarch.actor.not_ours_yet')" in out
    assert "_private_helper = _I('monarch._src.actor.host_mesh._private_helper')" in out
    assert "from monarch_torchx.actor.config import configure as configure" in out
    import monarch_internal

    missing = monarch_internal.Missing("monarch.actor.not_ours_yet")
    with pytest.raises(monarch_internal.MissingPublicName, match="lacks Monarch's public monarch.actor.not_ours_yet"):
        missing()
    with pytest.raises(monarch_internal.MissingPublicName):
        getattr(missing, "anything")  # noqa: B009
