"""Faults from the issue's list, each against a real pool: dead agents, bad peers, bad handles."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from dataclasses import replace
from pathlib import Path

import pytest
from torchx.runner import get_runner
from torchx.specs import AppDef, AppState, Role

import monarch_torchx.pool as pool_mod
from monarch_torchx import wire
from monarch_torchx.credentials import PoolCredentials
from monarch_torchx.pool import attach
from monarch_torchx.registry import Registry

from .conftest import process_alive, torchx, wait_for

pytestmark = pytest.mark.integration


def _sleeper(replicas=2):
    return AppDef("sleeper", roles=[Role(name="s", image=".", entrypoint="sleep", args=["600"], num_replicas=replicas)])


def test_sigkilled_agent_fails_its_apps_degrades_the_pool_and_the_next_run_repairs(home, pool_name):
    with get_runner() as runner:
        h = runner.run(_sleeper(), "monarch_local", {"pool": pool_name, "hosts": 2, "preload": "none"})
        wait_for(lambda: runner.status(h).state == AppState.RUNNING, what="sleepers")
        pool = attach(pool_name)
        victim = pool.hosts[1]
        app_pid = next(r["pid"] for r in pool.call(1, "describe", app_id=h.split(":")[-1]))
        os.kill(victim.pid, signal.SIGKILL)

        st = wait_for(lambda: (s := runner.status(h)) and s.state == AppState.FAILED and s, timeout=10, what="FAILED")
        assert "host 1" in st.msg and "lost" in st.msg
        wait_for(lambda: not process_alive(app_pid), timeout=10, what="the dead agent's replica to die with it")
        status = json.loads(torchx(home, "pool", "status", pool_name, "--json").stdout)
        assert status["state"] == "degraded"
        assert [h_["state"] for h_ in status["hosts"]] == ["ok", "lost"]
        text = torchx(home, "pool", "status", pool_name)
        assert "degraded" in text.stdout and "restarts lost hosts" in text.stderr

        h2 = runner.run(
            AppDef("after", roles=[Role(name="a", image=".", entrypoint="echo", args=["ok"], num_replicas=2)]),
            "monarch_local",
            {"pool": pool_name},
        )
        st2 = wait_for(lambda: (s := runner.status(h2)) and s.is_terminal() and s, what="run after repair")
        assert st2.state == AppState.SUCCEEDED
        new = Registry.hosts(Registry().get(pool_name))[1]
        assert new.pid != victim.pid and new.incarnation != victim.incarnation
        assert json.loads(torchx(home, "pool", "status", pool_name, "--json").stdout)["state"] == "healthy"
        # the app that was on the lost host stays FAILED, with the reason
        st = runner.status(h)
        assert st.state == AppState.FAILED and "lost" in st.msg
        runner.cancel(h)  # its surviving replica on host 0


def test_a_replica_killed_by_the_jobs_signal_just_before_its_agent_reads_as_the_agents_end(home, pool_name):
    """scancel signals every process of the job at once: the replica's exit may be heard first. It
    must not be recorded as the replica's own end ("exited with code 143"), so the engine's word
    for the job (here: the lost host) is what its status says."""
    with get_runner() as runner:
        app = AppDef("sh", roles=[Role(name="s", image=".", entrypoint="sh", args=["-c", "sleep 600; true"])])
        h = runner.run(app, "monarch_local", {"pool": pool_name, "hosts": 1, "preload": "none"})
        wait_for(lambda: runner.status(h).state == AppState.RUNNING, what="the shell")
        pool = attach(pool_name)
        agent = pool.hosts[0].pid
        shell = next(r["pid"] for r in pool.call(0, "describe", app_id=h.split(":")[-1]))
        os.kill(shell, signal.SIGTERM)  # (the replica first, then its agent: one order scancel gives)
        time.sleep(0.1)
        os.kill(agent, signal.SIGTERM)
        st = wait_for(lambda: (s := runner.status(h)) and s.is_terminal() and s, timeout=15, what="the end")
        assert st.state == AppState.FAILED and "host 0" in st.msg and "143" not in st.msg, st.msg
        # and a shell that ends so on its own, its agent alive, is its own end
        h = runner.run(app, "monarch_local", {"pool": pool_name})
        wait_for(lambda: runner.status(h).state == AppState.RUNNING, what="the shell on the repaired pool")
        shell = next(r["pid"] for r in attach(pool_name).call(0, "describe", app_id=h.split(":")[-1]))
        os.kill(shell, signal.SIGTERM)
        st = wait_for(lambda: (s := runner.status(h)) and s.is_terminal() and s, timeout=15, what="the end")
        assert st.state == AppState.FAILED and "killed by signal SIGTERM" in st.msg, st.msg


def _agent_log(pool_name: str, index: int = 0) -> str:
    return (Registry().get(pool_name).path / "logs" / f"agent{index}.log").read_text()


def test_wrong_token_and_garbage_are_dropped_and_the_agent_keeps_serving(home, pool_name, tmp_path):
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=1,preload=none")
    pool = attach(pool_name)
    addr = pool.hosts[0]
    with pytest.raises(wire.WireError, match="authentication|closed"):
        wire.Client(addr.host, addr.port, PoolCredentials(os.urandom(32)))
    for junk in (os.urandom(4096), b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x00" * 100):
        s = socket.create_connection((addr.host, addr.port))
        s.settimeout(10)
        s.recv(64)
        s.sendall(junk)
        assert s.recv(100) == b""
        s.close()
    # each reason is logged (once per 10 s at most, with a count: a flood cannot fill the log)
    wait_for(lambda: _agent_log(pool_name).count("dropped connection") >= 3, timeout=10, what="logged reasons")
    log = _agent_log(pool_name)
    assert "authentication failed" in log and "malformed handshake" in log and "handshake timed out" in log
    assert pool.call(0, "info")["pool"] == pool_name


def test_unknown_pools_and_apps_fail_fast_with_one_line(home, pool_name):
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=1,preload=none")
    for handle in ("monarch_local://torchx/nosuchpool:app-1", f"monarch_local://torchx/{pool_name}:never-existed"):
        t0 = time.time()
        res = torchx(home, "log", handle, check=False, timeout=30)
        assert res.returncode == 1 and "no app" in res.stderr and "Traceback" not in res.stderr
        res = torchx(home, "log", f"{handle}/echo/0", check=False, timeout=30)
        assert res.returncode == 1 and "no app" in res.stderr and "Traceback" not in res.stderr
        res = torchx(home, "status", handle, check=False, timeout=30)
        assert res.returncode != 0 and "does not exist" in res.stderr and "Traceback" not in res.stderr
        assert time.time() - t0 < 30  # no polling forever (a bound, not a benchmark)
    res = torchx(
        home,
        "run",
        "-s",
        "monarch_local",
        "-cfg",
        f"pool={pool_name}",
        "dist.ddp",
        "-j",
        "2x1",
        "--script",
        "x.py",
        check=False,
    )
    assert res.returncode == 1 and "needs 2 hosts" in res.stderr and "Traceback" not in res.stderr
    res = torchx(home, "run", "-s", "monarch_local", "-cfg", "pool=bad/name", "utils.echo", check=False)
    assert res.returncode == 1 and "invalid pool name" in res.stderr and "Traceback" not in res.stderr


def test_what_a_replica_leaves_in_its_process_group_is_cleaned_up(home, pool_name, tmp_path):
    pidfile = tmp_path / "bg.pid"
    app = AppDef(
        "bg",
        roles=[
            Role(name="b", image=".", entrypoint="sh", args=["-c", f"sleep 600 & echo $! > {pidfile}; echo started"])
        ],
    )
    with get_runner() as runner:
        h = runner.run(app, "monarch_local", {"pool": pool_name, "preload": "none"})
        # tailing ends when the replica ends, although its background child held the pipes
        assert "".join(runner.log_lines(h, "b", 0, should_tail=True)) == "started\n"
        assert runner.status(h).state == AppState.SUCCEEDED
        bg = int(pidfile.read_text())
        wait_for(lambda: not process_alive(bg), timeout=10, what="the background child to be killed")


def test_missing_script_exits_like_python(home, pool_name, tmp_path):
    with get_runner() as runner:
        h = runner.run(
            AppDef("m", roles=[Role(name="m", image=".", entrypoint="python", args=["nope.py"])]),
            "monarch_local",
            {"pool": pool_name, "preload": "none"},
        )
        st = wait_for(lambda: (s := runner.status(h)) and s.is_terminal() and s, what="exit")
        assert "exited with code 2" in st.msg
        assert "can't open file" in "".join(runner.log_lines(h, "m", 0))


def test_a_handshake_meant_for_one_agent_fails_on_another(home, pool_name):
    """A stranger on a dead agent's port who relays to a live agent of the pool gets nowhere."""
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=2,preload=none")
    pool = attach(pool_name)
    a0, a1 = pool.hosts
    with pytest.raises(wire.WireError):  # right secret, identity of agent 0, but reaching agent 1
        wire.Client(a1.host, a1.port, pool.record.credentials, identity=a0.identity(pool_name))
    with wire.Client(a1.host, a1.port, pool.record.credentials, identity=a1.identity(pool_name)) as c:
        assert c.call("info")["index"] == 1


