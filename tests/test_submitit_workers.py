"""submitit's worker mode (``monarch_workers``): each task a call in a kept worker process, on
real monarch_local pools, through real submitit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import submitit
from submitit.core.utils import FailedJobError, UncompletedJobError

from monarch_torchx.errors import MonarchError
from monarch_torchx.submitit_executor import MonarchJob

from .conftest import torchx, wait_for
from .test_submitit import _executor

pytestmark = pytest.mark.integration


def who(x):
    start = time.time()
    env = submitit.JobEnvironment()
    print(f"task {x} out", flush=True)
    print(f"task {x} err", file=sys.stderr, flush=True)
    if x == 7:
        raise ValueError("task seven fails on purpose")
    time.sleep(0.02)  # (long enough for the tasks that run at once to overlap)
    return {"x": x, "pid": os.getpid(), "host": os.environ["MONARCH_TORCHX_HOST_INDEX"], "job_id": env.job_id,
            "start": start, "end": time.time()}  # fmt: skip


def sleepy(seconds):
    time.sleep(seconds)
    return "woke"


def die():
    os._exit(3)


@pytest.fixture
def slots_pool(home, pool_name):
    """Two hosts of two CPUs each: four tasks of one CPU fit at once."""
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=2,preload=submitit,cpus_per_host=2")
    return pool_name


def test_many_tasks_run_as_calls_in_kept_workers_no_more_at_once_than_fit(slots_pool, tmp_path):
    ex = _executor(tmp_path, slots_pool, cpus_per_task=1, monarch_workers=True)
    jobs = ex.map_array(who, range(40))
    out = {}
    for j in jobs:
        try:
            out[j.job_id] = j.result()
        except FailedJobError as e:
            out[j.job_id] = e
    failed = jobs[7]
    assert isinstance(out[failed.job_id], FailedJobError) and "task seven fails on purpose" in str(out[failed.job_id])
    assert "Traceback" in str(out[failed.job_id])
    ok = [out[j.job_id] for j in jobs if j is not failed]
    assert [r["x"] for r in ok] == [x for x in range(40) if x != 7]
    assert all(r["job_id"] == j.job_id for r, j in zip(ok, [j for j in jobs if j is not failed]))
    pids = {r["pid"] for r in ok}
    assert len(pids) <= 4, pids  # the workers were kept: a call each, not a process each
    assert {r["host"] for r in ok} == {"0", "1"}
    # never more at once than the pool's four slots
    edges = sorted([(r["start"], 1) for r in ok] + [(r["end"], -1) for r in ok])
    at_once = max(sum(d for _, d in edges[: i + 1]) for i in range(len(edges)))
    assert at_once <= 4
    assert "task 3 out" in jobs[3].stdout() and "task 3 err" in jobs[3].stderr()
    assert "task 4" not in jobs[3].stdout()  # each job's output in its own files
    wait_for(lambda: failed.state == "FAILED" and jobs[0].state == "COMPLETED", what="the states")


def test_a_queued_task_waits_for_a_worker_and_cancels_and_a_running_one_is_ended(slots_pool, tmp_path):
    ex = _executor(tmp_path, slots_pool, monarch_workers=1)
    first = ex.submit(sleepy, 600)
    second = ex.submit(sleepy, 0)
    third = ex.submit(sleepy, 0)
    wait_for(lambda: first.state == "RUNNING", what="the first task")
    assert second.state == "PENDING" and third.state == "PENDING"
    second.cancel()
    assert second.state == "CANCELLED"
    first.cancel()  # (its worker is ended: a call cannot be interrupted)
    assert first.state == "CANCELLED"
    assert third.result() == "woke"  # on a worker started in the ended one's place
    with pytest.raises(UncompletedJobError):
        second.result()


def test_a_task_past_its_timeout_or_whose_worker_dies_fails_and_the_rest_go_on(slots_pool, tmp_path):
    ex = _executor(tmp_path, slots_pool, monarch_workers=2)
    ex._executor.update_parameters(timeout_min=0.05)  # 3 s (AutoExecutor takes whole minutes only)
    hung, dead = ex.submit(sleepy, 600), ex.submit(die)
    after = [ex.submit(sleepy, 0) for _ in range(3)]
    assert [j.result() for j in after] == ["woke"] * 3
    assert not after[0].paths.stdout.exists()  # (a task that prints nothing makes no log file)
    wait_for(lambda: hung.state == "FAILED" and dead.state == "FAILED", timeout=20, what="both to fail")
    from monarch_torchx.pool import attach
    from monarch_torchx.task_groups import TaskStatus

    meta = json.loads(next((tmp_path / "logs").glob(f"*/{hung.job_id.split('_')[0]}_monarch.json")).read_text())
    got = attach(slots_pool).call(0, "tasks.status", group_id=meta["group"], task_ids=[hung.job_id, dead.job_id])
    msgs = [TaskStatus.from_wire(s).msg for s in got]
    assert "timed out after 3 s" in msgs[0] and "ended while it ran" in msgs[1], msgs
    # a worker that cannot start (here: no credentials where it looks) fails its tasks, with why
    broken = _executor(tmp_path, slots_pool, monarch_workers=True, monarch_env={"MONARCH_TORCHX_STATE_DIR": "/nowhere"})
    job = broken.submit(sleepy, 0)
    wait_for(lambda: job.state == "FAILED", timeout=20, what="the task of a broken worker to fail")
    meta = json.loads(next((tmp_path / "logs").glob(f"*/{job.job_id.split('_')[0]}_monarch.json")).read_text())
    got = attach(slots_pool).call(0, "tasks.status", group_id=meta["group"], task_ids=[job.job_id])
    assert "exited before it took a task" in TaskStatus.from_wire(got[0]).msg


CLIENT = """
import json, time, submitit
def sleepy(seconds):
    time.sleep(seconds)
    return "woke"
