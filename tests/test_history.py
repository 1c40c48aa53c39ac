"""Issue 38: what an app did is never lost or misreported once its agents are gone.

A finished app's state, logs and listing outlive the pool's agents (idle timeout, `scancel`,
`pool stop`, a restarted host); an app is FAILED only once nothing of it runs; the submitting
shell's environment reaches the replicas; `--wait` and a reused SLURM pool say what they do.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from monarch_torchx import history
from monarch_torchx.registry import Registry

from .conftest import BIN, agent_pids, cli_env, torchx, wait_for

pytestmark = pytest.mark.integration


def _handle(res) -> str:
    return res.stdout.strip().splitlines()[-1]


def _status(home, handle) -> dict:
    """State, message and each replica's state, from `torchx status`."""
    out = torchx(home, "status", handle).stdout
    lines = [line.strip() for line in out.splitlines()]
    state = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("State:"))
    msg = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("Msg:"))
    replicas = {
        line.lstrip("*").split(":")[0]: line.split(":")[1].split()[0] for line in lines if "[" in line and "]:" in line
    }
    return {"state": state, "msg": msg, "replicas": replicas}


def test_a_finished_app_keeps_its_state_logs_and_listing_after_idle_out_stop_and_a_new_pool(home, pool_name, tmp_path):
    h = _handle(
        torchx(
            home,
            "run",
            "-s",
            "monarch_local",
            "-cfg",
            f"pool={pool_name},hosts=2,preload=none,idle_timeout=3s",
            "utils.sh",
            "--num_replicas",
            "2",
            "echo",
            "hello from ${replica_id}",
            cwd=tmp_path,
        )
    )
    wait_for(lambda: _status(home, h)["state"] == "SUCCEEDED", what="the app to succeed")
    wait_for(lambda: not agent_pids(home), timeout=30, what="the pool to idle out")
    st = _status(home, h)  # was: FAILED, "host 0 ... is lost"
    assert st["state"] == "SUCCEEDED" and st["replicas"] == {"sh[0]": "SUCCEEDED", "sh[1]": "SUCCEEDED"}, st
    assert sorted(torchx(home, "log", h).stdout.splitlines()) == ["sh/0 hello from 0", "sh/1 hello from 1"]
    assert sorted(torchx(home, "log", "--tail", h).stdout.splitlines()) == ["sh/0 hello from 0", "sh/1 hello from 1"]

    torchx(home, "pool", "stop", pool_name)
    st = _status(home, h)  # was: "no app"
    assert st["state"] == "SUCCEEDED", st
    assert torchx(home, "log", f"{h}/sh/1").stdout.splitlines() == ["sh/1 hello from 1"]
    assert sorted(torchx(home, "log", "--tail", h).stdout.splitlines()) == ["sh/0 hello from 0", "sh/1 hello from 1"]
    listed = [line.split() for line in torchx(home, "list", "-s", "monarch_local").stdout.splitlines()]
    assert [h, "SUCCEEDED"] in [row[:1] + row[-1:] for row in listed], listed

    # a new pool of the same name: the earlier app still answers, once, as it ended
    h2 = _handle(
        torchx(
            home,
            "run",
            "-s",
            "monarch_local",
            "-cfg",
            f"pool={pool_name},hosts=1,preload=none",
            "utils.sh",
            "true",
            cwd=tmp_path,
        )
    )
    wait_for(lambda: _status(home, h2)["state"] == "SUCCEEDED", what="the second app")
    assert _status(home, h)["state"] == "SUCCEEDED"
    handles = [row[0] for row in listed if row and row[0].startswith("monarch_local://")]
    assert handles.count(h) == 1