def test_registry_refuses_a_home_others_can_read(tmp_path, monkeypatch):
    from monarch_torchx.errors import MonarchError

    shared = tmp_path / "shared_home"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(MonarchError, match="is open to other users"):
        Registry(shared).new_record("p", "monarch_local", {"hosts": 1}, {})


def _point_at(home, pool_name: str, index: int, port: int, heartbeat_age: float = 0.0) -> int:
    """Rewrites host ``index``'s published address to ``port`` (the agent lives on); returns its pid."""
    from dataclasses import replace

    rec = Registry(home).get(pool_name)
    addr = Registry.read_host(rec.state_dir, index)
    Registry.publish_host(rec.state_dir, replace(addr, port=port, heartbeat=time.time() - heartbeat_age))
    if heartbeat_age:  # the heartbeat's age is read from the file's mtime, on the file system's clock
        path = Path(rec.state_dir) / "hosts" / f"{index}.json"
        os.utime(path, (time.time() - heartbeat_age,) * 2)
    return addr.pid


def _patient_ping_of(seconds: float, monkeypatch) -> None:
    """A shorter patient probe of a host that does not answer, here and in the CLIs the test runs."""
    monkeypatch.setenv("MONARCH_TORCHX_SLOW_PING_S", str(seconds))
    monkeypatch.setattr(pool_mod, "SLOW_PING_TIMEOUT_S", seconds)


