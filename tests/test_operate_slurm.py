"""Issue 41 across the SLURM lab's nodes (TLS between them, each node in its own network
namespace): `exec --all`, `shell` on another node, and `debug` of breakpoints on two nodes."""

from __future__ import annotations

import json
import re
import subprocess
import textwrap

import pytest

from .conftest import BIN, cli_env, torchx, wait_for
from .test_debug import PAUSES

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("slurm_lab")]

MT = str(BIN / "monarch-torchx")


def mt(home, *args: str, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([MT, *args], env=cli_env(home), capture_output=True, text=True, input=input, timeout=180)


def test_exec_shell_and_debug_across_slurm_nodes(home, pool_name, tmp_path):
    res = mt(home, "pool", "create", pool_name, "-s", "monarch_slurm", "-cfg", "nodes=2,partition=debug,time=00:20:00")
    assert res.returncode == 0, res.stderr
    try:
        res = mt(home, "exec", "--pool", pool_name, "--all", "--json", "--", "hostname")
        assert res.returncode == 0, res.stdout + res.stderr
        out = json.loads(res.stdout)
        names = [h["output"][0] for h in out["hosts"]]
        assert len(set(names)) == 2 and all(re.fullmatch(r"node\d", n) for n in names), names

        res = mt(home, "shell", "--pool", pool_name, "--host", "1", "--", "sh", input="hostname\nexit 4\n")
        assert res.returncode == 4, res.stderr
        assert names[1] in res.stdout

        (tmp_path / "pauses.py").write_text(PAUSES)
        res = torchx(
            home,
            "run",
            "-s",
            "monarch_slurm",
            "-cfg",
            f"pool={pool_name},nodes=2,partition=debug,time=00:20:00",
            "utils.python",
            "--num_replicas",
            "2",
            "-c",
            textwrap.dedent(PAUSES),
            cwd=tmp_path,
        )
        handle = res.stdout.strip().splitlines()[-1]

        def listed() -> list | None:
            got = json.loads(mt(home, "debug", "--pool", pool_name, "--json").stdout or "[]")
            return got if len(got) == 2 else None

        found = wait_for(listed, timeout=90, interval=0.5, what="two paused replicas")
        assert sorted(p["host"] for p in found) == [0, 1]
        res = mt(home, "debug", "--pool", pool_name, "--cast", "p x")
        assert res.returncode == 0, res.stderr
        assert sorted(line.rsplit(" ", 1)[-1] for line in res.stdout.splitlines()) == ["10", "20"]
        assert mt(home, "debug", "--pool", pool_name, "--continue").returncode == 0
        wait_for(lambda: "SUCCEEDED" in torchx(home, "status", handle).stdout, timeout=90, what="the app ended")
    finally:
        mt(home, "pool", "stop", pool_name)