def test_a_recorded_end_outlives_a_restarted_host(home, pool_name, tmp_path):
    """Was: "host 0 was lost and restarted while the replica ran" for an app that had ended."""
    h = _handle(
        torchx(
            home,
            "run",
            "-s",
            "monarch_local",
            "-cfg",
            f"pool={pool_name},hosts=1,preload=none",
            "utils.sh",
            "echo",
            "done",
            cwd=tmp_path,
        )
    )
    wait_for(lambda: _status(home, h)["state"] == "SUCCEEDED", what="the app")
    before = Registry.hosts(Registry(home).get(pool_name))[0]
    os.kill(before.pid, signal.SIGKILL)
    h2 = _handle(
        torchx(home, "run", "-s", "monarch_local", "-cfg", f"pool={pool_name}", "utils.sh", "true", cwd=tmp_path)
    )  # repairs host 0
    wait_for(lambda: _status(home, h2)["state"] == "SUCCEEDED", what="a run on the repaired pool")
    assert Registry.hosts(Registry(home).get(pool_name))[0].incarnation != before.incarnation
    assert _status(home, h)["state"] == "SUCCEEDED"
    assert torchx(home, "log", h).stdout.splitlines() == ["sh/0 done"]


def test_an_app_reads_failed_only_once_its_other_replicas_are_ended(home, pool_name, tmp_path):
    """Was: FAILED with sh[1] still RUNNING, and `torchx cancel` then did nothing (a FAILED app is
    terminal to TorchX), leaving the replica running."""
    h = _handle(
        torchx(
            home,
            "run",
            "-s",
            "monarch_local",
            "-cfg",
            f"pool={pool_name},hosts=2,preload=none",
            "utils.sh",
            "--num_replicas",
            "2",
            "python",
            "-c",
            "import sys, time; time.sleep(2); sys.exit(3) if ${replica_id} == 0 else time.sleep(120)",
            cwd=tmp_path,
        )
    )
    rec = Registry(home).get(pool_name)

    def sleeper_running() -> bool:
        from monarch_torchx.pool import Pool

        return any(s["state"] == "RUNNING" for s in Pool(rec, Registry(home)).call(1, "list"))

    wait_for(sleeper_running, what="replica 1 to run")
    st = wait_for(lambda: (s := _status(home, h))["state"] != "RUNNING" and s, what="replica 0 to fail")
    assert st["state"] == "FAILED" and st["replicas"] == {"sh[0]": "FAILED", "sh[1]": "CANCELLED"}, st
    assert "sh/1: ended because sh/0 failed" in st["msg"] and "exited with code 3" in st["msg"]
    assert not sleeper_running()
    res = torchx(home, "cancel", h)
    assert res.returncode == 0


