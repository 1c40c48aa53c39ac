"""An agent's host file, as clients read it (``Registry.read_host``)."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from monarch_torchx.errors import MonarchError
from monarch_torchx.registry import HostAddr, Registry


def _write(tmp_path, data) -> None:
    (tmp_path / "hosts").mkdir(exist_ok=True)
    (tmp_path / "hosts" / "0.json").write_text(json.dumps(data))


def test_a_newer_agents_file_is_read_without_the_fields_this_version_lacks(tmp_path):
    addr = HostAddr(0, "10.77.0.11", 4000, "node1", 12, "abc", exited=5.0, exited_idle=True)
    _write(tmp_path, {**asdict(addr), "a_field_from_a_later_version": 1})
    assert Registry.read_host(tmp_path, 0) == addr


def test_a_host_file_that_is_not_an_object_is_a_one_line_error(tmp_path):
    _write(tmp_path, [1, 2])
    with pytest.raises(MonarchError, match="corrupt registry file .*not a JSON object"):
        Registry.read_host(tmp_path, 0)
