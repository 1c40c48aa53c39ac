"""Warm Python starts: a replica forked from the pre-imported fork server behaves as if exec'd."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from torchx.runner import get_runner
from torchx.specs import AppDef, AppState, Role

from monarch_torchx.pool import attach

from .conftest import wait_for

pytestmark = pytest.mark.integration

PROBE = """
import atexit, json, os, sys, threading, time
def late():
    time.sleep(0.2); print("thread done", flush=True)
threading.Thread(target=late).start()
atexit.register(lambda: print("atexit ran"))
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "x": os.environ.get("X"),
                  "pp": [p for p in sys.path if p.endswith("extra_pp")], "stdin": sys.stdin.read(),
                  "pgid_is_pid": os.getpgid(0) == os.getpid(), "name": __name__,
                  "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd"))}))
sys.stdout.write("no newline at the end")
sys.exit(int(os.environ.get("CODE", "0")))
"""


@pytest.fixture
def warm_pool(home, pool_name):
    """A one-host pool whose warm fork server has finished importing torch."""
    with get_runner() as runner:
        h = runner.run(_app("warmup", "true"), "monarch_local", {"pool": pool_name, "hosts": 1, "preload": "torch"})
        wait_for(lambda: runner.status(h).is_terminal(), what="warmup")
        pool = attach(pool_name)
        wait_for(lambda: pool.call(0, "info")["warm"]["ready"], timeout=120, what="torch preload")
        yield runner, pool_name


def _app(name, entrypoint, *args, env=None, cwd_image="."):
    return AppDef(
        name=name, roles=[Role(name="r", image=cwd_image, entrypoint=entrypoint, args=list(args), env=env or {})]
    )


def _run(runner, pool_name, app, cfg=None):
    h = runner.run(app, "monarch_local", cfg or {"pool": pool_name})
    st = wait_for(lambda: (s := runner.status(h)) and s.is_terminal() and s, timeout=60, what="app")
    out = "".join(runner.log_lines(h, "r", 0, streams=None))
    return st, out, "".join(runner.log_lines(h, "r", 0, streams=_stream("stdout")))


def _stream(name):
    from torchx.schedulers.api import Stream

    return Stream(name)


def test_python_entrypoints_start_from_the_warm_fork_server(warm_pool):
    runner, pool = warm_pool
    st, out, _ = _run(runner, pool, _app("w", "python", "-c", "import sys; print('torch' in sys.modules)"))
    assert st.state == AppState.SUCCEEDED and out == "True\n"
    # a flag the fork server cannot honour falls back to a real exec (cold: torch not imported)
    st, out, _ = _run(runner, pool, _app("e", "python", "-E", "-c", "import sys; print('torch' in sys.modules)"))
    assert st.state == AppState.SUCCEEDED and out == "False\n"
    # so does an env var read while an interpreter starts
    st, out, _ = _run(
        runner,
        pool,
        _app("h", "python", "-c", "import sys; print('torch' in sys.modules)", env={"PYTHONHASHSEED": "7"}),
    )
    assert out == "False\n"


@pytest.mark.parametrize("mode", ["script", "module", "code"])
def test_forked_python_looks_exactly_like_an_exec(warm_pool, tmp_path, mode, monkeypatch):
    runner, pool = warm_pool
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "probe.py").write_text(PROBE)
    (tmp_path / "extra_pp").mkdir()
    args = {
        "script": ["pkg/probe.py", "a", "b c"],
        "module": ["-m", "pkg.probe", "a", "b c"],
        "code": ["-c", PROBE, "a", "b c"],
    }[mode]
    env = {"X": "role-env", "PYTHONPATH": str(tmp_path / "extra_pp"), "CODE": "3"}
    monkeypatch.chdir(tmp_path)
    st, _, out = _run(runner, pool, _app("p", "python", *args, env=env))
    ref = subprocess.run(
        [sys.executable, *args],
        cwd=tmp_path,
        env={**env, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    assert st.state == AppState.FAILED and "exited with code 3" in st.msg
    assert ref.returncode == 3
    got, want = out.splitlines(), ref.stdout.splitlines()
    assert json.loads(got[0]) == json.loads(want[0]) | {"pgid_is_pid": True}
    assert got[1:] == want[1:] == ["no newline at the endthread done", "atexit ran"]


def test_exit_status_rules(warm_pool):
    runner, pool = warm_pool
    st, out, _ = _run(runner, pool, _app("raise", "python", "-c", "raise RuntimeError('bad thing')"))
    assert st.state == AppState.FAILED and "exited with code 1" in st.msg
    assert "Traceback" in out and "RuntimeError: bad thing" in out
    st, _, _ = _run(
        runner, pool, _app("kill", "python", "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    )
    assert "killed by signal SIGKILL" in st.msg
    st, _, _ = _run(
        runner, pool, _app("term", "python", "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)")
    )
    assert "killed by signal SIGTERM" in st.msg
    st, out, _ = _run(runner, pool, _app("int", "python", "-c", "raise KeyboardInterrupt"))
    assert "killed by signal SIGINT" in st.msg and "KeyboardInterrupt" in out
    st, out, _ = _run(runner, pool, _app("msg", "python", "-c", "import sys; sys.exit('fatal: no data')"))
    assert "exited with code 1" in st.msg and "fatal: no data" in out
    st, _, _ = _run(runner, pool, _app("ok", "python", "-c", "import sys; sys.exit(None)"))
    assert st.state == AppState.SUCCEEDED


def test_a_role_with_its_own_copy_of_a_preloaded_module_gets_its_own(warm_pool, tmp_path):
    runner, pool = warm_pool
    fake = tmp_path / "devbuild"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("DEV = True\n")
    st, out, _ = _run(
        runner,
        pool,
        _app("dev", "python", "-c", "import torch; print(getattr(torch, 'DEV', False))", env={"PYTHONPATH": str(fake)}),
    )
    assert st.state == AppState.SUCCEEDED and out == "True\n"


def test_the_programs_module_globals_are_finalized_at_exit(warm_pool, tmp_path):
    """As under a real interpreter, a forked program's objects held in module globals (its
    __main__'s and its own modules') are collected at exit, after atexit: their __del__ runs."""
    runner, pool = warm_pool
    (tmp_path / "helper.py").write_text(
        "class Noisy:\n    def __init__(self, w):\n        self.w = w\n"
        "    def __del__(self):\n        print('del', self.w, flush=True)\n"
        "kept = Noisy('module')\n"
    )
    script = tmp_path / "main.py"
    script.write_text("import atexit, helper\nmine = helper.Noisy('main')\natexit.register(print, 'atexit')\n")
    st, out, _ = _run(runner, pool, _app("fin", "python", str(script)))
    assert st.state == AppState.SUCCEEDED
    assert out.splitlines()[0] == "atexit" and sorted(out.splitlines()[1:]) == ["del main", "del module"], out


def test_the_programs_own_weakref_finalizers_run_at_exit_and_the_preloads_do_not(warm_pool, tmp_path):
    """A finalizer the program makes runs at its exit, as under a real interpreter; those the fork
    server's preload made (torch: one per op library) are the fork server's and do not run in every
    forked program (they were most of a warm `python -c "import torch"`'s CPU)."""
    runner, pool = warm_pool
    script = tmp_path / "fin.py"
    script.write_text(
        "import weakref, torch\n"
        "class Box: pass\n"
        "kept = Box()\n"
        "weakref.finalize(kept, print, 'finalizer ran', flush=True)\n"
        "inherited = [i for f, i in weakref.finalize._registry.items() if f is not None and i.atexit]\n"
        "print('preload finalizers at exit:', len(inherited) - 1, flush=True)\n"
    )
    st, out, _ = _run(runner, pool, _app("wf", "python", str(script)))
    assert st.state == AppState.SUCCEEDED
    assert out.splitlines() == ["preload finalizers at exit: 0", "finalizer ran"], out


def test_script_main_outlives_the_script_for_atexit(warm_pool, tmp_path):
    runner, pool = warm_pool
    script = tmp_path / "s.py"
    script.write_text(
        "import atexit, pickle, sys\nclass C: pass\n"
        "atexit.register(lambda: print(len(pickle.dumps(C())) > 0, __file__ == sys.argv[0] or __file__))\n"
    )
    st, out, _ = _run(runner, pool, _app("s", "python", str(script)))
    assert st.state == AppState.SUCCEEDED and out.startswith("True"), out


def test_a_pool_without_preloads_imports_the_actor_runtime_once_per_host(home, pool_name):
    """Its first actor proc starts the host's actors fork server (forked from the plain one, so
    no interpreter start-up), which imports the runtime; every later proc, of this mesh and the
    next, is forked from that same server, and roles still start from the plain one (a clean
    interpreter: no monarch_torchx.actor in sys.modules)."""
    from monarch_torchx import attach as attach_hosts
    from monarch_torchx.pool import PoolRequest, ensure_pool

    from .fixtures.actors import Origin

    ensure_pool(PoolRequest("monarch_local", pool_name, {"hosts": 1, "preload": "none"}))
    hosts = attach_hosts(pool_name)
    parents = []
    for _ in range(2):
        procs = hosts.spawn_procs(per_host={"procs": 2})
        parents += list(procs.spawn("origin", Origin).parent.call().get(timeout=60).values())
        procs.stop().get(timeout=60)
    assert len({p["ppid"] for p in parents}) == 1, parents
    assert parents[0]["comm"] == "fs-actors" and "monarch_torchx.agent.forkserver" in parents[0]["argv"]
    assert "monarch_torchx.agent.forkserver" in parents[0]["grandparent_argv"]  # the plain server
    with get_runner() as runner:
        st, out, _ = _run(
            runner,
            pool_name,
            _app("clean", sys.executable, "-c", "import sys; print('actor' in str(sorted(sys.modules)))"),
        )
    assert st.state == AppState.SUCCEEDED and out.strip().endswith("False"), out


def test_the_actors_fork_server_ends_when_idle_and_the_next_spawn_starts_one(home, pool_name, monkeypatch):
    """Its memory is held while procs come and go, not for the pool's life: once its last proc
    has ended for MONARCH_TORCHX_ACTORS_IDLE_S, it exits; the next spawn_procs starts another."""
    from monarch_torchx import attach as attach_hosts
    from monarch_torchx.pool import PoolRequest, ensure_pool

    from .fixtures.actors import Origin

    monkeypatch.setenv("MONARCH_TORCHX_ACTORS_IDLE_S", "1")
    ensure_pool(PoolRequest("monarch_local", pool_name, {"hosts": 1, "preload": "none"}))
    hosts = attach_hosts(pool_name)
    procs = hosts.spawn_procs(per_host={"procs": 1})
    first = procs.spawn("origin", Origin).parent.call_one().get(timeout=60)["ppid"]
    procs.stop().get(timeout=60)
    wait_for(lambda: not os.path.exists(f"/proc/{first}"), timeout=30, what="the idle actors server to exit")
    procs = hosts.spawn_procs(per_host={"procs": 1})
    second = procs.spawn("origin", Origin).parent.call_one().get(timeout=60)["ppid"]
    procs.stop().get(timeout=60)
    assert second != first


def test_a_dead_actors_fork_server_is_replaced_at_the_next_spawn(home, pool_name):
    """Killed (by hand, by the OOM killer): the next spawn_procs starts a new actors server,
    rather than every later proc paying for its own import of the runtime from the plain one."""
    from monarch_torchx import attach as attach_hosts
    from monarch_torchx.pool import PoolRequest, ensure_pool

    from .fixtures.actors import Origin

    ensure_pool(PoolRequest("monarch_local", pool_name, {"hosts": 1, "preload": "none"}))
    hosts = attach_hosts(pool_name)
    procs = hosts.spawn_procs(per_host={"procs": 1})
    first = procs.spawn("origin", Origin).parent.call_one().get(timeout=60)
    procs.stop().get(timeout=60)
    assert first["comm"] == "fs-actors"
    os.kill(first["ppid"], signal.SIGKILL)
    wait_for(lambda: not os.path.exists(f"/proc/{first['ppid']}"), timeout=30, what="the actors server to die")
    procs = hosts.spawn_procs(per_host={"procs": 1})
    second = procs.spawn("origin", Origin).parent.call_one().get(timeout=60)
    procs.stop().get(timeout=60)
    assert second["ppid"] != first["ppid"] and second["comm"] == "fs-actors", second


EXEC_PROBE = """
import json, os, signal, sys
print(json.dumps({"cwd": os.getcwd(), "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
                  "stdin": sys.stdin.read(), "x": os.environ.get("X"),
                  "pgid_is_pid": os.getpgid(0) == os.getpid(), "sid_is_pid": os.getsid(0) == os.getpid()}))
"""
# glibc's posix_spawn leaves its two internal signals (32, 33) ignored; every other one is default
GLIBC_INTERNAL = 0b11 << 31


def test_an_execd_entrypoint_starts_as_a_fresh_process(home, pool_name, tmp_path, monkeypatch):
    """Not this interpreter (``-E`` cannot be honoured by a fork): exec'd, and it inherits
    nothing of the fork server but the requested cwd, env and stdio; the server keeps its own
    cwd; a start in a missing directory fails with the OS's reason, and the next one works."""
    with get_runner() as runner:
        _run(runner, pool_name, _app("warm", "true"), {"pool": pool_name, "hosts": 1, "preload": "none"})
        pool = attach(pool_name)
        server = _plain_fork_server(pool.hosts[0].pid)
        server_cwd = os.readlink(f"/proc/{server}/cwd")
        work = tmp_path / "work"
        work.mkdir()
        monkeypatch.chdir(work)  # the role's cwd (monarch_local's is the client's), not the server's
        st, _, out = _run(runner, pool_name, _app("x", "python", "-E", "-c", EXEC_PROBE, env={"X": "role-env"}))
        assert st.state == AppState.SUCCEEDED, st
        # listdir's own fd is the lowest free one: 3, when nothing else was inherited
        assert json.loads(out) == {
            "cwd": str(work),
            "fds": [0, 1, 2, 3],
            "stdin": "",
            "x": "role-env",
            "pgid_is_pid": True,
            "sid_is_pid": True,
        }
        st, _, out = _run(runner, pool_name, _app("sig", "cat", "/proc/self/status"))
        status = dict(line.split(":\t", 1) for line in out.splitlines() if ":\t" in line)
        assert int(status["SigBlk"], 16) == 0 and int(status["SigIgn"], 16) & ~GLIBC_INTERNAL == 0, status
        assert os.readlink(f"/proc/{server}/cwd") == server_cwd
    from monarch_torchx import apps
    from monarch_torchx.specs import LaunchSpec

    for cwd, fails in ((str(tmp_path / "gone"), True), (str(work), False)):
        spec = LaunchSpec(app_id=f"cwd{int(fails)}", role="r", replica_id=0, argv=["true"], cwd=cwd)
        apps.launch(pool, spec.app_id, "cwd", [{"name": "r", "num_replicas": 1}], [(0, spec)])
        (rep,) = pool.call(0, "wait", app_id=spec.app_id)
        if fails:  # a start that failed is the replica's failure, with the OS's reason
            assert rep["state"] == "FAILED" and rep["msg"] == f"No such file or directory: '{cwd}'", rep
        else:
            assert rep["state"] == "SUCCEEDED", rep
    assert os.readlink(f"/proc/{server}/cwd") == server_cwd


def _plain_fork_server(agent_pid: int) -> int:
    """The agent's fork server without preloads: ``-m monarch_torchx.agent.forkserver CTL EVT``."""
    for p in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            argv = open(f"/proc/{p}/cmdline").read().split("\0")[:-1]
            if _stat(p)[1] == agent_pid and argv[-3:-2] == ["monarch_torchx.agent.forkserver"]:
                return int(p)
        except (OSError, IndexError):
            continue
    raise AssertionError(f"no plain fork server under agent {agent_pid}")


def test_what_a_dead_fork_server_started_ends_with_it(home, pool_name):
    """A program the plain fork server exec'd has no parent-death signal: when that server is
    killed, its agent ends the program's process group (and stops, as it cannot start any more)."""
    with get_runner() as runner:
        h = runner.run(
            _app("s", "sh", "-c", "sleep 600 & sleep 600"),
            "monarch_local",
            {"pool": pool_name, "hosts": 1, "preload": "none"},
        )
        pool = attach(pool_name)
        app = h.rsplit(":", 1)[1]
        pid = wait_for(
            lambda: [r["pid"] for r in pool.call(0, "describe", app_id=app) if r["state"] == "RUNNING"],
            what="the replica",
        )[0]
        server = _stat(str(pid))[1]
        assert "monarch_torchx.agent.forkserver" in open(f"/proc/{server}/cmdline").read()
        group = wait_for(
            lambda: (g := [p for p in os.listdir("/proc") if p.isdigit() and _pgid(p) == pid]) and len(g) >= 2 and g,
            what="the shell and its background sleep",
        )
        os.kill(server, signal.SIGKILL)
        wait_for(
            lambda: not any(os.path.exists(f"/proc/{p}") and _pgid(p) == pid for p in group),
            timeout=20,
            what="the replica's process group to end",
        )


def _pgid(pid: str) -> int:
    try:
        return _stat(pid)[2]
    except (OSError, IndexError, ValueError):
        return -1


def _stat(pid: str) -> list:
    """/proc/PID/stat's fields after the command: [state, ppid, pgrp, session, ...], numbers as ints."""
    return [
        int(f) if f.lstrip("-").isdigit() else f for f in open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    ]


def test_an_exec_start_forks_where_posix_spawn_cannot_start_a_session(monkeypatch, tmp_path):
    """A Python built against a C library without POSIX_SPAWN_SETSID raises NotImplementedError
    for ``posix_spawn(setsid=True)``: the fork server then forks and execs, as it did before.
    (This machine's Python has it, so the fork server runs here in this process, with that
    call refusing.)"""
    import socket

    from monarch_torchx import net
    from monarch_torchx.agent import forkserver
    from monarch_torchx.agent.forkserver_messages import Start, Started, StartMode

    ctl, ctl_server = socket.socketpair()
    evt, evt_server = socket.socketpair()
    server = forkserver.ForkServer(ctl_server, evt_server, [])

    def no_session(*_a, **_k):
        raise NotImplementedError("setsid is not supported")

    monkeypatch.setattr(forkserver.os, "posix_spawn", no_session)
    out = tmp_path / "out"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT, 0o600)
    server.spawn(
        Start(
            token=7,
            mode=StartMode.EXEC,
            argv=["sh", "-c", "echo $X $(pwd); echo err >&2"],
            env={"X": "forked", "PATH": os.defpath},
            cwd=str(tmp_path),
        ),
        [fd, os.dup(fd)],
    )
    reply = net.FrameReader(evt, exact=True).recv()
    assert isinstance(reply, Started) and reply.token == 7 and reply.pid > 0 and not server.posix_spawn, reply
    _, status = os.waitpid(reply.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and out.read_text() == f"forked {tmp_path}\nerr\n"
    assert os.getcwd() != str(tmp_path)  # the server's own cwd was never the role's
    for s in (ctl, evt, ctl_server, evt_server):
        s.close()
    for fd in (server.home, server.wake_r, server.wake_w):
        os.close(fd)


def test_a_server_forked_from_the_plain_one_imports_its_preloads_and_ends_with_it(monkeypatch, tmp_path):
    """The actors server is forked from the plain one: it imports its own preloads (once, in the
    new process), holds none of the plain one's descriptors, goes by a name of its own (which the
    programs it forks do not inherit), is never reported as a program's exit, and ends when the
    plain server does."""
    import asyncio

    from monarch_torchx.agent.forkserver_messages import StartMode
    from monarch_torchx.agent.launcher import _Server

    probe = tmp_path / "imported_by"
    monkeypatch.setenv("PRELOAD_PROBE_FILE", str(probe))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parent.parent))
    exits, deaths = [], []

    async def scenario():
        plain = _Server("plain", [], lambda pid, code: exits.append(pid), lambda *a: deaths.append(a))
        await plain.start()
        await asyncio.wait_for(plain.ready.wait(), 60)
        child = _Server(
            "probe", ["tests.fixtures.preload_probe"], lambda pid, code: None, lambda *a: None, parent=plain
        )
        await child.start()
        await asyncio.wait_for(child.ready.wait(), 60)
        assert probe.read_text().split() == [str(child.pid)]  # imported once, by the forked server
        assert _stat(child.pid)[1] == plain.proc.pid and child.info.preloaded == ["tests.fixtures.preload_probe"]
        assert Path(f"/proc/{child.pid}/comm").read_text().strip() == "fs-probe"
        fds = {int(fd) for fd in os.listdir(f"/proc/{child.pid}/fd")}
        plain_sockets = {
            os.readlink(f"/proc/{plain.proc.pid}/fd/{fd}")
            for fd in os.listdir(f"/proc/{plain.proc.pid}/fd")
            if os.readlink(f"/proc/{plain.proc.pid}/fd/{fd}").startswith("socket:")
        }
        child_links = {
            os.readlink(f"/proc/{child.pid}/fd/{fd}") for fd in fds if os.path.exists(f"/proc/{child.pid}/fd/{fd}")
        }
        assert not plain_sockets & child_links  # none of the plain server's sockets
        out = tmp_path / "out"
        fd = os.open(out, os.O_WRONLY | os.O_CREAT, 0o600)
        pid = await child.spawn(
            StartMode.PYTHON,
            [sys.executable, "-c", "print(open('/proc/self/comm').read().strip())"],
            dict(os.environ),
            str(tmp_path),
            [fd, os.dup(fd)],
        )
        os.close(fd)
        await _until(lambda: pid not in child.pids, "the forked program to exit")
        assert out.read_text().strip() != "fs-probe"  # a program takes the interpreter's name back

        os.kill(child.pid, signal.SIGKILL)
        await asyncio.wait_for(child.dead.wait(), 30)
        await asyncio.sleep(0.3)  # (the plain server has reaped it by now)
        assert child.pid not in exits and not deaths and not plain.pids
        child.close()

        again = _Server(
            "probe", ["tests.fixtures.preload_probe"], lambda pid, code: None, lambda *a: None, parent=plain
        )
        await again.start()
        await asyncio.wait_for(again.ready.wait(), 60)
        plain.close()  # the plain server ends, and the one forked from it with it
        await asyncio.wait_for(again.dead.wait(), 30)
        await _until(lambda: not os.path.exists(f"/proc/{again.pid}"), "the forked server to end")
        again.close()

    async def _until(pred, what):
        for _ in range(600):
            if pred():
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    asyncio.run(scenario())