def test_the_submitting_shells_environment_reaches_the_replicas(home, pool_name, tmp_path):
    """Was: dropped on monarch_local (TorchX's local_cwd and slurm pass it on)."""
    env = {**cli_env(home), "HF_HOME": str(tmp_path / "hf"), "CUDA_VISIBLE_DEVICES": "3", "OMP_NUM_THREADS": "1"}
    code = (
        "import os, sys; print(os.environ.get('HF_HOME'), os.environ.get('CUDA_VISIBLE_DEVICES'), "
        "os.environ['MONARCH_TORCHX_POOL'], os.path.dirname(sys.executable) == os.environ['PATH'].split(':')[0])"
    )
    res = subprocess.run(
        [
            str(BIN / "torchx"),
            "run",
            "--wait",
            "-s",
            "monarch_local",
            "-cfg",
            f"pool={pool_name},hosts=1,preload=none",
            "utils.python",
            "-c",
            code,
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    h = _handle(res)
    assert torchx(home, "log", h).stdout.splitlines() == [f"python/0 {tmp_path / 'hf'} 3 {pool_name} True"]
    assert res.stderr.count("OMP_NUM_THREADS, read as Python starts") == 1
    again = subprocess.run(
        [str(BIN / "torchx"), "run", "-s", "monarch_local", "-cfg", f"pool={pool_name}", "utils.sh", "true"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0 and "read as Python starts" not in again.stderr  # (said once per pool)
    dry = torchx(home, "run", "--dryrun", "-s", "monarch_local", "-cfg", f"pool={pool_name}", "utils.sh", "true")
    assert "environment: this shell's" in dry.stdout + dry.stderr


def test_recorded_ends_are_read_back_and_stopped_pools_are_pruned_after_the_retention(tmp_path, monkeypatch):
    state = tmp_path / "pools" / "p"
    end = history.ReplicaEnd("app-1", "trainer/x", 0, "SUCCEEDED", 0, "", 1, 1.0, 2.0, "node1")
    history.record_end(state, end)
    history.record_end(state, history.ReplicaEnd("app-1", "trainer/x", 1, "FAILED", 2, "exited with code 2"))
    (history.end_path(state, "app-1", "other", 0)).write_text("{not json")  # damaged: skipped, not fatal
    ends = history.read_ends(state, "app-1")
    assert ends[("trainer/x", 0)] == end and ends[("trainer/x", 1)].state == "FAILED" and len(ends) == 2
    assert oct(history.end_path(state, "app-1", "trainer/x", 0).stat().st_mode & 0o777) == "0o600"
    history.forget_end(state, "app-1", "trainer/x", 1)
    assert list(history.read_ends(state, "app-1")) == [("trainer/x", 0)]
    with pytest.raises(ValueError):
        history.ReplicaEnd.from_json({"app_id": "a", "role": "r", "replica_id": 0, "state": "RUNNING"})

    stopped = tmp_path / "stopped"
    old, live = tmp_path / "old", tmp_path / "live"
    for d in (old, live):
        (d / "apps").mkdir(parents=True)
    history.remember_stopped(stopped, "p", "monarch_local", old)
    history.remember_stopped(stopped, "p", "monarch_local", live)
    assert [p.state_dir for p in history.stopped_pools(stopped, "p")] == [str(live), str(old)]
    monkeypatch.setenv(history.HISTORY_DAYS_ENV, "1")
    assert history.prune_stopped(stopped, [live]) == []  # all new
    assert history.prune_stopped(stopped, [live], now=time.time() + 2 * 86400) == [old]
    assert not old.exists() and live.exists()
    assert [p.state_dir for p in history.stopped_pools(stopped, "p")] == [str(live)]


@pytest.mark.usefixtures("slurm_lab")
def test_on_slurm_finished_apps_outlive_scancel_and_a_short_pool_is_reused_with_a_warning(home, pool_name):
    from .test_slurm import _job

    h = _handle(
        torchx(
            home,
            "run",
            "-s",
            "monarch_slurm",
            "-cfg",
            f"pool={pool_name},nodes=1,preload=none,time=5",
            "utils.sh",
            "echo",
            "on slurm",
        )
    )
    wait_for(lambda: _status(home, h)["state"] == "SUCCEEDED", what="the app on SLURM")
    dry = torchx(
        home, "run", "--dryrun", "-s", "monarch_slurm", "-cfg", f"pool={pool_name},time=02:00:00", "utils.sh", "true"
    )
    assert "less than time=02:00:00 asks" in dry.stdout + dry.stderr  # was: reused without a word
    res = torchx(home, "run", "-s", "monarch_slurm", "-cfg", f"pool={pool_name},time=02:00:00", "utils.sh", "true")
    assert "warning: pool" in res.stderr and "less than time=02:00:00" in res.stderr
    job = _job(home, pool_name)
    subprocess.run(["scancel", job], check=True)
    wait_for(lambda: not agent_pids(home), timeout=60, what="the allocation's agents to end")
    st = _status(home, h)  # was: FAILED, "allocation N is CANCELLED"
    assert st["state"] == "SUCCEEDED", st
    assert torchx(home, "log", h).stdout.splitlines() == ["sh/0 on slurm"]
    summary = json.loads(torchx(home, "pool", "status", pool_name, "--json").stdout)
    assert summary["state"] == "stopped"


def _double(x):
    return 2 * x


def test_a_completed_submitit_job_stays_completed_after_its_pool_is_stopped(home, pool_name, tmp_path):
    """Was: FAILED (the pool's record was gone, so the job read as lost)."""
    import submitit

    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=1,preload=none")
    ex = submitit.AutoExecutor(folder=str(tmp_path / "logs" / "%j"), cluster="monarch")
    ex.update_parameters(monarch_pool=pool_name)
    job = ex.submit(_double, 21)
    assert job.result() == 42
    torchx(home, "pool", "stop", pool_name)
    assert job.state == "COMPLETED" and job.result() == 42


FAILS_ONCE = """\
import os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
if dist.get_rank() == 1 and restart == "0":
    sys.exit(5)
dist.barrier()
print("ok", dist.get_rank(), "after restart", restart, flush=True)
"""


def test_max_retries_of_a_warm_ddp_restart_every_node_together(home, pool_name, tmp_path):
    """Was: the failed node alone was retried by its agent, met a rendezvous that was gone, and the
    other node failed with "node 1 of the role stopped answering ... its host may be lost"."""
    (tmp_path / "train.py").write_text(FAILS_ONCE)
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
        "--max_retries",
        "1",
        "--script",
        "train.py",
        cwd=tmp_path,
    )
    assert "--max_retries 1: all its nodes restart together" in dry.stdout + dry.stderr
    res = torchx(
        home,
        "run",
        "--wait",
        "-s",
        "monarch_local",
        "-cfg",
        f"pool={pool_name},hosts=2,preload=none",
        "dist.ddp",
        "-j",
        "2x1",
        "--max_retries",
        "1",
        "--script",
        "train.py",
        cwd=tmp_path,
        check=False,
    )
    h = _handle(res)
    assert res.returncode == 0, torchx(home, "log", h).stdout[-3000:]
    out = torchx(home, "log", h).stdout
    # rank 0 cannot pass the barrier of the first round (rank 1 left it), so any "ok 0" is from the
    # second round; its TORCHELASTIC_RESTART_COUNT reads 0 or 1 by a race torchrun has as well: a node
    # whose worker still waits in the barrier restarts for a waiting node (a membership change, not
    # counted), one whose worker already failed restarts for its failure (counted)
    assert "ok 0 after restart" in out and "ok 1 after restart 1" in out and "stopped answering" not in out, out


def test_names_that_would_leave_the_pools_dirs_are_refused_by_the_agent_spec():
    from monarch_torchx.specs import LaunchSpec

    for app_id, role in (("..", "r"), ("a", "../.."), ("a", "x/y"), (".", "r"), ("a", "")):
        with pytest.raises(ValueError, match="cannot name a directory"):
            LaunchSpec(app_id=app_id, role=role, replica_id=0, argv=["true"])
    LaunchSpec(app_id="a-1", role="trainer.v2", replica_id=0, argv=["true"])


def test_a_damaged_end_record_is_skipped_not_a_traceback(tmp_path):
    history.record_end(tmp_path, history.ReplicaEnd("app", "r", 0, "SUCCEEDED"))
    history.end_path(tmp_path, "app", "r", 1).write_text(
        json.dumps({"app_id": "app", "role": ["r"], "replica_id": 1, "state": "FAILED"})
    )
    history.end_path(tmp_path, "app", "r", 2).write_text(
        json.dumps({"app_id": "app", "role": "r", "replica_id": True, "state": "FAILED"})
    )
    assert list(history.read_ends(tmp_path, "app")) == [("r", 0)]
    assert history.read_ends(tmp_path, "app", ages=True)[("r", 0)].age_s is not None


def test_apps_older_than_the_retention_are_forgotten_from_a_reused_state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(history.HISTORY_DAYS_ENV, "1")
    (tmp_path / "apps").mkdir()
    for app in ("old", "new"):
        (tmp_path / "apps" / f"{app}.json").write_text("{}")
        history.record_end(tmp_path, history.ReplicaEnd(app, "r", 0, "SUCCEEDED"))
    past = time.time() - 3 * 86400
    os.utime(tmp_path / "apps" / "old.json", (past, past))
    assert history.prune_old_apps(tmp_path) == 1
    assert [p.name for p in (tmp_path / "apps").iterdir()] == ["new.json"]
    assert history.read_ends(tmp_path, "old") == {} and list(history.read_ends(tmp_path, "new")) == [("r", 0)]
