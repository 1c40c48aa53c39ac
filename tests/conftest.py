"""Shared fixtures: a private registry home per test, unique pool names, the real torchx CLI.

Every test gets its own ``MONARCH_TORCHX_HOME``; at teardown every pool in it is stopped and
any agent still alive under it is a test failure (tests leave nothing behind).
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from monarch_torchx.errors import MonarchError
from monarch_torchx.pool import PoolRequest, ensure_pool, stop_pool
from monarch_torchx.registry import Registry

BIN = Path(sys.executable).parent
TORCHX = str(BIN / "torchx")


def pids_running(module: str, path: Path) -> list[int]:
    """Processes whose command line names both ``module`` and ``path``."""
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes()
        except OSError:
            continue
        if module.encode() in cmd and str(path).encode() in cmd:
            pids.append(int(p.name))
    return pids


def agent_pids(home: Path) -> list[int]:
    """Agents (and fork servers) whose command line names this home."""
    return pids_running("monarch_torchx.agent", home)


def stop_all_pools(home: Path) -> None:
    """Stops every pool of a registry home (best effort: one that cannot be stopped is skipped)."""
    reg = Registry(home)
    for rec in reg.list():
        try:
            stop_pool(rec.name, reg)
        except MonarchError:
            pass


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    h = tmp_path / "mt_home"
    monkeypatch.setenv("MONARCH_TORCHX_HOME", str(h))
    yield h
    stop_all_pools(h)
    deadline = time.time() + 10
    while agent_pids(h) and time.time() < deadline:
        time.sleep(0.1)
    left = agent_pids(h)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"agents left behind: {left}"


class FaultRecorder:
    """Stands in for ``unhandled_fault_hook`` in this process for the whole run: the default hook
    ends the controller (as Monarch's), and the controller here is pytest. An event that arrives
    after its test ended (a proc's end is reported asynchronously) lands in the next test's list
    or in none, never in the default hook. The default itself is tested in a child process."""

    def __init__(self) -> None:
        self.current: list = []

    def __call__(self, failure) -> None:
        self.current.append(failure)


def pytest_configure(config):
    # (pytest-xdist registers it too; this keeps it known where the tests run without xdist)
    config.addinivalue_line("markers", "xdist_group(name): tests that run on one xdist worker, in one group")
    config.addinivalue_line("markers", "serial: runs alone, after the tests that run two at a time (Makefile)")
    config.addinivalue_line("markers", "slurm_lab: uses the SLURM lab (serial too; set from the fixture)")


def pytest_collection_modifyitems(config, items):
    """`make test-integration` runs the integration tests on two xdist workers, then the ``serial``
    ones alone: those that time a signal or a race against the machine, load it (64-host pools, a
    browser), or use the SLURM lab (one cluster for the machine, and walltimes of a minute that a
    loaded machine makes miss)."""
    for item in items:
        if "slurm_lab" in item.fixturenames:
            item.add_marker(pytest.mark.serial)
            item.add_marker(pytest.mark.slurm_lab)  # (`make test` runs these beside the torchx 0.7 lane)


@pytest.fixture(scope="session", autouse=True)
def _fault_recorder():
    import monarch_torchx.actor as actor_pkg

    recorder = FaultRecorder()
    actor_pkg.unhandled_fault_hook = recorder
    return recorder


@pytest.fixture
def faults(_fault_recorder: FaultRecorder) -> list:
    """The supervision events that reach this process's fault hook during the test."""
    _fault_recorder.current = []
    return _fault_recorder.current


@pytest.fixture
def pool_name() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


def cli_env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["MONARCH_TORCHX_HOME"] = str(home)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def torchx(
    home: Path, *args: str, cwd: Path | None = None, timeout: float = 120, check: bool = True
) -> subprocess.CompletedProcess:
    """Runs the real torchx CLI in a subprocess."""
    res = subprocess.run([TORCHX, *args], env=cli_env(home), cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise AssertionError(f"torchx {' '.join(args)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    return res


@contextlib.contextmanager
def module_pool(tmp_path_factory, name: str, hosts: int, preload: str = "torch"):
    """A warm monarch_local pool in a private home for a whole test module (tests spawn procs on it);
    yields (name, home); at the end, the pool is stopped and nothing may be left running."""
    home = tmp_path_factory.mktemp(name) / "home"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MONARCH_TORCHX_HOME", str(home))
        mp.chdir(Path(__file__).resolve().parents[1])
        ensure_pool(PoolRequest("monarch_local", name, {"hosts": hosts, "preload": preload}))
        yield name, home
        stop_pool(name, Registry(home))
        deadline = time.time() + 10
        while agent_pids(home) and time.time() < deadline:
            time.sleep(0.1)
        assert not agent_pids(home), "agents or procs left behind"


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def wait_for(pred, timeout: float = 30.0, interval: float = 0.05, what: str = "condition"):
    """Polls ``pred`` until it is true. A predicate that runs a CLI (a process start: about 0.5 s of
    CPU) waits as long as that process computed before the next try: half a core spent polling, not
    a whole one taken from the pools under test (the tests run two at a time on two cores). One that
    only waits (a pipe's next line) tries again at once: it costs nothing, and what it reads counts."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        spent = _children_cpu()
        v = pred()
        if v:
            return v
        time.sleep(max(interval, _children_cpu() - spent))
    raise AssertionError(f"timed out waiting for {what}")


LAB = Path(__file__).resolve().parents[1] / "scripts" / "slurmlab"


def _lab_up() -> bool:
    try:
        res = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    states = res.stdout.split()
    return (
        res.returncode == 0 and bool(states) and all(s in ("idle", "mixed", "allocated", "completing") for s in states)
    )


@pytest.fixture(scope="session")
def slurm_lab():
    """The project's local SLURM cluster (3 nodes in network namespaces); started if needed.

    Stopped at the end only if this session started it. Skipped, with the reason, where it cannot
    run (not root); any other failure to start it fails the tests that need it.
    """
    if os.geteuid() != 0:
        pytest.skip("the local SLURM lab needs root (network namespaces, slurmd); run `make test` as root")
    started = False
    if not _lab_up():
        res = subprocess.run(["bash", str(LAB / "start-cluster.sh")], capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            pytest.fail(f"could not start the SLURM lab:\n{res.stderr[-3000:]}")
        started = True
    yield
    if started and not os.environ.get("MONARCH_TORCHX_KEEP_LAB"):
        subprocess.run(["bash", str(LAB / "stop-cluster.sh")], capture_output=True, timeout=300)


def squeue_ids(name_prefix: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True).stdout
    return [
        line.split()[0] for line in out.splitlines() if line.split()[1:] and line.split()[1].startswith(name_prefix)
    ]


def node_store(base: Path, pool: str, index: int) -> Path:
    """Host ``index``'s syncfs store under MONARCH_TORCHX_SYNC_STORE=``base`` (named POOL-POOLID-hostN)."""
    from monarch_torchx.syncfs.host import pool_id

    return base / f"{pool}-{pool_id(Registry().require(pool).key)}-host{index}"


def assert_launch_with_dead_hosts_is_all_or_nothing(pool, app: str, dead: list[int]) -> None:
    """Kills the agents of ``dead``, launches one replica on every host of ``pool``: the launch
    fails naming each dead host, and nothing of it runs on the live ones."""
    from monarch_torchx import apps
    from monarch_torchx.errors import MonarchError
    from monarch_torchx.specs import LaunchSpec

    n = pool.record.num_hosts
    for i in dead:
        os.kill(pool.hosts[i].pid, signal.SIGKILL)
    wait_for(lambda: not any(process_alive(pool.hosts[i].pid) for i in dead), what="the killed agents to be gone")
    specs = [(i, LaunchSpec(app_id=app, role="r", replica_id=i, argv=["sleep", "30"])) for i in range(n)]
    with pytest.raises(MonarchError, match=f"could not start {app}") as e:
        apps.launch(pool, app, app, [{"name": "r"}], specs)
    assert all(f"host {i}:" in str(e.value) for i in dead), e.value
    answers = pool.ask("describe", [i for i in range(n) if i not in dead], app_id=app)
    assert all(err is None for _, _, err in answers)
    assert all(s["state"] != "RUNNING" for _, v, _ in answers for s in v), answers


def assert_host0_relays_to_host1(home: Path, pool_name: str, line: str):
    """On a 3-host pool with the tree forced on (fan-out 2) after each host printed ``line``
    once: the client asks hosts 0 and 2, host 0 passes the request to host 1, and SQL aggregates
    and the pool's status go that way too. Returns the pool and the hosts' ``info``."""
    import json

    from monarch_torchx.pool import attach
    from monarch_torchx.telemetry.query import run

    pool = attach(pool_name, Registry(home))
    before = {i: v["relayed"] for i, v, _ in pool.ask("info", range(3))}
    info = pool.ask("info", range(3))
    assert [(i, v["index"], e) for i, v, e in info] == [(0, 0, None), (1, 1, None), (2, 2, None)]
    assert {i: v["relayed"] - before[i] for i, v, _ in info} == {0: 1, 1: 0, 2: 0}  # host 0 passed it to host 1
    wait_for(
        lambda: run(pool, f"SELECT count(*) AS n FROM logs WHERE line = '{line}'").table.to_pylist() == [{"n": 3}],
        timeout=30,
        what="the lines in the logs table",
    )
    res = run(pool, f"SELECT host, count(*) AS n FROM logs WHERE line = '{line}' GROUP BY host ORDER BY host")
    assert res.table.to_pylist() == [{"host": i, "n": 1} for i in range(3)] and res.answers == 2
    status = json.loads(torchx(home, "pool", "status", pool_name, "--json").stdout)
    assert [x["state"] for x in status["hosts"]] == ["ok"] * 3
    return pool, info


def assert_a_relay_killed_mid_wait_is_passed_over(pool, app: str, victim: int) -> None:
    """Runs one sleeping replica per host, asks every host to ``wait`` for it through the tree,
    and kills relay ``victim``'s agent while it is waiting: ``victim`` is named, and every other
    host still answers (the rest of its group is asked again through the next member)."""
    import threading

    from monarch_torchx import apps
    from monarch_torchx.errors import HostUnreachable
    from monarch_torchx.specs import LaunchSpec

    n = pool.record.num_hosts
    apps.launch(
        pool,
        app,
        app,
        [{"name": "r"}],
        [(i, LaunchSpec(app_id=app, role="r", replica_id=i, argv=["sleep", "60"])) for i in range(n)],
    )
    got: dict[str, list] = {}
    asking = threading.Thread(
        target=lambda: got.setdefault("res", pool.ask("wait", range(n), timeout=20.0, app_id=app, within=4.0))
    )
    pid = pool.hosts[victim].pid
    relayed = pool.call(victim, "info")["relayed"]
    asking.start()
    # the victim holds the wait now: it has passed it on to its subtree (``info`` counts what it
    # relayed), and no host answers a wait before 4 s
    wait_for(
        lambda: pool.call(victim, "info")["relayed"] > relayed, timeout=10, what=f"host {victim} to relay the wait"
    )
    os.kill(pid, signal.SIGKILL)
    asking.join(30)
    assert not asking.is_alive()
    res = got["res"]
    assert [i for i, _, e in res if e is not None] == [victim], [(i, e) for i, _, e in res if e is not None]
    assert isinstance(res[victim][2], HostUnreachable)
    assert all(s["state"] == "RUNNING" for i, v, e in res if e is None for s in v)
    pool.ask("kill", [i for i in range(n) if i != victim], app_id=app)
