"""Real Monarch (torchmonarch) on warm pools: Monarch's ping-pong, unchanged but for its job object.

Each run is its own process (Monarch's client context is one per process), as a user runs it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from monarch_torchx import apps, procfs
from monarch_torchx.pool import attach
from monarch_torchx.registry import MONARCH_JOBS_DIR, Registry

from .conftest import cli_env, wait_for

pytestmark = pytest.mark.integration

pytest.importorskip("monarch.actor", reason="torchmonarch is not installed (pip install 'monarch-torchx[monarch]')")

ROOT = Path(__file__).resolve().parents[1]
PINGPONG = ROOT / "examples" / "monarch_pingpong.py"


def _pingpong(home: Path, cwd: Path, *args: str, timeout: float = 240) -> str:
    res = subprocess.run(
        [sys.executable, "-u", str(PINGPONG), "--trust-local-users", *args],
        env=cli_env(home),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr[-4000:]}"
    return res.stdout


def _answers(out: str) -> list:
    return re.findall(r"^(Ping|Pong) \(pid (\d+), host (\S+)\) got '(.*)': (\d) pings$", out, re.M)


def _worker_apps(home: Path, pool: str) -> list:
    rec = Registry(home).require(pool)
    return [a for a in Registry.list_apps(rec) if a.name == "monarch-workers"]


def _run_twice(home: Path, cwd: Path, pool: str, *args: str) -> tuple:
    first = _answers(_pingpong(home, cwd, "--pool", pool, *args))
    assert sorted(a[0] for a in first) == ["Ping", "Ping", "Pong", "Pong"], first
    assert [a[4] for a in first] == ["1", "1", "2", "2"]
    rec = Registry(home).require(pool)
    agents = [(h.pid, h.incarnation) for h in Registry.hosts(rec)]
    workers = _worker_apps(home, pool)
    assert len(workers) == 1

    second = _answers(_pingpong(home, cwd, "--pool", pool, *args))
    assert [a[4] for a in second] == ["1", "1", "2", "2"]  # new actors, on the same warm workers
    assert [(h.pid, h.incarnation) for h in Registry.hosts(Registry(home).require(pool))] == agents
    assert [a.app_id for a in _worker_apps(home, pool)] == [workers[0].app_id]  # no worker started again
    return first, second


def test_monarchs_pingpong_runs_twice_on_a_local_pool_and_the_second_run_reuses_the_workers(home, pool_name, tmp_path):
    first, second = _run_twice(home, tmp_path, pool_name)
    assert len({a[1] for a in first}) == 2  # two procs, one per host
    tls = Registry(home).state_dir(pool_name) / MONARCH_JOBS_DIR
    (job_dir,) = tls.iterdir()
    assert {p.name for p in job_dir.iterdir()} == {"ca.pem", "cert.pem", "key.pem"}
    assert all(p.stat().st_mode & 0o077 == 0 for p in [tls, job_dir, *job_dir.iterdir()])

    cache = tmp_path / ".monarch" / "job_state.pkl"
    assert cache.stat().st_mode & 0o777 == 0o600
    cache.chmod(0o666)  # a cache others could have written is never loaded (a pickle runs code)
    res = subprocess.run(
        [sys.executable, "-u", str(PINGPONG), "--trust-local-users", "--pool", pool_name],
        env=cli_env(home),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode != 0 and "refusing to load the cached job" in res.stderr
    cache.chmod(0o600)

    # kill(): the workers end, their keys go, the pool stays warm for the next job
    (arec,) = _worker_apps(home, pool_name)
    pids = [s.pid for s in apps.replica_states(attach(pool_name), arec).values()]
    assert len(pids) == 2 and all(procfs.alive(p) for p in pids)
    # a worker's address names its service proc: not on its command line, which anyone can read
    assert not [p for p in pids if b"tls://" in Path(f"/proc/{p}/cmdline").read_bytes()]
    from monarch_torchx.monarch_shared import monarch_log_dir

    assert monarch_log_dir().stat().st_mode & 0o077 == 0  # Monarch's own log: in a dir only we can enter
    _pingpong(home, tmp_path, "--pool", pool_name, "--kill")
    assert not list(tls.iterdir())
    wait_for(lambda: not any(procfs.alive(p) for p in pids), timeout=15, what="the workers to end")
    rec = Registry(home).require(pool_name)
    assert all(h is not None for h in Registry.hosts(rec))
    # a new run after kill() starts new workers on the same pool
    again = _answers(_pingpong(home, tmp_path, "--pool", pool_name))
    assert len(again) == 4 and len(_worker_apps(home, pool_name)) == 2
    # pool stop: no worker's key dir is left on the node (a worker killed in Monarch's runtime
    # code runs no signal handler, so its agent removes what it left)
    from monarch_torchx.pool import stop_pool
    from monarch_torchx.private import node_temp_root

    stop_pool(pool_name, Registry(home))
    assert not list((node_temp_root() / "monarch").glob(f"{pool_name}-*"))


def test_a_client_without_the_jobs_certificate_is_refused(home, pool_name, tmp_path):
    _pingpong(home, tmp_path, "--pool", pool_name)
    # a second client, with a CA and certificate of its own, dials the same workers
    probe = tmp_path / "probe.py"
    probe.write_text(f"""