def test_an_unreachable_host_with_a_fresh_heartbeat_is_unknown_and_never_repaired(home, pool_name, monkeypatch):
    monkeypatch.setenv("MONARCH_TORCHX_HEARTBEAT_S", "600")  # nothing republishes the address during the test
    _patient_ping_of(3.0, monkeypatch)
    with get_runner() as runner:
        h = runner.run(_sleeper(), "monarch_local", {"pool": pool_name, "hosts": 2, "preload": ""})
        wait_for(lambda: runner.status(h).state == AppState.RUNNING, what="RUNNING")
        # a port that takes connections and never answers: what a flooded or stalled agent looks like
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        agent = _point_at(home, pool_name, 1, silent.getsockname()[1])
        st = runner.status(h)
        assert st.state == AppState.UNKNOWN and "host 1" in st.msg and "unreachable" in st.msg, st
        # a new run on the pool leaves host 1 alone: no repair, no kill
        res = torchx(home, "run", "-s", "monarch_local", "-cfg", f"pool={pool_name}", "utils.echo", "--msg", "hi")
        assert "host 1 is unreachable but not known to be lost" in res.stderr and "repairing" not in res.stderr
        assert process_alive(agent)
        out = torchx(home, "pool", "status", pool_name, check=False).stdout
        assert re.search(r"^1\s+unreachable\s", out, re.M), out
        runner.cancel(h)
        silent.close()


def test_an_unreachable_host_with_a_stale_heartbeat_is_lost_and_repaired(home, pool_name, monkeypatch):
    monkeypatch.setenv("MONARCH_TORCHX_HEARTBEAT_S", "600")
    _patient_ping_of(3.0, monkeypatch)
    with get_runner() as runner:
        h = runner.run(_sleeper(), "monarch_local", {"pool": pool_name, "hosts": 2, "preload": ""})
        wait_for(lambda: runner.status(h).state == AppState.RUNNING, what="RUNNING")
        addr = Registry.read_host(Registry(home).get(pool_name).state_dir, 1)
        os.kill(addr.pid, signal.SIGSTOP)  # hung: it takes connections (in the kernel) and never answers
        agent = _point_at(home, pool_name, 1, addr.port, heartbeat_age=3600)
        st = runner.status(h)
        assert (
            st.state == AppState.FAILED
            and "host 1 of pool" in st.msg
            and "is lost: host 1 has not heartbeaten" in st.msg
        )
        res = torchx(home, "run", "-s", "monarch_local", "-cfg", f"pool={pool_name}", "utils.echo", "--msg", "hi")
        assert "repairing" in res.stderr
        wait_for(lambda: not process_alive(agent), what="the hung agent to be replaced")
        assert all(x.ok for x in attach(pool_name).health())