ex = submitit.AutoExecutor(folder={folder!r}, cluster="monarch")
ex.update_parameters(monarch_pool={pool!r}, monarch_workers=1)
jobs = [ex.submit(sleepy, 0), ex.submit(sleepy, 0), ex.submit(sleepy, 600), ex.submit(sleepy, 0)]
print(json.dumps([j.job_id for j in jobs]))
"""


def test_tasks_of_a_client_that_exited_still_run_and_pool_stop_cancels_the_rest(home, slots_pool, tmp_path):
    folder = str(tmp_path / "logs" / "%j")
    code = CLIENT.format(folder=folder, pool=slots_pool)
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    ids = json.loads(got.stdout.strip().splitlines()[-1])  # (the client has exited)
    jobs = [MonarchJob(folder=folder, job_id=i, tasks=[0]) for i in ids]
    assert [jobs[0].result(), jobs[1].result()] == ["woke", "woke"]
    wait_for(lambda: jobs[2].state == "RUNNING", what="the long task")
    assert jobs[3].state == "PENDING"
    torchx(home, "pool", "stop", slots_pool)
    assert jobs[2].state == "CANCELLED" and jobs[3].state == "CANCELLED"  # (read from the stopped pool's files)
    with pytest.raises(UncompletedJobError):
        jobs[3].result()


def test_bad_worker_parameters_are_refused_in_one_line(slots_pool, tmp_path):
    with pytest.raises(ValueError, match="workers='many': True"):
        _executor(tmp_path, slots_pool, monarch_workers="many")
    with pytest.raises(MonarchError, match="one-task jobs"):
        _executor(tmp_path, slots_pool, monarch_workers=True, tasks_per_node=2).submit(sleepy, 0)
    with pytest.raises(MonarchError, match="more than any host of pool .* the biggest, host 0, has"):
        _executor(tmp_path, slots_pool, monarch_workers=True, mem_gb=100_000).submit(sleepy, 0)


def test_the_tasks_outlive_a_lost_host_0_and_run_when_the_next_submit_repairs_it(slots_pool, tmp_path):
    from monarch_torchx.pool import attach

    ex = _executor(tmp_path, slots_pool, monarch_workers=1)
    first, second = ex.submit(sleepy, 600), ex.submit(sleepy, 0)
    wait_for(lambda: first.state == "RUNNING", what="the first task")
    os.kill(attach(slots_pool).hosts[0].pid, signal.SIGKILL)  # host 0 holds the group
    assert second.state == "UNKNOWN"  # (while host 0 is down: its holder does not answer)
    third = ex.submit(sleepy, 0)  # repairs host 0, whose new agent reads the group back
    first.cancel()  # (it runs again: at least once)
    assert [second.result(), third.result()] == ["woke", "woke"]
    assert first.state == "CANCELLED"


def test_a_job_waited_on_while_host_0_is_lost_repairs_the_pool_itself(slots_pool, tmp_path, capfd):
    from monarch_torchx.pool import attach

    ex = _executor(tmp_path, slots_pool, monarch_workers=1)
    first, second = ex.submit(sleepy, 2), ex.submit(sleepy, 0)
    wait_for(lambda: first.state == "RUNNING", what="the first task")
    os.kill(attach(slots_pool).hosts[0].pid, signal.SIGKILL)  # host 0 holds the group
    assert second.state == "UNKNOWN"
    # nothing else is submitted: the waiter itself has host 0 repaired, and the group is read back
    assert second.result() == "woke"
    assert "repairing pool" in capfd.readouterr().err
    assert first.result() == "woke"  # (it ran again: at least once)


def test_a_long_lived_pool_forgets_its_oldest_finished_groups_and_their_jobs_still_read(
    home, pool_name, tmp_path, monkeypatch
):
    from monarch_torchx.registry import Registry

    monkeypatch.setenv("MONARCH_TORCHX_KEEP_ENDED_TASKS", "3")  # (the pool's agents read it)
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=1,preload=submitit,cpus_per_host=2")
    old = _executor(tmp_path, pool_name, monarch_workers=True).map_array(who, [1, 7])
    assert old[0].result()["x"] == 1
    with pytest.raises(FailedJobError):
        old[1].result()
    new = _executor(tmp_path, pool_name, monarch_workers=True).map_array(who, [4, 5])
    assert [j.result()["x"] for j in new] == [4, 5]
    tasks_dir = Path(Registry().get(pool_name).state_dir) / "tasks"
    # 4 ended tasks are more than 3: the older group goes (memory and files), the newer stays
    wait_for(lambda: len(list(tasks_dir.glob("*.json"))) == 1, timeout=20, what="the older group forgotten")
    assert not list(tasks_dir.glob(f"{_group_of(tmp_path, old[0])}.*"))
    # its jobs read as they ended, from the results they left in submitit's folder
    assert [j.state for j in old] == ["COMPLETED", "FAILED"]
    assert [j.state for j in new] == ["COMPLETED", "COMPLETED"]


def _group_of(tmp_path, job) -> str:
    meta = next((tmp_path / "logs").glob(f"*/{job.job_id.split('_')[0]}_monarch.json"))
    return json.loads(meta.read_text())["group"]
