"""A node shared with other users (issue 37): nothing of ours imports their code, keeps state
where they could swap it, or kills a healthy host on a stale heartbeat or a skewed clock.

"Another user" is uid 65534 (nobody), made real with ``setpriv`` or ``chown``; the careless
case is a directory its group (or everyone) can write.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from monarch_torchx.errors import MonarchError
from monarch_torchx.pool import attach
from monarch_torchx.private import PrivatePathError, check_trusted_parents
from monarch_torchx.registry import Registry

from .conftest import TORCHX, agent_pids, cli_env, torchx, wait_for

pytestmark = pytest.mark.integration

OTHER_UID = 65534


def _plant(directory: Path, marker: Path) -> None:
    """What another user leaves in a directory they can write: a package named like ours and a
    ``torch.py``, each recording that it ran (and as whom) before handing over to the real one."""
    import monarch_torchx

    real = list(monarch_torchx.__path__)[0]
    pkg = directory / "monarch_torchx"
    pkg.mkdir()
    record = f"import os\nopen({str(marker)!r}, 'a').write(f'{{os.getpid()}} {{os.getuid()}}\\n')\n"
    (pkg / "__init__.py").write_text(
        record + f"__path__[:] = [{real!r}]\nexec(compile(open({real + '/__init__.py'!r}).read(), 'x', 'exec'))\n"
    )
    (directory / "torch.py").write_text(record)


def test_agents_and_fork_servers_started_from_a_writable_cwd_import_nothing_from_it(home, pool_name, tmp_path):
    group_dir = tmp_path / "project"
    group_dir.mkdir()
    group_dir.chmod(0o777)  # a group project directory, writable by others
    marker = tmp_path / "planted-code-ran"
    _plant(group_dir, marker)
    res = torchx(
        home,
        "run",
        "-s",
        "monarch_local",
        "-cfg",
        f"pool={pool_name},hosts=2,preload=torch",
        "utils.echo",
        "--msg",
        "hi",
        cwd=group_dir,
    )
    handle = res.stdout.strip().splitlines()[-1]
    wait_for(lambda: "SUCCEEDED" in torchx(home, "status", handle, cwd=group_dir).stdout, what="the echo")
    # a repair started from there too: host 1's agent is killed and brought back
    pool = attach(pool_name)
    os.kill(pool.hosts[1].pid, signal.SIGKILL)
    torchx(
        home, "run", "-s", "monarch_local", "-cfg", f"pool={pool_name}", "utils.echo", "--msg", "again", cwd=group_dir
    )
    assert not marker.exists(), f"planted code ran: {marker.read_text()}"
    # the replica itself still starts in the caller's cwd, as on local_cwd
    res = torchx(
        home,
        "run",
        "--wait",
        "--log",
        "-s",
        "monarch_local",
        "-cfg",
        f"pool={pool_name}",
        "utils.sh",
        "pwd",
        cwd=group_dir,
    )
    assert str(group_dir) in res.stdout + res.stderr


def test_a_job_dir_whose_parent_others_can_write_is_refused_in_one_line(home, tmp_path):
    open_parent = tmp_path / "scratch"
    open_parent.mkdir()
    open_parent.chmod(0o777)  # no sticky bit: anyone may rename JOB_DIR/NAME away after our check
    with pytest.raises(MonarchError, match=r"refusing .*scratch: others can write it .*no sticky bit") as e:
        Registry(home).new_record("p", "monarch_slurm", {"hosts": 1}, {"job_dir": str(open_parent / "jobs")})
    assert "\n" not in str(e.value)
    assert not (open_parent / "jobs").exists()  # refused before anything was made there
    # the same through the CLI a user runs (nothing is submitted: the state dir comes first)
    res = torchx(
        home, "pool", "create", "p", "-s", "monarch_slurm", "-cfg", f"nodes=1,job_dir={open_parent}", check=False
    )
    assert res.returncode != 0 and "others can write it" in res.stderr and "Traceback" not in res.stderr, res.stderr
    # sticky (like /tmp), or writable only by us: fine
    open_parent.chmod(0o1777)
    Registry(home).new_record("p", "monarch_slurm", {"hosts": 1}, {"job_dir": str(open_parent / "jobs")})
    # a parent that another user owns is not ours to trust either
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    with pytest.raises(PrivatePathError, match=f"belongs to uid {OTHER_UID}"):
        check_trusted_parents(theirs / "jobs" / "p")


def test_a_symlinked_parent_is_judged_by_where_it_points(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    (tmp_path / "link").symlink_to(open_dir)
    with pytest.raises(PrivatePathError, match="others can write it"):
        check_trusted_parents(tmp_path / "link" / "state")


def _pool_env(home: Path, tmpdir: Path) -> dict:
    env = cli_env(home)
    env["TMPDIR"] = str(tmpdir)
    return env


def test_a_node_temp_root_someone_else_made_fails_pool_create_in_one_line(home, pool_name, tmp_path):
    """Another user pre-creates ``$TMPDIR/monarch_torchx-UID``: the agent refuses to start (actors,
    telemetry and sync keep their sockets and stores there), and the create says so; before,
    the pool read healthy while those modules had all failed to load."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    tmpdir.chmod(0o1777)
    planted = tmpdir / f"monarch_torchx-{os.getuid()}"
    planted.mkdir(mode=0o777)
    os.chown(planted, OTHER_UID, OTHER_UID)
    res = subprocess.run(
        [TORCHX, "pool", "create", pool_name, "-s", "monarch_local", "-cfg", "hosts=1,preload=none"],
        env=_pool_env(home, tmpdir),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode != 0, res.stdout
    assert f"{planted} belongs to uid {OTHER_UID}" in res.stderr and "Traceback" not in res.stderr, res.stderr
    wait_for(lambda: not agent_pids(home), what="no agent left")
    # a temp dir others can write without a sticky bit is refused the same way
    open_tmp = tmp_path / "open_tmp"
    open_tmp.mkdir()
    open_tmp.chmod(0o777)
    res = subprocess.run(
        [TORCHX, "pool", "create", pool_name + "b", "-s", "monarch_local", "-cfg", "hosts=1,preload=none"],
        env=_pool_env(home, open_tmp),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode != 0 and "others can write it" in res.stderr, res.stderr


def _stall(pid: int, seconds: float) -> threading.Thread:
    """Stops process ``pid`` (it takes connections in the kernel and answers none) for ``seconds``."""
    os.kill(pid, signal.SIGSTOP)
    t = threading.Timer(seconds, os.kill, (pid, signal.SIGCONT))
    t.start()
    return t


def test_a_stalled_agent_with_a_stale_heartbeat_gets_the_patient_probe_and_lives(home, pool_name, monkeypatch):
    """A heartbeat that stopped (a full disk) plus a stall longer than the quick ping (3 s) was
    enough to SIGKILL a healthy agent; now a patient probe decides, and it answers."""
    monkeypatch.setenv("MONARCH_TORCHX_HEARTBEAT_S", "600")  # nothing rewrites the host file meanwhile
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=2,preload=none")
    pool = attach(pool_name)
    agent = pool.hosts[1]
    an_hour_ago = time.time() - 3600  # its last heartbeat, as the file says and as its mtime says
    Registry.publish_host(pool.record.state_dir, replace(agent, heartbeat=an_hour_ago), moved=False)
    os.utime(Path(pool.record.state_dir) / "hosts" / "1.json", (an_hour_ago, an_hour_ago))
    t = _stall(agent.pid, 6)
    try:
        health = attach(pool_name).health()
    finally:
        t.join()
    assert all(h.ok for h in health), [(h.index, h.state, h.error) for h in health]
    assert attach(pool_name).hosts[1].pid == agent.pid  # not repaired


def test_a_client_clock_ahead_of_the_agents_kills_nothing(home, pool_name, monkeypatch):
    """The client's clock 120 s ahead of the agents' (another login node): a heartbeat's age is
    read on the file system's clock, so a stall of a few seconds is not a lost host."""
    monkeypatch.setenv("MONARCH_TORCHX_HEARTBEAT_S", "600")
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=2,preload=none")
    agent = attach(pool_name).hosts[1]
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 120)  # this process is the client
    t = _stall(agent.pid, 5)
    try:
        health = attach(pool_name).health()
    finally:
        t.join()
    monkeypatch.setattr(time, "time", real)
    assert all(h.ok for h in health), [(h.index, h.state, h.error) for h in health]
    assert attach(pool_name).hosts[1].pid == agent.pid


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs (root only); unmounted at the end."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if (
        os.getuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mnt)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("needs root to mount a small tmpfs")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_full_disk_is_shown_in_pool_status_and_kills_nothing(small_disk, pool_name, monkeypatch):
    home = small_disk / "home"
    monkeypatch.setenv("MONARCH_TORCHX_HOME", str(home))
    monkeypatch.setenv("MONARCH_TORCHX_HEARTBEAT_S", "0.2")
    monkeypatch.setenv("MONARCH_TORCHX_HEARTBEAT_WRITE_S", "0.2")
    try:
        torchx(home, "pool", "create", pool_name, "-cfg", "hosts=1,preload=none")
        agent = attach(pool_name).hosts[0]
        with open(small_disk / "filler", "wb") as f:  # fills the disk
            chunk = b"x" * (1 << 16)
            try:
                while True:
                    f.write(chunk)
                    f.flush()
            except OSError:
                pass
        out = wait_for(
            lambda: (o := torchx(home, "pool", "status", pool_name, check=False).stdout) and "No space left" in o and o,
            what="the full disk in pool status",
        )
        assert "warning: cannot write its heartbeat" in out and " ok " in out, out
        assert attach(pool_name).hosts[0].pid == agent.pid
        (small_disk / "filler").unlink()
    finally:
        (small_disk / "filler").unlink(missing_ok=True)
        torchx(home, "pool", "stop", pool_name, check=False)
        wait_for(lambda: not agent_pids(home), what="the agent to exit")