def _nowhere() -> int:
    """A port on loopback that nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _view_from_files(home, pool_name: str) -> None:
    """The pool's view, written from the hosts' files as they are now (a check that found them well)."""
    rec = Registry(home).get(pool_name)
    Registry.write_view(rec, Registry.hosts(rec))


def test_a_reused_pool_is_checked_by_the_launch_and_a_host_it_finds_lost_is_repaired_then_run_on(
    home, pool_name, monkeypatch
):
    """Through the relay tree (forced on for 2 hosts), a run on a pool that exists is not preceded
    by a health check: its placement's ask of the hosts' loads and its launch reach every host, in
    one connection each. A host that fails them with nothing at hand that said it was lost (its
    agent's process lives; its address leads to a port nothing listens on) is repaired, and the
    app started on the checked pool."""
    monkeypatch.setenv("MONARCH_TORCHX_HEARTBEAT_S", "600")  # nothing republishes the address during the test
    monkeypatch.setenv("MONARCH_TORCHX_TREE_MIN_HOSTS", "2")
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=2,preload=none")
    pool = attach(pool_name)
    with get_runner() as runner:
        before = pool.call(0, "info")["accepted"]
        h = runner.run(
            AppDef("one", roles=[Role(name="e", image=".", entrypoint="echo", args=["one"], num_replicas=2)]),
            "monarch_local",
            {"pool": pool_name},
        )
        # the hosts' loads (placement), the launch's connection, and this ask's own: no health check
        assert pool.call(0, "info")["accepted"] - before == 3
        st = wait_for(lambda: (s := runner.status(h)) and s.is_terminal() and s, what="the first run")
        assert st.state == AppState.SUCCEEDED

    old = _point_at(home, pool_name, 1, _nowhere())
    _view_from_files(home, pool_name)
    res = torchx(
        home,
        "run",
        "-s",
        "monarch_local",
        "-cfg",
        f"pool={pool_name}",
        "utils.echo",
        "--msg",
        "two",
        "--num_replicas",
        "2",
    )
    assert "repairing" in res.stderr and "again, on the checked pool" in res.stderr, res.stderr
    handle = res.stdout.strip().splitlines()[-1]
    wait_for(lambda: "SUCCEEDED" in torchx(home, "status", handle).stdout, what="the app started again")
    logs = torchx(home, "log", handle).stdout.splitlines()
    # host 1 did not answer the placement's ask of every host's load, and the app needs it: the pool
    # is checked (and host 1 repaired) before anything starts, so each replica ran once
    assert logs.count("echo/0 two") == 1 and logs.count("echo/1 two") == 1, logs
    wait_for(lambda: not process_alive(old), what="the agent whose address led nowhere to be replaced")
    assert all(x.ok for x in attach(pool_name).health())

    # a stale view (host 1 moved since it was written): nothing to repair, the app starts again
    agent = attach(pool_name).hosts[1]
    rec = Registry(home).get(pool_name)
    Registry.write_view(rec, [a if a.index != 1 else replace(a, port=_nowhere()) for a in Registry.hosts(rec)])
    res = torchx(
        home,
        "run",
        "-s",
        "monarch_local",
        "-cfg",
        f"pool={pool_name}",
        "utils.echo",
        "--msg",
        "three",
        "--num_replicas",
        "2",
    )
    assert "again, on the checked pool" in res.stderr and "repairing" not in res.stderr, res.stderr
    handle = res.stdout.strip().splitlines()[-1]
    wait_for(lambda: "SUCCEEDED" in torchx(home, "status", handle).stdout, what="the app started again")
    assert attach(pool_name).hosts[1].same_agent(agent)


def test_a_handshake_flood_neither_keeps_clients_out_nor_gets_hosts_repaired(home, pool_name, monkeypatch):
    """A local peer with no credentials holds hundreds of silent connections to every agent: runs,
    status and health still work, nothing is repaired, and the agents' logs stay short (0600)."""
    with get_runner() as runner:
        h = runner.run(_sleeper(), "monarch_local", {"pool": pool_name, "hosts": 2, "preload": ""})
        wait_for(lambda: runner.status(h).state == AppState.RUNNING, what="RUNNING")
        pool = attach(pool_name)
        before = [(a.pid, a.incarnation) for a in pool.hosts]
        flood = [socket.create_connection((a.host, a.port)) for a in pool.hosts for _ in range(2 * wire.MAX_HANDSHAKES)]
        try:
            assert runner.status(h).state == AppState.RUNNING
            res = torchx(home, "run", "-s", "monarch_local", "-cfg", f"pool={pool_name}", "utils.echo", "--msg", "hi")
            assert "repairing" not in res.stderr and "unreachable" not in res.stderr
            assert all(x.ok for x in pool.health())
        finally:
            for s in flood:
                s.close()
        assert [(a.pid, a.incarnation) for a in attach(pool_name).hosts] == before
        for i in range(2):
            log = Registry().get(pool_name).path / "logs" / f"agent{i}.log"
            assert os.stat(log).st_mode & 0o077 == 0
            assert log.read_text().count("dropped connection") <= 3
        runner.cancel(h)


def test_a_wrong_shaped_record_is_one_line_and_stop_force_ends_its_agents(home, pool_name):
    from .conftest import agent_pids

    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=2,preload=none")
    assert len(agent_pids(home)) >= 2
    Registry(home).record_path(pool_name).write_text(json.dumps({"name": pool_name, "hosts": "two"}))
    for args in (("pool", "status", pool_name), ("pool", "stop", pool_name)):
        res = torchx(home, *args, check=False)
        assert res.returncode == 1 and "corrupt registry file" in res.stderr and "Traceback" not in res.stderr
        assert f"torchx pool stop --force {pool_name}" in res.stderr
    res = torchx(home, "pool", "stop", "--force", pool_name)
    assert "ended 2 local agent(s)" in res.stdout and "removed" in res.stdout
    wait_for(lambda: not agent_pids(home), what="the agents to end")
    assert not Registry(home).record_path(pool_name).exists()


def test_an_agent_that_sees_a_successor_in_its_host_file_exits(home, pool_name, monkeypatch):
    """A pool re-created under the same state dir after its record was removed: the old agents
    leave instead of overwriting the new ones' addresses (the new pool stays healthy)."""
    monkeypatch.setenv("MONARCH_TORCHX_HEARTBEAT_S", "0.3")
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=1,preload=none")
    old = Registry(home).get(pool_name).allocation["pids"]["0"]
    Registry(home).record_path(pool_name).unlink()  # what the corrupt-record message used to advise
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=1,preload=none")
    wait_for(lambda: not process_alive(old), timeout=15, what="the old agent to leave")
    # the new agent stays: it has since checked its host file again (it checks, then writes its
    # heartbeat) and found itself there, not an address the old one wrote before it left
    gone = time.time()
    state_dir = Registry(home).get(pool_name).path

    def heartbeat() -> float:
        h = Registry.read_host(state_dir, 0)
        return h.heartbeat if h else 0.0

    wait_for(lambda: heartbeat() > gone, timeout=15, what="the new agent's next heartbeat")
    assert all(x.ok for x in attach(pool_name).health())
    assert Registry(home).get(pool_name).allocation["pids"]["0"] != old


def test_what_a_killed_agent_left_in_temp_is_swept_by_the_next(home, pool_name, monkeypatch, tmp_path):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    root = tmp_path / f"monarch_torchx-{os.getuid()}"
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=1,preload=none")
    pid = attach(pool_name).hosts[0].pid
    left = sorted(root.glob(f"*/{pool_name}-0-{socket.gethostname()}-{pid}"))
    assert [d.parent.name for d in left] == ["debug", "procs", "telemetry"]
    assert all(os.stat(d).st_mode & 0o077 == 0 for d in (root, *left))
    os.kill(pid, signal.SIGKILL)  # no cleanup runs
    wait_for(lambda: not process_alive(pid), what="the agent to die")
    assert all(d.exists() for d in left)
    torchx(home, "pool", "create", pool_name + "n", "-cfg", "hosts=1,preload=none")
    assert not any(d.exists() for d in left)  # swept at the next agent's start
    torchx(home, "pool", "stop", pool_name + "n")
    torchx(home, "pool", "stop", "--force", pool_name)
    wait_for(lambda: not root.exists(), what="nothing left in TMPDIR")
