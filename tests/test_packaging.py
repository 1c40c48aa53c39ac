"""Installing monarch-torchx next to torchx-nightly keeps the nightly: one torchx, never two.

Both TorchX lines write one ``torchx/`` package, so a second distribution on top of the first
breaks both. This builds a fresh venv with torchx-nightly (from PyPI or pip's cache) and asks
pip what installing this checkout would add, as a user's ``pip install`` would resolve it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
NIGHTLY = "torchx-nightly==2026.10.26"


def _pip(venv: Path, *args: str) -> subprocess.CompletedProcess:
    res = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", *args], capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def test_installing_next_to_torchx_nightly_adds_no_second_torchx(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    _pip(venv, "install", "-q", NIGHTLY)
    # the package with both extras that name a torchx, in one resolution (each is a build of this
    # checkout, tens of seconds): what the base or either extra requires, their union requires too
    target = f"{ROOT}[nightly,monarch]"
    report = tmp_path / "report.json"
    _pip(venv, "install", "--dry-run", "-q", "--report", str(report), target)
    names = [i["metadata"]["name"].lower() for i in json.loads(report.read_text())["install"]]
    assert "monarch-torchx" in names and "torchmonarch" in names
    assert not {"torchx", "torchx-nightly"} & set(names), names  # the installed nightly is kept
