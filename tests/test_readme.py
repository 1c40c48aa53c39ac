"""Every runnable block of the README runs as written: the docs cannot drift from the code.

A block fenced ```` ```bash ```` (or ```` ```python ````) runs on ``monarch_local`` in a fresh
registry home, in a directory that holds a ``train.py``; ```` ```bash slurm ```` runs on the SLURM
lab and ```` ```bash kubernetes ```` against the emulated cluster of ``fixtures/k8s_cluster.py``.
Blocks of one kind run in the README's order, each in its own process, as a reader pastes them.
Untagged ```` ``` ```` blocks are diagrams and the ``make`` targets CI itself runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from torchx.components import dist as dist_components

from .conftest import cli_env
from .test_cli import TRAIN
from .test_kubernetes import cluster  # noqa: F401  (the emulated cluster, as a fixture)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^```(\w+)(?: (\w+))?\n(.*?)^```$", re.M | re.S)


def readme_blocks(tag: str = "") -> list[tuple[str, str]]:
    """(language, code) of the README's runnable blocks of one kind, in order."""
    text = (ROOT / "README.md").read_text()
    return [
        (m.group(1), m.group(3))
        for m in _FENCE.finditer(text)
        if m.group(1) in ("bash", "python") and (m.group(2) or "") == tag
    ]


def _run_blocks(tag: str, home: Path, cwd: Path, env_extra: dict, timeout: float = 300) -> list[str]:
    env = {**cli_env(home), **env_extra}
    outputs = []
    blocks = readme_blocks(tag)
    assert blocks, f"no README blocks tagged {tag!r}"
    for lang, code in blocks:
        if not hasattr(dist_components, "torchrun"):  # torchx 0.7.0: the README says to write dist.ddp there
            code = code.replace("dist.torchrun", "dist.ddp")
        argv = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
        res = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        assert res.returncode == 0, (
            f"README {lang} block failed ({res.returncode}):\n{code}\n--- stdout\n"
            f"{res.stdout[-3000:]}\n--- stderr\n{res.stderr[-3000:]}"
        )
        outputs.append(res.stdout + res.stderr)
    return outputs


def _workdir(tmp_path: Path) -> Path:
    cwd = tmp_path / "work"
    cwd.mkdir()
    (cwd / "train.py").write_text(TRAIN)
    return cwd


def test_the_readmes_local_blocks_run_as_written(home, tmp_path):
    cwd = _workdir(tmp_path)
    venv = tmp_path / "venv"  # what `"$VIRTUAL_ENV"` names in the sync block: a small virtualenv-like tree
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    blocks = _run_blocks("", home, cwd, {"VIRTUAL_ENV": str(venv)})
    quick, torchrun, sync, submitit_out, sharing, actors, sql = blocks
    assert "again" in quick
    assert "sum=10.0" in torchrun  # 2 hosts x 2 procs
    assert "[3, 3]\n[1, 2, 3]" in submitit_out
    assert "waits for 1 GPU" in sharing and "queue=False" in sharing and "the biggest, host 0, has 2 GPU(s)" in sharing
    assert "HELD BY" in sharing and "1 app(s) in the pool's queue" in sharing
    assert "host" in sql and "[0] 2." in sql and '"exit_code": 0' in sql  # (exec's lines, and its --json)


@pytest.mark.usefixtures("slurm_lab")
def test_the_readmes_slurm_block_runs_as_written_on_the_lab(home, tmp_path):
    (out,) = _run_blocks("slurm", home, _workdir(tmp_path), {})
    assert "sbatch" in out and "gpus" in out


def test_the_readmes_kubernetes_block_runs_as_written_on_the_emulated_cluster(cluster, home, tmp_path):  # noqa: F811
    cluster.admit("team-a")  # Kueue admits the queue the block names
    (out,) = _run_blocks("kubernetes", home, _workdir(tmp_path), {"KUBECONFIG": os.environ["KUBECONFIG"]})
    assert "kind: StatefulSet" in out
