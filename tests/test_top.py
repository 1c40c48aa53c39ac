"""`monarch-torchx top`: the pool's hosts and replicas as text (issue 41's terminal view)."""

from __future__ import annotations

import subprocess

import pytest

from .conftest import BIN, cli_env, torchx, wait_for

pytestmark = pytest.mark.integration

MT = str(BIN / "monarch-torchx")


def top(home, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([MT, "top", *args], env=cli_env(home), capture_output=True, text=True, timeout=60)


def test_top_shows_the_hosts_and_a_running_replica_then_a_stopped_pool(home, pool_name):
    cfg = f"pool={pool_name},hosts=2,preload=none"
    res = torchx(home, "run", "-s", "monarch_local", "-cfg", cfg, "utils.sh", "sleep", "60")
    app = res.stdout.strip().splitlines()[-1].rsplit("/", 1)[-1].split(":", 1)[-1]

    def shown() -> str | None:
        res = top(home, "--pool", pool_name)  # (not a terminal: one snapshot)
        assert res.returncode == 0, res.stderr
        return res.stdout if f"{app}" in res.stdout and "RUNNING" in res.stdout else None

    out = wait_for(shown, timeout=60, interval=0.5, what="the running replica in top")
    lines = out.splitlines()
    assert lines[0].startswith(f"pool {pool_name} (monarch_local, healthy): 2 host(s)")
    assert "\x1b[" not in out  # no screen control into a pipe
    hosts = [line.split() for line in lines if line.split()[:2] in (["0", "ok"], ["1", "ok"])]
    assert len(hosts) == 2
    (rep,) = [line.split() for line in lines if line.startswith(app)]
    assert rep[1] == "sh/0" and rep[4] == "RUNNING"

    torchx(home, "pool", "stop", pool_name)
    res = top(home, "--pool", pool_name, "--once")
    assert res.returncode == 1 and res.stderr.startswith(f"error: no pool named {pool_name!r}"), res.stderr


def test_top_refuses_an_unknown_pool_and_a_bad_interval_in_one_line(home, pool_name):
    res = top(home, "--pool", "no-such-pool")
    assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1 and "no-such-pool" in res.stderr
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=1,preload=none")
    res = top(home, "--pool", pool_name, "--interval", "0")
    assert res.returncode == 1 and res.stderr.strip() == "error: --interval 0: give a positive number of seconds"
    torchx(home, "pool", "stop", pool_name)