def _monarch_torchx(home, *args):
    from .conftest import BIN, cli_env

    return subprocess.run(
        [str(BIN / "monarch-torchx"), *args], env=cli_env(home), capture_output=True, text=True, timeout=180
    )


@pytest.mark.parametrize("how", ["pool create", "torchx run"])
def test_a_preload_that_fails_fails_the_pool_creation_in_one_line(home, pool_name, how):
    """A misspelled preload is a mistake, not a pool that silently starts everything cold: the
    creation (by `pool create` or by the first run) fails in one line naming the module, the
    host and the import error, and the pool it started is stopped (no agent, no record)."""
    from monarch_torchx.registry import Registry

    from .conftest import agent_pids, torchx

    if how == "pool create":
        res = _monarch_torchx(home, "pool", "create", pool_name, "-cfg", "preload=typo_mod")
    else:
        res = torchx(
            home,
            "run",
            "-s",
            "monarch_local",
            "-cfg",
            f"pool={pool_name},preload=typo_mod",
            "utils.echo",
            "--msg",
            "hi",
            check=False,
        )
    assert res.returncode != 0, res.stdout + res.stderr
    want = (
        "preload of 'typo_mod' failed on host 0: ModuleNotFoundError: No module named 'typo_mod'; "
        "fix -cfg preload=... (none = no preloads)"
    )
    assert want in res.stderr.strip().splitlines()[-1], res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert Registry(home).get(pool_name) is None
    wait_for(lambda: not agent_pids(home), timeout=10, what="the pool's agents to end")


