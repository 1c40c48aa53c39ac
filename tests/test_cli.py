"""The real ``torchx`` and ``monarch-torchx`` CLIs in subprocesses, as a user types them."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from monarch_torchx.registry import Registry

from .conftest import BIN, agent_pids, cli_env, torchx, wait_for

pytestmark = pytest.mark.integration

TRAIN = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
host = os.environ["MONARCH_TORCHX_HOST_INDEX"]
print(f"rank={dist.get_rank()} world={dist.get_world_size()} sum={t.item()} host={host}")
dist.destroy_process_group()
"""


def _handle(res: subprocess.CompletedProcess) -> str:
    return res.stdout.strip().splitlines()[-1]


def _state(home: Path, handle: str) -> str:
    out = torchx(home, "status", handle).stdout
    return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.strip().startswith("State:"))


def test_quick_start_through_the_torchx_cli(home, pool_name, tmp_path):
    # 1st run creates the pool and returns as soon as the app is submitted
    res = torchx(
        home,
        "run",
        "-s",
        "monarch_local",
        "-cfg",
        f"pool={pool_name},hosts=2,preload=none",
        "utils.sh",
        "sh",
        "-c",
        "sleep 0.5; echo hi",
        cwd=tmp_path,
    )
    h1 = _handle(res)
    assert h1.startswith(f"monarch_local://torchx/{pool_name}:")
    assert _state(home, h1) in ("RUNNING", "SUCCEEDED")
    wait_for(lambda: _state(home, h1) == "SUCCEEDED", what="echo to succeed")
    assert torchx(home, "log", f"{h1}/sh/0").stdout.strip().endswith("hi")
    agents = sorted(agent_pids(home))

    # 2nd run reuses it: no new processes for hosts
    h2 = _handle(
        torchx(
            home,
            "run",
            "-s",
            "monarch_local",
            "-cfg",
            f"pool={pool_name}",
            "utils.python",
            "-c",
            "print('again')",
            cwd=tmp_path,
        )
    )
    wait_for(lambda: _state(home, h2) == "SUCCEEDED", what="python to succeed")
    assert "again" in torchx(home, "log", h2).stdout
    assert sorted(agent_pids(home)) == agents

    # status/describe/list from any shell
    listed = torchx(home, "list", "-s", "monarch_local").stdout
    assert h1 in listed and h2 in listed
    assert "sh" in torchx(home, "describe", h1).stdout

    # cancel kills the app, the pool stays warm
    h3 = _handle(torchx(home, "run", "-s", "monarch_local", "-cfg", f"pool={pool_name}", "utils.sh", "sleep", "600"))
    wait_for(lambda: _state(home, h3) == "RUNNING", what="sleep to run")
    torchx(home, "cancel", h3)
    wait_for(lambda: _state(home, h3) == "CANCELLED", what="cancel")
    assert sorted(agent_pids(home)) == agents

    # pool sub-commands, through torchx and through monarch-torchx
    out = torchx(home, "pool", "list").stdout
    assert pool_name in out and "healthy" in out and "2/2" in out
    st = json.loads(torchx(home, "pool", "status", pool_name, "--json").stdout)
    assert st["state"] == "healthy" and [h["state"] for h in st["hosts"]] == ["ok", "ok"]
    mt = subprocess.run(
        [str(BIN / "monarch-torchx"), "pool", "status", pool_name],
        env=cli_env(home),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "healthy" in mt
    assert "stopped" in torchx(home, "pool", "stop", pool_name).stdout
    wait_for(lambda: not agent_pids(home), timeout=15, what="agents to exit")
    assert pool_name not in torchx(home, "pool", "list").stdout


def test_a_run_finds_components_with_one_entry_point_scan_and_one_parse_per_source(monkeypatch):
    """TorchX's finder scans every distribution's entry points and parses a module's source once
    per component; inside our ``torchx run`` each happens once, the same components are found,
    and both functions are TorchX's own again afterwards."""
    import ast

    from torchx.specs import finder
    from torchx.util import entrypoints

    from monarch_torchx.torchx_cli import _components_found_once

    metadata = entrypoints.metadata  # what TorchX scans with (importlib_metadata on torchx 0.7.0)
    scans, parses = [], []
    real_scan, real_parse = metadata.entry_points, ast.parse
    monkeypatch.setattr(metadata, "entry_points", lambda **kw: scans.append(kw) or real_scan(**kw))
    monkeypatch.setattr(ast, "parse", lambda src, *a, **kw: parses.append(src) or real_parse(src, *a, **kw))
    import inspect

    args = [None] * len(inspect.signature(finder._load_components).parameters)  # validators: torchx-nightly only
    plain = finder._load_components(*args)
    plain_scans, plain_parses = len(scans), len(parses)
    scans.clear(), parses.clear()
    counting_scan, counting_parse = metadata.entry_points, ast.parse
    with _components_found_once():
        once = finder._load_components(*args)
    assert sorted(once) == sorted(plain) and "utils.echo" in once and "monarch.hostinfo" in once
    assert [kw for kw in scans if not kw] == [{}] and plain_scans > 10  # one full scan, not one per component
    assert len(parses) == len(set(parses)) < plain_parses  # each source once
    assert (metadata.entry_points, ast.parse) == (counting_scan, counting_parse)


def test_pool_create_explicitly_then_run(home, pool_name):
    out = torchx(home, "pool", "create", pool_name, "-s", "monarch_local", "-cfg", "hosts=3,preload=none")
    assert "ready: 3 host(s)" in out.stdout
    h = _handle(
        torchx(home, "run", "-s", "monarch_local", "-cfg", f"pool={pool_name}", "monarch.hostinfo", "--replicas", "3")
    )
    wait_for(lambda: _state(home, h) == "SUCCEEDED", what="hostinfo")
    for k in range(3):
        line = torchx(home, "log", f"{h}/hostinfo/{k}").stdout
        assert f"pool={pool_name} host={k}" in line and "rank0=127.0.0.1" in line


def test_dist_ddp_all_reduce_across_two_hosts(home, pool_name, tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=2")
    h = _handle(
        torchx(
            home,
            "run",
            "-s",
            "monarch_local",
            "-cfg",
            f"pool={pool_name}",
            "dist.ddp",
            "-j",
            "2x1",
            "--rdzv_port",
            str(port),
            "--script",
            "train.py",
            cwd=tmp_path,
        )
    )
    wait_for(lambda: _state(home, h) in ("SUCCEEDED", "FAILED"), timeout=120, what="ddp to finish")
    logs = torchx(home, "log", h).stdout
    assert _state(home, h) == "SUCCEEDED", logs
    import re

    ranks = re.findall(r"train/(\d) \[0\]:rank=(\d) world=2 sum=3.0 host=(\d)", logs)
    assert sorted(r for _, r, _ in ranks) == ["0", "1"]  # c10d assigns ranks; both hosts took part
    assert sorted((rep, host) for rep, _, host in ranks) == [("0", "0"), ("1", "1")]


def test_concurrent_first_runs_create_one_pool(home, pool_name):
    procs = [
        subprocess.Popen(
            [
                str(BIN / "torchx"),
                "run",
                "-s",
                "monarch_local",
                "-cfg",
                f"pool={pool_name},hosts=2,preload=none",
                "utils.echo",
                "--msg",
                f"run{i}",
            ],
            env=cli_env(home),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert len(agent_pids(home)) == 2  # one agent per host, not one set per racing run
    rec = Registry(home).get(pool_name)
    assert len(Registry.list_apps(rec)) == 3


def test_run_options_help_and_errors(home, pool_name):
    out = torchx(home, "runopts", "monarch_local").stdout
    for opt in ("pool", "hosts", "replace", "idle_timeout", "preload"):
        assert opt in out
    assert "create" in torchx(home, "pool", "--help").stdout
    bad = torchx(home, "run", "-s", "monarch_local", "-cfg", f"pool={pool_name},hostz=2", "utils.echo", check=False)
    assert bad.returncode != 0 and "did you mean 'hosts'" in bad.stderr and "Traceback" not in bad.stderr
    bad = torchx(home, "run", "-s", "monarch_local", "-cfg", f"pool={pool_name},hosts=abc", "utils.echo", check=False)
    assert bad.returncode != 0 and "hosts=abc" in bad.stderr and "Traceback" not in bad.stderr
    bad = torchx(home, "run", "-s", "monarch_local", "-cfg", f"pool={pool_name},hosts=0", "utils.echo", check=False)
    assert bad.returncode != 0 and "at least 1 host" in bad.stderr and "Traceback" not in bad.stderr
    bad = torchx(home, "pool", "status", "nope", check=False)
    assert bad.returncode == 1 and "no pool named 'nope'" in bad.stderr and "Traceback" not in bad.stderr
    dry = torchx(
        home,
        "run",
        "--dryrun",
        "-s",
        "monarch_local",
        "-cfg",
        f"pool={pool_name},hosts=2",
        "dist.ddp",
        "-j",
        "2x1",
        "--script",
        "train.py",
    ).stdout
    assert (
        f"pool '{pool_name}'" in dry
        and "train/1 (asks 2 CPUs, 1024 MB): python -m monarch_torchx.agent.torchrun_node -c torchrun" in dry
    )
    assert "replicas go to the least-loaded hosts that fit them when it runs" in dry
    assert "role train: warm torchrun" in dry
    assert not agent_pids(home)  # a dry run starts nothing


def test_idle_timeout_releases_the_pool_and_the_next_run_brings_it_back(home, pool_name):
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=1,preload=none,idle_timeout=1s")
    wait_for(lambda: not agent_pids(home), timeout=30, what="idle agents to exit")
    st = json.loads(torchx(home, "pool", "status", pool_name, "--json").stdout)
    assert st["state"] == "stopped" and "idle" in st["hosts"][0]["error"]
    h = _handle(torchx(home, "run", "-s", "monarch_local", "-cfg", f"pool={pool_name}", "utils.echo", "--msg", "back"))
    wait_for(lambda: _state(home, h) == "SUCCEEDED", what="echo after idle")


def test_idle_timeout_is_pool_wide_a_busy_host_keeps_its_idle_peers(home, pool_name, monkeypatch):
    monkeypatch.setenv("MONARCH_TORCHX_HEARTBEAT_S", "0.3")
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=2,preload=none,idle_timeout=1s")
    h = _handle(torchx(home, "run", "-s", "monarch_local", "-cfg", f"pool={pool_name}", "utils.sh", "sleep", "4"))
    from monarch_torchx.pool import attach

    pool = attach(pool_name)
    # host 1 has had nothing to do for twice its idle_timeout, by its own clock (``info`` is passive:
    # asking does not reset it), so its idle check (every 0.3 s past the limit) has asked the pool at
    # least once; host 0 is still busy, so it stayed
    wait_for(lambda: pool.call(1, "info")["idle_s"] >= 2.0, timeout=20, what="host 1 to be idle past idle_timeout")
    assert pool.call(0, "info")["running"] == 1  # (the precondition: host 0 was busy all along)
    assert len(agent_pids(home)) == 2
    wait_for(lambda: _state(home, h) == "SUCCEEDED", what="sleep to end")
    wait_for(lambda: not agent_pids(home), timeout=20, what="both agents to leave together")


def test_a_host_no_client_reached_yet_waits_for_the_run_before_its_idle_clock_starts(home, pool_name, monkeypatch):
    """A host ready before its peers (a slow pod) waits while the run that made it waits on them:
    with a short idle_timeout it had idled out by then, and the run found it gone (a CI failure
    on Kubernetes). Its idle clock starts with the first request a client makes of it."""
    import time

    from monarch_torchx.agent import agent_argv
    from monarch_torchx.pool import attach

    monkeypatch.setenv("MONARCH_TORCHX_HEARTBEAT_S", "0.3")  # (an idle check every 0.3 s)
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=1,preload=none,idle_timeout=1s")
    wait_for(lambda: not agent_pids(home), timeout=30, what="the pool to idle out")
    rec = Registry(home).require(pool_name)
    Registry.clear_host(rec, 0)
    late = subprocess.Popen(
        agent_argv(rec, 0, "127.0.0.1"),
        cwd=rec.state_dir,
        env=cli_env(home),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for(lambda: Registry.read_host(rec.state_dir, 0) is not None, what="the late host to publish")
        time.sleep(3)  # three times its idle_timeout, ten idle checks, and no client yet
        assert late.poll() is None, "a host nobody had reached yet idled out"
        assert attach(pool_name).call(0, "info")["idle_s"] < 1  # (a look, but the first request)
        late.wait(timeout=30)  # then its idle clock runs: it leaves
    finally:
        late.kill()
        late.wait()


def test_log_of_many_replicas_is_one_request_per_host_not_a_stream_per_replica(home, pool_name):
    """torchx log of an app (no --tail) asks each host once for all of its replicas' lines
    (``app_logs``; through the relay tree on big pools) and prints them as TorchX does, replica by
    replica: the agents see one describe and one log request each, not one stream per replica."""
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=6,preload=none")
    h = _handle(
        torchx(
            home,
            "run",
            "-s",
            "monarch_local",
            "-cfg",
            f"pool={pool_name}",
            "utils.echo",
            "--msg",
            "hello",
            "--num_replicas",
            "6",
        )
    )
    wait_for(lambda: _state(home, h) == "SUCCEEDED", what="echo to finish")
    from monarch_torchx.pool import attach

    pool = attach(pool_name)
    before = sum(pool.call(i, "info")["accepted"] for i in range(6))
    out = torchx(home, "log", h).stdout
    after = sum(pool.call(i, "info")["accepted"] for i in range(6))
    assert _plain(out).splitlines() == [f"echo/{k} hello" for k in range(6)]
    assert after - before <= 6 + 2 * 6, after - before  # the 6 info calls above, a describe and app_logs per host
    assert _plain(torchx(home, "log", f"{h}/echo/4,1").stdout).splitlines() == ["echo/4 hello", "echo/1 hello"]
    # --tail: one stream per group of the tree (here one per host), TorchX's prefixes, ended when the replicas are
    assert sorted(_plain(torchx(home, "log", "--tail", h).stdout).splitlines()) == [f"echo/{k} hello" for k in range(6)]
    assert _plain(torchx(home, "log", "--regex", "nothing", h).stdout) == ""
    res = torchx(home, "log", f"{h}/nope", check=False)
    assert res.returncode == 1 and "has no role 'nope'" in res.stderr and "Traceback" not in res.stderr


def _plain(text: str) -> str:
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def test_log_prints_the_hosts_that_answer_and_names_one_that_does_not(home, pool_name):
    """One SIGSTOPped host of 3: the other replicas' lines are printed, and one line names the
    host whose replica's logs are unavailable (exit code 1), after a bounded wait."""
    import signal

    from monarch_torchx.pool import attach

    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=3,preload=none")
    h = _handle(
        torchx(
            home,
            "run",
            "-s",
            "monarch_local",
            "-cfg",
            f"pool={pool_name}",
            "utils.echo",
            "--msg",
            "hello",
            "--num_replicas",
            "3",
        )
    )
    wait_for(lambda: _state(home, h) == "SUCCEEDED", what="echo to finish")
    pool = attach(pool_name)
    pid = pool.hosts[1].pid
    logs = pool.record.path / "logs" / "host1"
    os.kill(pid, signal.SIGSTOP)
    try:  # its replica's files are on this file system: read from there (issue 38)
        res = torchx(home, "log", h, check=False, timeout=60)
        assert res.returncode == 0 and _plain(res.stdout).splitlines() == [f"echo/{k} hello" for k in range(3)]
        logs.rename(logs.with_name("host1.away"))  # as on a host whose files this machine cannot see
        res = torchx(home, "log", h, check=False, timeout=60)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert _plain(res.stdout).splitlines() == ["echo/0 hello", "echo/2 hello"]
    assert "logs of echo/1 (host 1) unavailable" in res.stderr, res.stderr


def test_log_of_a_replica_past_the_hosts_budget_is_streamed_whole(home, pool_name, monkeypatch):
    """A host answers app_logs with at most its budget of bytes; a replica past it comes whole
    from its own stream, in its place among the others."""
    from monarch_torchx.agent import server

    monkeypatch.setenv("MONARCH_TORCHX_APP_LOGS_MAX_BYTES", "2000")
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=2,preload=none")
    assert server.APP_LOGS_MAX_BYTES > 2000  # the agents read the variable, not this process
    h = _handle(
        torchx(
            home,
            "run",
            "-s",
            "monarch_local",
            "-cfg",
            f"pool={pool_name}",
            "utils.sh",
            "--num_replicas",
            "2",
            "python3",
            "-c",
            "[print(f'line {i} ' + 'x' * 60) for i in range(100)]",
        )
    )
    wait_for(lambda: _state(home, h) == "SUCCEEDED", what="the role to finish")
    from monarch_torchx.pool import attach

    [entry] = attach(pool_name).call(0, "app_logs", app_id=h.rsplit(":", 1)[1])
    assert entry["more"] and entry["lines"] == []  # past the budget: left to the direct stream
    lines = _plain(torchx(home, "log", h).stdout).splitlines()
    assert lines == [f"sh/{k} line {i} " + "x" * 60 for k in range(2) for i in range(100)]
