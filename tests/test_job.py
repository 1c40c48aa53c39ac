"""monarch_torchx.job: Monarch's job API (SlurmJob, ProcessJob, LocalJob) over warm pools."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from monarch_torchx.errors import MonarchError
from monarch_torchx.job import JobState, LocalJob, ProcessJob, SlurmJob, job_load
from monarch_torchx.registry import Registry
from tests.fixtures.actors import Counter

pytestmark = pytest.mark.integration


def _agents(name: str):
    return [h.pid for h in Registry.hosts(Registry().require(name))]


def test_process_job_meshes_reuse_replace_and_kill(home, tmp_path):
    """Each mesh is a slice of one warm pool; a second job of the same spec (a new process's,
    through the cached state) reuses the pool; another spec replaces it; kill() stops it."""
    cache = str(tmp_path / ".monarch" / "job_state.pkl")
    job = ProcessJob({"trainers": 2, "loaders": 1})
    state = job.state(cached_path=cache)
    assert isinstance(state, JobState) and job.active and job.apply_id
    assert state.trainers.sizes == {"hosts": 2} and state.loaders.sizes == {"hosts": 1}
    with pytest.raises(AttributeError, match="meshes: trainers, loaders"):
        state.critics  # noqa: B018
    procs = state.trainers.spawn_procs(per_host={"gpus": 2})
    counters = procs.spawn("c", Counter)
    assert list(counters.incr.call(1).get().values()) == [1] * 4
    procs.stop().get()
    name = job._pool()[1]
    pids = _agents(name)
    assert oct(os.stat(cache).st_mode & 0o777) == "0o600" and job_load(cache).active
    # the next run of the script: a new process, the same spec: the same hosts, nothing created
    code = textwrap.dedent(f"""
        from monarch_torchx.job import ProcessJob
        s = ProcessJob({{"trainers": 2, "loaders": 1}}).state(cached_path={cache!r})
        print(s.loaders.sizes)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "{'hosts': 1}" in res.stdout and _agents(name) == pids
    bigger = ProcessJob({"trainers": 3, "loaders": 1})  # another spec: the cached job cannot run it
    other = bigger.state(cached_path=cache)
    assert other.trainers.sizes == {"hosts": 3}
    assert bigger._pool()[1] == name and len(_agents(name)) == 4 and set(_agents(name)).isdisjoint(pids)
    bigger.kill()
    assert Registry().get(bigger._pool()[1]) is None and not bigger.active
    # what this process asks of "its" pool afterwards goes to this host, not to the killed job's pool
    from monarch_torchx.actor import get_or_spawn_controller

    counter = get_or_spawn_controller("after-kill", Counter).get(timeout=60)
    assert counter.incr.call_one(2).get(timeout=30) == 2
    from monarch_torchx.pool import stop_pool

    stop_pool("local")


def test_a_process_jobs_env_reaches_its_procs_and_does_not_decide_reuse(home, tmp_path):
    """As Monarch's ``ProcessJob(meshes, env=...)``: every proc spawned on the job's hosts gets the
    environment (its workers' there); a job that differs only in env reuses the running one."""
    cache = str(tmp_path / "job_state.pkl")
    state = ProcessJob({"trainers": 1}, env={"JOB_ENV": "first"}).state(cached_path=cache)
    procs = state.trainers.spawn_procs(per_host={"gpus": 2})
    assert list(procs.spawn("c", Counter).env.call("JOB_ENV").get().values()) == ["first", "first"]
    procs.stop().get()
    name = ProcessJob({"trainers": 1})._pool()[1]
    pids = _agents(name)
    again = ProcessJob({"trainers": 1}, env={"JOB_ENV": "second"})
    procs = again.state(cached_path=cache).trainers.spawn_procs()
    assert list(procs.spawn("c", Counter).env.call("JOB_ENV").get().values()) == ["second"]
    assert _agents(name) == pids  # the same hosts: env is applied where procs are spawned
    procs.stop().get()
    again.kill()


def test_local_job_is_this_host(home):
    state = LocalJob(hosts=("trainers", "critics")).state(cached_path=None)
    assert state.trainers.pool == state.critics.pool == "local"


def test_unsupported_arguments_say_so_in_one_line(tmp_path):
    for make in (
        lambda: SlurmJob({"a": 1}, slurm_args=["--foo"]),
        lambda: SlurmJob({"a": 1}, ntasks_per_node=2),
        lambda: SlurmJob({"a": 1}, attach_to="tcp://x:1"),
    ):
        with pytest.raises(MonarchError):
            make()
    with pytest.raises(ValueError, match="positive number of hosts"):
        ProcessJob({"a": 0})
    with pytest.raises(ValueError, match="strings to strings"):
        ProcessJob({"a": 1}, env={"A": 1})
    bad = tmp_path / "job_state.pkl"
    bad.write_bytes(b"not a pickle")
    bad.chmod(0o666)
    with pytest.raises(MonarchError, match="others can write it"):
        ProcessJob({"a": 1}).state(cached_path=str(bad))


@pytest.mark.usefixtures("slurm_lab")
def test_slurm_job_reuses_its_allocation(home, tmp_path):
    """SlurmJob on the real lab: one allocation for the meshes; a second state() of the same spec,
    from a new process, reuses it (no new sbatch); kill() releases it."""
    from tests.conftest import squeue_ids

    cache = str(tmp_path / "job_state.pkl")
    job = SlurmJob(
        meshes={"trainers": 2}, job_name=f"j{os.getpid()}", partition="debug", time_limit="00:30:00", exclusive=False
    )
    state = job.state(cached_path=cache)
    procs = state.trainers.spawn_procs(per_host={"procs": 1})
    hostnames = procs.spawn("c", Counter).env.call("SLURMD_NODENAME").get(timeout=60)
    assert len(set(hostnames.values())) == 2  # two nodes
    procs.stop().get()
    rec = Registry().require(job._pool()[1])
    jobs = squeue_ids(f"monarch-{rec.name}")
    assert jobs == [rec.allocation["job_id"]]
    code = textwrap.dedent(f"""
        from monarch_torchx.job import SlurmJob
        job = SlurmJob(meshes={{"trainers": 2}}, job_name={job.job_name!r}, partition="debug",
                       time_limit="00:30:00", exclusive=False)
        print(job.state(cached_path={cache!r}).trainers.sizes)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert squeue_ids(f"monarch-{rec.name}") == jobs  # the same allocation
    job.kill()
    assert Registry().get(rec.name) is None


def test_hosts_from_config_is_a_warm_two_host_pool_made_once(home):
    """As Monarch's stand-in for its getting-started example: 2 hosts on this machine, here a warm
    pool that a second call (a second run of the script) reuses."""
    from monarch_torchx.actor import hosts_from_config
    from monarch_torchx.pool import stop_pool

    hosts = hosts_from_config("MONARCH_HOSTS")
    assert hosts.sizes == {"hosts": 2} and hosts.pool == "config-monarch_hosts"
    pids = _agents(hosts.pool)
    procs = hosts.spawn_procs(per_host={"gpus": 1})
    assert list(procs.spawn("c", Counter).incr.call(1).get().values()) == [1, 1]
    procs.stop().get()
    assert hosts_from_config("MONARCH_HOSTS").pool == hosts.pool and _agents(hosts.pool) == pids
    stop_pool(hosts.pool)