def test_stop_force_ends_only_our_own_agents_not_another_users_decoy(home, pool_name, tmp_path):
    """Another user starts a process whose command line names our pool and state dir: ``pool stop
    --force`` ends our agents and leaves theirs alone (before: a PermissionError with our agents
    still running, or as root their process killed)."""
    import json

    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=2,preload=none")
    state_dir = Registry(home).state_dir(pool_name)
    decoy = subprocess.Popen(
        [
            "setpriv",
            "--reuid",
            str(OTHER_UID),
            "--regid",
            str(OTHER_UID),
            "--clear-groups",
            "/usr/bin/python3",
            "-c",
            "import time; time.sleep(60)",
            "monarch_torchx.agent",
            "--pool",
            pool_name,
            "--state-dir",
            str(state_dir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for(
            lambda: (
                os.path.exists(f"/proc/{decoy.pid}/status")
                and f"Uid:\t{OTHER_UID}" in Path(f"/proc/{decoy.pid}/status").read_text()
            ),
            what="the decoy",
        )
        Registry(home).record_path(pool_name).write_text(json.dumps({"name": pool_name, "hosts": "two"}))
        res = torchx(home, "pool", "stop", "--force", pool_name)
        assert "ended 2 local agent(s)" in res.stdout, res.stdout
        wait_for(lambda: agent_pids(home) == [decoy.pid], what="our agents to end")
        assert decoy.poll() is None, "another user's process was signalled"
    finally:
        decoy.kill()
        decoy.wait()


def test_a_store_port_reserved_for_an_app_cannot_be_taken_by_another_user_before_it_listens(home, pool_name):
    """The warm torchrun's store port: reserved on host 0 and held there (SO_REUSEPORT, which
    the kernel shares only within one uid) until the app's own listener binds it; before, it
    was closed at once and free for anyone until node 0 bound it."""
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=1,preload=none")
    pool = attach(pool_name)
    port = pool.call(0, "reserve_port", hold_for="some-app")
    grab = (
        "import socket, sys; s = socket.socket(); "
        "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1); "
        f"s.bind(('127.0.0.1', {port})); s.listen(); print('took it')"
    )
    other = subprocess.run(
        [
            "setpriv",
            "--reuid",
            str(OTHER_UID),
            "--regid",
            str(OTHER_UID),
            "--clear-groups",
            "/usr/bin/python3",
            "-c",
            grab,
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert other.returncode != 0 and "Address already in use" in other.stderr, other.stdout + other.stderr
