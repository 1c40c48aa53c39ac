"""Issue 41: the guide for AI agents (docs/SKILL.md, `monarch-torchx skill`): every recipe's
commands run as written, in order, through the real CLIs; and the CLI's shell completion."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from .conftest import BIN, cli_env

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
SKILL = ROOT / "docs" / "SKILL.md"
_FENCE = re.compile(r"^```bash\n(.*?)^```$", re.M | re.S)


def test_skill_prints_the_guide(home):
    res = subprocess.run([str(BIN / "monarch-torchx"), "skill"], env=cli_env(home), capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout == SKILL.read_text()


def test_every_recipe_of_the_guide_runs_as_written(home, tmp_path):
    blocks = _FENCE.findall(SKILL.read_text())
    assert len(blocks) == 8
    outs = []
    for code in blocks:
        res = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", code],
            cwd=tmp_path,
            env=cli_env(home),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == 0, f"{code}\n--- stdout\n{res.stdout[-3000:]}\n--- stderr\n{res.stderr[-3000:]}"
        outs.append(res.stdout)
    create, exec_, nan, stacks, error, restart, sync, stop = outs
    assert "['ok', 'ok']" in create
    assert "[0] (3, 11)" in exec_ and "[1] (3, 11)" in exec_ and "0 [0, 1]" in exec_
    assert '"host": 1' in nan and '"line": "loss nan"' in nan and '"host": 0' not in nan  # only rank 1's line
    for host in (0, 1):  # each host's dump, its replica in the function that waits
        assert re.search(rf"host {host} pid \d+ thread \d+\n    wait_for_peer", stacks), stacks
    assert "exited with code 1: bad config: lr=-1" in error
    assert restart.count("monarch_local://torchx/dev:") == 2
    assert "(0, True," in sync and "(1, True," in sync
    assert "pool 'dev' stopped" in stop


def test_shell_completion_offers_commands_and_pool_names(home, tmp_path):
    subprocess.run(
        [str(BIN / "monarch-torchx"), "pool", "create", "compl1", "-cfg", "hosts=1,preload=none"],
        env=cli_env(home),
        check=True,
        capture_output=True,
    )
    for line, want in (("monarch-torchx ex", "exec"), ("monarch-torchx exec --pool co", "compl1")):
        out = tmp_path / "completions"
        env = {
            **cli_env(home),
            "_ARGCOMPLETE": "1",
            "COMP_LINE": line,
            "COMP_POINT": str(len(line)),
            "_ARGCOMPLETE_STDOUT_FILENAME": str(out),
        }
        res = subprocess.run([str(BIN / "monarch-torchx")], env=env, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        assert out.read_text().split() == [want]