def test_a_default_preload_that_fails_warns_and_pool_status_shows_it(home, pool_name):
    """The default preload (torch, not asked for) that cannot be imported is said at creation and
    by `pool status` on each host, and the pool serves (a pool for apps without torch is fine)."""
    from monarch_torchx.pool import PoolRequest, ensure_pool

    said = []
    ensure_pool(
        PoolRequest("monarch_local", pool_name, {"hosts": 2, "preload": None}),
        defaults={"hosts": 2, "preload": "no_such_default_mod"},
        progress=said.append,
    )
    line = (
        "warning: preload of 'no_such_default_mod' failed on host 0: ModuleNotFoundError: "
        "No module named 'no_such_default_mod'; Python entrypoints start cold"
    )
    assert any(m.startswith(line) for m in said), said
    res = _monarch_torchx(home, "pool", "status", pool_name)
    assert res.returncode == 0, res.stderr
    hosts = [ln for ln in res.stdout.splitlines() if "warm=-" in ln]
    assert len(hosts) == 2, res.stdout
    assert all(
        "warning: preload of 'no_such_default_mod' failed: ModuleNotFoundError: No module named "
        "'no_such_default_mod'" in ln
        for ln in hosts
    ), res.stdout


def test_a_failed_replicas_status_says_the_cause_from_its_stderr(home, pool_name, tmp_path):
    """A replica that fails says why in `torchx status`, not only in `torchx log`: the last
    non-empty line of its stderr (bounded), read after its output is drained (a quick failure's
    exit can be heard before its last line is)."""
    from .conftest import torchx

    cfg = f"pool={pool_name},preload=none"
    missing = tmp_path / "nowhere" / "train.py"
    h = (
        torchx(
            home,
            "run",
            "--wait",
            "-s",
            "monarch_local",
            "-cfg",
            cfg,
            "utils.python",
            "--script",
            str(missing),
            check=False,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    st = torchx(home, "status", h).stdout
    assert (
        f"exited with code 2: {sys.executable}: can't open file '{missing}': [Errno 2] No such file or directory" in st
    ), st
    with get_runner() as runner:
        code = "import sys; print('noise', file=sys.stderr); print('out'); raise ValueError('x' * 500 + ' the cause')"
        got, _, _ = _run(runner, pool_name, _app("v", sys.executable, "-c", code), {"pool": pool_name})
    assert got.state == AppState.FAILED and "exited with code 1: ValueError: xxx" in got.msg, got.msg
    assert len(got.msg.split("exited with code 1: ")[1]) <= 200 and got.msg.endswith("..."), got.msg
