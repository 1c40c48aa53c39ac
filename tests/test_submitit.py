"""Real submitit with ``cluster="monarch"``: on a monarch_local pool, and on the SLURM lab."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest
import submitit
from submitit.core.utils import FailedJobError, UncompletedJobError

from monarch_torchx.errors import MonarchError
from monarch_torchx.registry import Registry

from .conftest import squeue_ids, torchx, wait_for

pytestmark = pytest.mark.integration


def where(x):
    env = submitit.JobEnvironment()
    print(f"task {env.global_rank} says hi", flush=True)
    return {
        "x": x,
        "rank": env.global_rank,
        "local": env.local_rank,
        "node": env.node,
        "ntasks": env.num_tasks,
        "nodes": env.num_nodes,
        "job_id": env.job_id,
        "hostnames": env.hostnames,
        "host": socket.gethostname(),
        "index": os.environ["MONARCH_TORCHX_HOST_INDEX"],
    }


def boom():
    raise ValueError("the function failed on purpose")


def sleepy(seconds):
    time.sleep(seconds)
    return "woke"


class Resumable(submitit.helpers.Checkpointable):
    """First attempt waits to be checkpointed; the requeued attempt finds the marker and returns."""

    def __call__(self, marker: str):
        p = Path(marker)
        if p.exists():
            return f"resumed after {p.read_text()}"
        p.write_text("checkpoint")
        time.sleep(600)
        return "never"


def _executor(tmp_path, pool, **params):
    ex = submitit.AutoExecutor(folder=str(tmp_path / "logs" / "%j"), cluster="monarch")
    ex.update_parameters(monarch_pool=pool, **params)
    return ex


@pytest.fixture
def local_pool(home, pool_name):
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=2,preload=none")
    return pool_name


def test_submit_result_stdout_and_job_environment(local_pool, tmp_path):
    ex = _executor(tmp_path, local_pool, timeout_min=5)
    job = ex.submit(where, 41)
    r = job.result()
    assert r["x"] == 41 and r["rank"] == 0 and r["ntasks"] == 1 and r["job_id"] == job.job_id
    assert "task 0 says hi" in job.stdout()
    assert job.done() and job.state in ("RUNNING", "COMPLETED")
    wait_for(lambda: job.state == "COMPLETED", what="state COMPLETED")
    assert (tmp_path / "logs" / job.job_id / f"{job.job_id}_0_log.out").exists()
    # a submitit job is an app of the pool like any other
    rec = Registry().get(local_pool)
    assert f"submitit-{job.job_id}" in [a.app_id for a in Registry.list_apps(rec)]


def test_multi_task_jobs_map_array_and_batch_fan_out(local_pool, tmp_path):
    ex = _executor(tmp_path, local_pool, nodes=2, tasks_per_node=2)
    res = ex.submit(where, 1).results()
    assert sorted(r["rank"] for r in res) == [0, 1, 2, 3]
    assert {r["index"] for r in res} == {"0", "1"} and all(r["nodes"] == 2 and r["ntasks"] == 4 for r in res)
    assert sorted((r["node"], r["local"]) for r in res) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    ex.update_parameters(nodes=1, tasks_per_node=1)
    jobs = ex.map_array(where, range(6))
    out = [j.result() for j in jobs]
    assert [o["x"] for o in out] == list(range(6))
    assert {o["index"] for o in out} == {"0", "1"}  # spread over the pool's hosts
    with ex.batch():
        b = [ex.submit(where, i) for i in range(3)]
    assert [j.result()["x"] for j in b] == [0, 1, 2]


def test_a_submission_checks_the_pool_in_the_pass_that_reads_its_load_and_repairs_a_lost_host(
    local_pool, tmp_path, capfd
):
    from monarch_torchx.pool import attach

    pool = attach(local_pool)
    ex = _executor(tmp_path, local_pool, nodes=2)
    before = pool.call(0, "info")["accepted"]
    job = ex.submit(where, 1)
    assert pool.call(0, "info")["accepted"] - before == 3  # the hosts' load (the health check), the launch, this ask
    assert sorted(r["node"] for r in job.results()) == [0, 1]
    victim = pool.hosts[1].pid
    os.kill(victim, signal.SIGKILL)
    wait_for(
        lambda: (
            not os.path.exists(f"/proc/{victim}")
            or open(f"/proc/{victim}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
        ),
        what="the agent to die",
    )
    capfd.readouterr()
    assert sorted(r["x"] for r in ex.submit(where, 2).results()) == [2, 2]  # on both hosts, host 1 repaired
    assert "repairing" in capfd.readouterr().err


def test_a_map_array_starts_while_it_is_submitted_and_is_all_or_nothing(home, local_pool, tmp_path):
    """The first jobs of a map_array run while the rest are still being pickled; a job that cannot
    be pickled fails the whole call, and the jobs already handed to the pool are cancelled."""
    import threading

    from monarch_torchx import history

    ex = _executor(tmp_path, local_pool, timeout_min=5)
    args = [30] * 12 + [threading.Lock()]  # (the 13th cannot be pickled: after the first batch went)
    with pytest.raises(TypeError, match="lock"):
        ex.map_array(sleepy, args)
    rec = Registry().get(local_pool)
    sent = [a.app_id for a in Registry.list_apps(rec) if a.app_id.startswith("submitit-")]
    assert sent  # the first batch was handed over before the 13th was pickled

    def ends() -> list | None:
        found = [e for app_id in sent for e in history.read_ends(rec.path, app_id).values()]
        return found if len(found) == len(sent) else None

    found = wait_for(ends, timeout=30, what="every job already sent to end")
    assert {e.state for e in found} == {"CANCELLED"} and all("its submission failed" in e.msg for e in found), found


def test_failure_carries_the_remote_traceback(local_pool, tmp_path):
    job = _executor(tmp_path, local_pool).submit(boom)
    with pytest.raises(FailedJobError, match="the function failed on purpose") as e:
        job.result()
    assert "Traceback" in str(e.value) and "boom" in str(e.value)
    wait_for(lambda: job.state == "FAILED", what="state FAILED")


def test_cancel(local_pool, tmp_path):
    job = _executor(tmp_path, local_pool).submit(sleepy, 600)
    wait_for(lambda: job.state == "RUNNING", what="running")
    job.cancel()
    wait_for(lambda: job.done(), timeout=20, what="cancelled job to be done")
    assert job.state == "CANCELLED"
    with pytest.raises(UncompletedJobError):
        job.result()


def test_cancel_at_deletion_cancels_the_job_when_it_is_deleted(local_pool, tmp_path):
    import gc

    job = _executor(tmp_path, local_pool).submit(sleepy, 600).cancel_at_deletion()
    wait_for(lambda: job.state == "RUNNING", what="running")  # noqa: F821
    app_id = f"submitit-{job.job_id}"
    del job
    gc.collect()
    from monarch_torchx import apps
    from monarch_torchx.pool import attach

    pool = attach(local_pool)
    wait_for(
        lambda: apps.replica_states(pool, Registry.get_app(pool.record, app_id))[("task", 0)].state == "CANCELLED",
        timeout=20,
        what="the deleted job to be cancelled",
    )
    kept = _executor(tmp_path, local_pool).submit(sleepy, 0)  # without it: deleting the handle leaves the job be
    kept_id = f"submitit-{kept.job_id}"
    del kept
    gc.collect()
    wait_for(
        lambda: apps.replica_states(pool, Registry.get_app(pool.record, kept_id))[("task", 0)].state == "SUCCEEDED",
        timeout=20,
        what="the job kept running",
    )


def test_timeout_signals_then_a_checkpointable_job_is_requeued_into_the_pool(local_pool, tmp_path):
    # timeout_min=1 with signal_delay_s=57: SIGUSR2 after 3 s
    ex = _executor(tmp_path, local_pool, timeout_min=1, monarch_signal_delay_s=57)
    job = ex.submit(sleepy, 600)
    with pytest.raises(FailedJobError, match="timed-out"):
        job.result()
    marker = tmp_path / "marker"
    job = ex.submit(Resumable(), str(marker))
    assert job.result() == "resumed after checkpoint"
    assert f"Requeued job {job.job_id}" in job.stdout()  # our _requeue ran; the agent restarted the task
    from monarch_torchx import apps
    from monarch_torchx.pool import attach

    pool = attach(local_pool)

    def final():  # the result file is written just before the task process exits
        st = apps.replica_states(pool, Registry.get_app(pool.record, f"submitit-{job.job_id}"))[("task", 0)]
        return st if st.state != "RUNNING" else None

    st = wait_for(final, timeout=30, what="the task to exit")
    assert st.attempts == 2 and st.state == "SUCCEEDED"


def test_bad_pool_and_parameters_are_refused(home, tmp_path, local_pool):
    with pytest.raises(MonarchError, match="no pool named 'nope'") as e:
        _executor(tmp_path, "nope").submit(where, 1)
    assert "torchx pool create nope -s monarch_local -cfg hosts=2" in str(e.value)  # the scheduler and its size
    assert "-s monarch_slurm -cfg nodes=2,partition=" in str(e.value)
    with pytest.raises(ValueError, match="unknown parameter"):
        submitit.AutoExecutor(folder=str(tmp_path), cluster="monarch")._executor.update_parameters(bogus=1)
    with pytest.raises(MonarchError, match="nodes=3 but pool"):
        _executor(tmp_path, local_pool, nodes=3).submit(where, 1)


@pytest.mark.usefixtures("slurm_lab")
def test_on_a_warm_slurm_pool(home, pool_name, tmp_path):
    torchx(home, "pool", "create", pool_name, "-s", "monarch_slurm", "-cfg", "nodes=2,preload=none")
    job_id = Registry().get(pool_name).allocation["job_id"]
    ex = _executor(tmp_path, pool_name, nodes=2, tasks_per_node=1)
    res = ex.submit(where, 7).results()
    hosts = {r["host"] for r in res}
    assert len(hosts) == 2 and all(h.startswith("node") for h in hosts)  # two lab nodes
    assert set(res[0]["hostnames"]) == hosts and res[0]["hostnames"] == res[1]["hostnames"]
    ex.update_parameters(nodes=1, timeout_min=1, monarch_signal_delay_s=57)
    assert [j.result()["x"] for j in ex.map_array(where, range(4))] == [0, 1, 2, 3]
    with pytest.raises(FailedJobError, match="on purpose"):
        ex.submit(boom).result()
    marker = tmp_path / "marker"
    assert ex.submit(Resumable(), str(marker)).result() == "resumed after checkpoint"
    # the requeue went back into the pool: same allocation, still running, nothing requeued in SLURM
    assert squeue_ids(f"monarch-{pool_name}") == [job_id]


def second_try(marker: str) -> str:
    """The first attempt leaves a marker and waits; a requeued one finds it and returns."""
    p = Path(marker)
    if p.exists():
        return "second try"
    p.write_text("first")
    time.sleep(600)
    return "never"


def test_a_job_whose_host_is_lost_is_requeued_on_another_host(home, pool_name, tmp_path):
    """As SLURM requeues a job whose node failed: the job's host (its agent killed) is lost, and
    the next poll of the job starts it again on a host with room, where it completes."""
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=3,preload=none,cpus_per_host=1")
    busy = torchx(home, "run", "-s", "monarch_local", "-cfg", f"pool={pool_name}", "utils.sh", "sleep", "600")
    handle = busy.stdout.strip().splitlines()[-1]
    marker = tmp_path / "marker"
    job = _executor(tmp_path, pool_name).submit(second_try, str(marker))
    wait_for(marker.exists, what="the first attempt")
    assert job.state == "RUNNING"  # (asked: its record now says where the pool's queue started it)
    rec = Registry(home).require(pool_name)

    def placed():
        (p,) = Registry.get_app(rec, f"submitit-{job.job_id}").placement
        return p.host_index, p.requeues

    assert placed() == (1, 0)  # (host 0 runs the sleep: its one CPU is taken)
    os.kill(Registry.hosts(rec)[1].pid, signal.SIGKILL)
    with Registry(home).lock(pool_name):  # another run at work on the pool: not now, and not an end either
        assert job.state == "PENDING" and placed() == (1, 0)
    assert job.result() == "second try"
    assert placed() == (2, 1)
    torchx(home, "cancel", handle)