import os, pickle, sys
sys.path.insert(0, {str(ROOT)!r})
from monarch_torchx.credentials import new_monarch_tls
from monarch_torchx.monarch_worker import install_tls
from monarch_torchx.private import private_dir
from pathlib import Path
os.environ.update(install_tls(new_monarch_tls("intruder", ["127.0.0.1"]), private_dir(Path({str(tmp_path)!r}) / "x")))
os.environ["HYPERACTOR_MESH_ATTACH_CONFIG_TIMEOUT"] = "5s"
from monarch.actor import Actor, attach_to_workers, enable_transport, endpoint
job = pickle.load(open(".monarch/job_state.pkl", "rb"))
enable_transport("tls://127.0.0.1:0")
class Probe(Actor):
    @endpoint
    def hi(self) -> int:
        return os.getpid()
hosts = attach_to_workers(name="hosts", ca="trust_all_connections", workers=job._workers)
try:
    print("ANSWERED", hosts.spawn_procs(per_host={{"procs": 1}}).spawn("p", Probe).hi.call().get(timeout=30))
except Exception as e:
    print("REFUSED", type(e).__name__)
""")
    res = subprocess.run(
        [sys.executable, "-u", str(probe)], env=cli_env(home), cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert "REFUSED" in res.stdout and "ANSWERED" not in res.stdout, res.stdout + res.stderr[-2000:]
    # the job's own client still gets in
    assert len(_answers(_pingpong(home, tmp_path, "--pool", pool_name))) == 4


@pytest.mark.usefixtures("slurm_lab")
def test_monarchs_pingpong_runs_across_two_slurm_nodes_twice_with_one_allocation(home, pool_name, tmp_path):
    first, second = _run_twice(
        home, tmp_path, pool_name, "--scheduler", "monarch_slurm", "--cfg", "partition=debug,time=00:20:00,preload=none"
    )
    assert len({a[2] for a in first}) == 2  # two nodes
    assert {a[2] for a in second} == {a[2] for a in first}


def test_an_existing_pool_is_used_as_it_is_and_one_too_small_is_refused(home, pool_name, tmp_path):
    from .conftest import torchx

    torchx(home, "pool", "create", pool_name, "-s", "monarch_local", "-cfg", "hosts=3,preload=none")
    agents = [(h.pid, h.incarnation) for h in Registry.hosts(Registry(home).require(pool_name))]
    assert len(_answers(_pingpong(home, tmp_path, "--pool", pool_name))) == 4  # on hosts 0 and 1 of the 3
    assert [(h.pid, h.incarnation) for h in Registry.hosts(Registry(home).require(pool_name))] == agents

    small = f"{pool_name}s"
    torchx(home, "pool", "create", small, "-s", "monarch_local", "-cfg", "hosts=1,preload=none")
    other = tmp_path / "other"  # no cached job here
    other.mkdir()
    res = subprocess.run(
        [sys.executable, "-u", str(PINGPONG), "--trust-local-users", "--pool", small],
        env=cli_env(home),
        cwd=other,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode != 0 and f"pool {small!r} has 1 host(s) and the job's meshes need 2" in res.stderr
    assert len(Registry.hosts(Registry(home).require(small))) == 1  # not replaced


def test_warm_pool_job_is_refused_in_one_line_unless_the_user_trusts_every_local_user(home, pool_name, tmp_path):
    """torchmonarch 0.7.0 serves every host and client on an abstract Unix socket that nothing
    authenticates: on a machine others can log into, that is code run as you. Refused, saying so."""
    res = subprocess.run(
        [sys.executable, "-u", str(PINGPONG), "--pool", pool_name],
        env=cli_env(home),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode != 0 and "unauthenticated abstract Unix socket" in res.stderr, res.stderr[-2000:]
    assert "trust_local_users=True" in res.stderr and Registry(home).get(pool_name) is None  # nothing started


def test_monarchs_log_dir_is_made_ours_and_private_or_refused(monkeypatch, tmp_path):
    from monarch_torchx import monarch_shared
    from monarch_torchx.errors import MonarchError

    d = tmp_path / "user"
    monkeypatch.setattr(monarch_shared, "monarch_log_dir", lambda: d)
    assert monarch_shared.private_monarch_log_dir() == d and d.stat().st_mode & 0o777 == 0o700
    d.chmod(0o755)  # one of ours that Monarch made open: closed
    monarch_shared.private_monarch_log_dir()
    assert d.stat().st_mode & 0o777 == 0o700
    os.chown(d, 65534, 65534)  # another user made it first
    with pytest.raises(MonarchError, match="belongs to uid 65534: Monarch writes its log there"):
        monarch_shared.private_monarch_log_dir()
    d.rmdir()
    d.symlink_to(tmp_path)
    with pytest.raises(MonarchError, match="symlink"):
        monarch_shared.private_monarch_log_dir()
