"""Issue 42 on the SLURM lab: a pool that grows by further allocations (its hosts and apps kept),
shrinks by releasing whole idle allocations, refuses a run that needs more walltime than its
allocations have left, and keeps serving when SLURM cannot satisfy a grow."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess

import pytest

from monarch_torchx.registry import PoolRecord, Registry
from monarch_torchx.schedulers.slurm import Allocation, allocations, set_allocations

from .conftest import BIN, cli_env, squeue_ids, torchx, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("slurm_lab")]

MT = str(BIN / "monarch-torchx")
# each lab node has 1 CPU: declared capacity lets several replicas share a host, as on a real node
SPEC = "partition=debug,time=00:20:00,preload=none,cpus_per_host=4"


def mt(home, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([MT, *args], env=cli_env(home), capture_output=True, text=True, timeout=180)


def run(home, cfg: str, *app: str, **kw) -> subprocess.CompletedProcess:
    """`torchx run -s monarch_slurm -cfg CFG APP...`"""
    return torchx(home, "run", "-s", "monarch_slurm", "-cfg", cfg, *app, **kw)


def _state(home, handle) -> str:
    out = torchx(home, "status", handle).stdout
    return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.strip().startswith("State:"))


def _status(home, pool) -> dict:
    return json.loads(mt(home, "pool", "status", pool, "--json").stdout)


def _jobs(home, pool) -> list[str]:
    return [a.job_id for a in allocations(Registry(home).require(pool))]


def test_grow_keeps_the_running_app_then_shrink_releases_only_idle_allocations(home, pool_name):
    res = mt(home, "pool", "create", pool_name, "-s", "monarch_slurm", "-cfg", f"nodes=1,{SPEC}")
    assert res.returncode == 0, res.stderr
    first = _jobs(home, pool_name)
    run0 = run(home, f"pool={pool_name}", "utils.sh", "sleep", "600")
    h0 = run0.stdout.strip().splitlines()[-1]
    wait_for(lambda: _state(home, h0) == "RUNNING", what="the app on host 0")
    pid0 = Registry.hosts(Registry(home).require(pool_name))[0].pid

    # a run asking 3 nodes with grow=True grows the pool in place: a further allocation joins
    res = run(
        home,
        f"pool={pool_name},nodes=3,grow=True",
        "utils.sh",
        "--num_replicas",
        "3",
        "hostname",
    )
    assert "growing pool" in res.stderr and "host(s) 1-2 to join" in res.stderr
    h3 = res.stdout.strip().splitlines()[-1]
    wait_for(lambda: _state(home, h3) == "SUCCEEDED", timeout=60, what="the 3-replica app")
    names = sorted(torchx(home, "log", h3).stdout.split())
    assert len([n for n in names if n.startswith("node")]) == 3, names

    jobs = _jobs(home, pool_name)
    assert jobs[0] == first[0] and len(jobs) == 2
    st = _status(home, pool_name)
    assert [(a["hosts"], a["nodes"], a["state"]) for a in st["allocation"]["allocations"]] == [
        ("0", 1, "RUNNING"),
        ("1-2", 2, "RUNNING"),
    ]
    assert [h["state"] for h in st["hosts"]] == ["ok", "ok", "ok"]
    assert "allocations (2):" in mt(home, "pool", "status", pool_name).stdout
    # host 0's agent and its app were never touched
    assert Registry.hosts(Registry(home).require(pool_name))[0].pid == pid0
    assert _state(home, h0) == "RUNNING"

    # a shrink that would split an allocation is refused, naming the sizes that would not
    res = mt(home, "pool", "resize", pool_name, "--hosts", "2")
    assert res.returncode == 1 and "shrinks by whole allocations, so resize it to 1" in res.stderr

    # a busy allocation is kept, saying which app keeps it
    busy = run(
        home,
        f"pool={pool_name}",
        "utils.sh",
        "--num_replicas",
        "3",
        "sleep",
        "600",
    )
    hb = busy.stdout.strip().splitlines()[-1]
    wait_for(lambda: _state(home, hb) == "RUNNING", what="the app on every host")
    res = mt(home, "pool", "resize", pool_name, "--hosts", "1")
    assert res.returncode == 1 and "cannot shrink to 1" in res.stderr and hb.rsplit(":", 1)[-1] in res.stderr
    assert len(_jobs(home, pool_name)) == 2

    # once it ends, the idle allocation is released; host 0 and its app stay
    torchx(home, "cancel", hb)
    wait_for(lambda: _state(home, hb) == "CANCELLED", what="the cancel")
    res = mt(home, "pool", "resize", pool_name, "--hosts", "1")
    assert res.returncode == 0, res.stderr
    wait_for(lambda: jobs[1] not in squeue_ids(f"monarch-{pool_name}"), timeout=30, what="the allocation released")
    assert _jobs(home, pool_name) == [jobs[0]]
    assert _state(home, h0) == "RUNNING"
    assert len(_status(home, pool_name)["hosts"]) == 1
    mt(home, "pool", "stop", pool_name)
    assert not squeue_ids(f"monarch-{pool_name}")


def test_a_further_allocation_that_idles_out_ends_and_the_pool_shrinks_while_host_0_works(home, pool_name):
    """The idle timeout applies per allocation: the grown part leaves when idle, though host 0 is
    busy and every run checks it; the pool then has its first allocation only, and is not read as
    lost (no repair, no allocation submitted again)."""
    cfg = f"nodes=1,{SPEC},idle_timeout=15s"
    assert mt(home, "pool", "create", pool_name, "-s", "monarch_slurm", "-cfg", cfg).returncode == 0
    try:
        first = _jobs(home, pool_name)
        run0 = run(home, f"pool={pool_name}", "utils.sh", "sleep", "600")
        h0 = run0.stdout.strip().splitlines()[-1]
        wait_for(lambda: _state(home, h0) == "RUNNING", what="the app on host 0")
        res = mt(home, "pool", "resize", pool_name, "--hosts", "3")
        assert res.returncode == 0, res.stderr
        extra = _jobs(home, pool_name)[1]
        # a run on host 0 checks every host: a grace for the idle ones, not work that keeps them
        res = run(home, f"pool={pool_name}", "utils.echo", "--msg", "hi")
        wait_for(lambda: _state(home, res.stdout.strip().splitlines()[-1]) == "SUCCEEDED", what="the echo")
        wait_for(
            lambda: extra not in squeue_ids(f"monarch-{pool_name}"),
            timeout=150,
            what="the idle further allocation to end by itself",
        )
        hosts = Registry.hosts(Registry(home).require(pool_name))
        assert hosts[1] is not None and hosts[1].exited_idle and not hosts[0].exited
        out = mt(home, "pool", "status", pool_name).stdout
        assert "host(s) 1-2 left idle (idle_timeout); the pool has 1 host(s) now" in out, out
        assert _jobs(home, pool_name) == first and len(_status(home, pool_name)["hosts"]) == 1
        assert _state(home, h0) == "RUNNING"
        res = run(home, f"pool={pool_name}", "utils.echo", "--msg", "again")
        assert "repair" not in res.stderr, res.stderr
        assert _jobs(home, pool_name) == first and squeue_ids(f"monarch-{pool_name}") == first
    finally:
        mt(home, "pool", "stop", pool_name)


def test_a_pool_with_max_nodes_grows_by_itself_for_an_app_waiting_in_its_queue(home, pool_name, tmp_path, monkeypatch):
    """Automatic allocation: a 3-replica run on a 1-node pool made with max_nodes=3 waits in the
    pool's queue; after backlog, host 0 submits an allocation of 2 nodes and the app starts there,
    with no client around (the run returned at once)."""
    cfg = f"nodes=1,{SPEC},max_nodes=3,backlog=0s"
    monkeypatch.setenv("MONARCH_TORCHX_SYNC_STORE", str(tmp_path / "node-stores"))  # the agents inherit it
    assert mt(home, "pool", "create", pool_name, "-s", "monarch_slurm", "-cfg", cfg).returncode == 0
    try:
        # a workspace goes to the hosts there are: such a run cannot wait for the pool to grow
        ws = tmp_path / "proj"
        ws.mkdir()
        (ws / "main.py").write_text("print('hi')\n")
        res = run(
            home,
            f"pool={pool_name},workspace_mount=ws",
            "utils.python",
            "--num_replicas",
            "3",
            "--script",
            "main.py",
            cwd=ws,
            check=False,
        )
        assert res.returncode != 0
        assert "cannot wait for the pool to grow by itself" in res.stderr and "nodes=3,grow=True" in res.stderr
        res = run(home, f"pool={pool_name}", "utils.sh", "--num_replicas", "3", "hostname")
        assert "waits in the queue" in res.stderr and "the pool grows for it (max_nodes=3)" in res.stderr, res.stderr
        h = res.stdout.strip().splitlines()[-1]
        wait_for(lambda: _state(home, h) == "SUCCEEDED", timeout=120, what="the app, once the pool grew")
        names = sorted(torchx(home, "log", h).stdout.split())
        assert len([n for n in names if n.startswith("node")]) == 3, names
        st = _status(home, pool_name)
        assert [a["nodes"] for a in st["allocation"]["allocations"]] == [1, 2]
        auto = st["allocation"]["autoscale"]
        assert auto["phase"] == "watching" and auto["grown"] == 1, auto
        assert "grew to 3 host(s)" in auto["reason"], auto
        assert "grows by itself: up to 3 nodes" in mt(home, "pool", "status", pool_name).stdout
    finally:
        mt(home, "pool", "stop", pool_name)


def test_an_allocator_whose_grows_fail_pauses_with_the_reason_and_the_pool_keeps_serving(home, pool_name):
    cfg = f"nodes=1,{SPEC},max_nodes=5,backlog=1s"  # 4 more nodes: the lab has 3
    assert mt(home, "pool", "create", pool_name, "-s", "monarch_slurm", "-cfg", cfg).returncode == 0
    try:
        job = _jobs(home, pool_name)
        res = run(home, f"pool={pool_name}", "utils.sh", "--num_replicas", "5", "true")
        h = res.stdout.strip().splitlines()[-1]
        wait_for(
            lambda: _status(home, pool_name)["allocation"]["autoscale"]["phase"] == "paused",
            timeout=150,
            what="the allocator to pause",
        )
        reason = _status(home, pool_name)["allocation"]["autoscale"]["reason"]
        assert "paused after 3 failures; the last, a grow for" in reason and "can never start" in reason, reason
        assert f"pool resize {pool_name} --hosts N" in reason
        assert _jobs(home, pool_name) == job and squeue_ids(f"monarch-{pool_name}") == job
        assert _state(home, h) == "PENDING"
        res = mt(home, "exec", "--pool", pool_name, "--all", "--", "hostname")
        assert res.returncode == 0 and res.stdout.startswith("[0] node"), res.stdout + res.stderr
        torchx(home, "cancel", h)
    finally:
        mt(home, "pool", "stop", pool_name)


def test_a_shrink_that_would_strand_a_queued_app_is_refused_naming_it(home, pool_name):
    assert mt(home, "pool", "create", pool_name, "-s", "monarch_slurm", "-cfg", f"nodes=1,{SPEC}").returncode == 0
    try:
        assert mt(home, "pool", "resize", pool_name, "--hosts", "3").returncode == 0
        full = run(home, f"pool={pool_name}", "utils.sh", "--cpu", "4", "sleep", "600")  # host 0's 4 CPUs
        h0 = full.stdout.strip().splitlines()[-1]
        wait_for(lambda: _state(home, h0) == "RUNNING", what="the app that fills host 0")
        gang = run(home, f"pool={pool_name}", "utils.sh", "--num_replicas", "3", "true")  # one per host: waits
        assert "waits in the queue" in gang.stderr, gang.stderr
        waiting = gang.stdout.strip().splitlines()[-1].rsplit(":", 1)[-1]
        res = mt(home, "pool", "resize", pool_name, "--hosts", "1")  # (hosts 1-2 run nothing)
        assert res.returncode == 1
        err = res.stderr.strip().splitlines()[-1]
        assert "cannot shrink to 1: app(s) waiting in its queue could never start on 1 host(s)" in err, err
        assert waiting in err and "torchx cancel" in err
        assert len(_jobs(home, pool_name)) == 2 and len(_status(home, pool_name)["hosts"]) == 3
    finally:
        mt(home, "pool", "stop", pool_name)


def test_a_grow_slurm_cannot_satisfy_says_why_and_the_pool_keeps_serving(home, pool_name):
    assert mt(home, "pool", "create", pool_name, "-s", "monarch_slurm", "-cfg", f"nodes=1,{SPEC}").returncode == 0
    try:
        job = _jobs(home, pool_name)
        res = mt(home, "pool", "resize", pool_name, "--hosts", "5")  # 4 more nodes: the lab has 3
        assert res.returncode == 1
        err = res.stderr.strip().splitlines()[-1]
        assert "can never start (PartitionConfig" in err and "keeps its 1 host(s)" in err, err
        assert _jobs(home, pool_name) == job and squeue_ids(f"monarch-{pool_name}") == job
        res = mt(home, "exec", "--pool", pool_name, "--all", "--", "hostname")
        assert res.returncode == 0 and res.stdout.startswith("[0] node"), res.stdout + res.stderr
        assert mt(home, "pool", "resize", pool_name, "--hosts", "0").returncode == 1  # (never 0 hosts)
    finally:
        mt(home, "pool", "stop", pool_name)


def test_a_run_needing_more_walltime_left_than_the_pool_has_is_refused_in_one_line(home, pool_name):
    assert mt(home, "pool", "create", pool_name, "-s", "monarch_slurm", "-cfg", f"nodes=1,{SPEC}").returncode == 0
    try:
        job = _jobs(home, pool_name)[0]
        res = run(home, f"pool={pool_name},min_time_left=2h", "utils.echo", check=False)
        assert res.returncode != 0
        line = res.stderr.strip().splitlines()[-1]
        assert re.search(rf"allocation {job} \(host 0\) has (19|20) min left, less than min_time_left=2h asks", line)
        assert f"pool stop {pool_name}" in line, line
        # time= sizes the allocation, repeated by every run of a script: said, not refused
        res = run(home, f"pool={pool_name},time=01:00:00", "utils.echo")
        assert re.search(
            rf"warning: .*allocation {job} \(host 0\) has (19|20) min left, less than time=01:00:00", res.stderr
        )
        dry = torchx(
            home, "run", "--dryrun", "-s", "monarch_slurm", "-cfg", f"pool={pool_name},min_time_left=2h", "utils.echo"
        )
        assert "pool: refused" in dry.stdout + dry.stderr
        res = run(home, f"pool={pool_name},min_time_left=10m", "utils.echo")
        h = res.stdout.strip().splitlines()[-1]
        wait_for(lambda: _state(home, h) == "SUCCEEDED", what="a run that fits the walltime left")
    finally:
        mt(home, "pool", "stop", pool_name)


def test_a_run_needing_walltime_goes_only_to_hosts_whose_allocation_has_it_left(home, pool_name):
    assert mt(home, "pool", "create", pool_name, "-s", "monarch_slurm", "-cfg", f"nodes=1,{SPEC}").returncode == 0
    try:
        assert mt(home, "pool", "resize", pool_name, "--hosts", "2").returncode == 0
        first = _jobs(home, pool_name)[0]
        subprocess.run(["scontrol", "update", f"JobId={first}", "TimeLimit=5"], check=True)  # host 0: 5 min
        res = run(home, f"pool={pool_name},min_time_left=10m", "utils.sh", "hostname")
        h = res.stdout.strip().splitlines()[-1]
        wait_for(lambda: _state(home, h) == "SUCCEEDED", what="the run that needs 10 minutes")
        arec = Registry.get_app(Registry(home).require(pool_name), h.rsplit(":", 1)[-1])
        assert arec is not None and [p.host_index for p in arec.placement] == [1]  # not host 0
        res = run(home, f"pool={pool_name},min_time_left=10m", "utils.sh", "--num_replicas", "2", "true", check=False)
        assert res.returncode != 0
        line = res.stderr.strip().splitlines()[-1]
        assert "needs 2 host(s) with min_time_left=10m left, but pool" in line and "has 1 (" in line, line
        assert re.search(rf"allocation {first} \(host 0\) has [45] min left", line), line
    finally:
        mt(home, "pool", "stop", pool_name)


def test_a_record_from_before_grown_pools_reads_as_one_allocation(tmp_path):
    rec = PoolRecord("p", "monarch_slurm", {"hosts": 3}, "00", str(tmp_path), allocation={"job_id": "12"})
    assert allocations(rec) == [Allocation("12", 0, 3)]
    set_allocations(rec, [Allocation("14", 3, 2, 1.0), Allocation("12", 0, 3)])
    assert rec.allocation["job_id"] == "12"  # (the first, as older readers and force-stop read it)
    assert [(a.job_id, list(a.indices)) for a in allocations(rec)] == [("12", [0, 1, 2]), ("14", [3, 4])]


def test_a_replica_whose_node_is_lost_is_requeued_on_another_node_and_kept_there(home, pool_name):
    """A role with max_retries: its replica on a node whose agent was killed starts again on a
    healthy node (num_restarts counts it); the next run replaces only the lost node's allocation,
    so the requeued replica keeps running."""
    cfg = f"nodes=1,{SPEC},exclusive=True"  # (whole nodes: else the lab packs 1-node allocations on one node)
    assert mt(home, "pool", "create", pool_name, "-s", "monarch_slurm", "-cfg", cfg).returncode == 0
    try:
        for n in ("2", "3"):  # one allocation per host
            assert mt(home, "pool", "resize", pool_name, "--hosts", n).returncode == 0
        jobs = _jobs(home, pool_name)
        retried = ["utils.sh", "--num_replicas", "2", "--max_retries", "1"]
        app_run = run(home, f"pool={pool_name}", *retried, "sleep", "600")
        h = app_run.stdout.strip().splitlines()[-1]
        wait_for(lambda: _state(home, h) == "RUNNING", what="both replicas")
        app = h.rsplit(":", 1)[-1]

        def placement() -> dict[int, int]:
            arec = Registry.get_app(Registry(home).require(pool_name), app)
            assert arec is not None
            return {p.replica_id: p.host_index for p in arec.placement}

        assert placement() == {0: 0, 1: 1}
        os.kill(Registry.hosts(Registry(home).require(pool_name))[1].pid, signal.SIGKILL)
        # (each `torchx status` asks the app's hosts: the first that finds host 1 lost requeues replica 1)
        wait_for(lambda: _state(home, h) == "RUNNING" and placement()[1] == 2, timeout=60, what="the requeue")
        out = torchx(home, "status", h).stdout
        assert "requeued 1 time(s) on another host" in out, out
        hosts = Registry.hosts(Registry(home).require(pool_name))
        assert hosts[2] is not None and hosts[2].hostname != hosts[1].hostname  # (another node)
        assert re.search(r"[Nn]um[_ ][Rr]estarts:\s*1", out), out

        # the next run replaces the lost node's allocation only: the requeued replica stays
        res = run(home, f"pool={pool_name}", "utils.echo", "--msg", "hi")
        assert "repairing" in res.stderr, res.stderr
        now = _jobs(home, pool_name)
        assert now[0] == jobs[0] and now[2] == jobs[2] and now[1] != jobs[1]
        assert _state(home, h) == "RUNNING" and placement() == {0: 0, 1: 2}
        torchx(home, "cancel", h)
    finally:
        mt(home, "pool", "stop", pool_name)


def test_what_was_synced_reaches_the_hosts_that_join_before_they_take_work(home, pool_name, tmp_path, monkeypatch):
    stores = tmp_path / "node-stores"
    monkeypatch.setenv("MONARCH_TORCHX_SYNC_STORE", str(stores))  # the agents inherit it
    assert mt(home, "pool", "create", pool_name, "-s", "monarch_slurm", "-cfg", f"nodes=1,{SPEC}").returncode == 0
    try:
        src = tmp_path / "code"
        src.mkdir()
        (src / "hello.txt").write_text("synced before the grow\n")
        assert mt(home, "sync", str(src), "--pool", pool_name, "--to", "code").returncode == 0
        res = mt(home, "pool", "resize", pool_name, "--hosts", "3")
        assert res.returncode == 0, res.stderr
        assert f"sync {src} -> code replayed to host(s) 1-2 (1 file(s))" in res.stderr, res.stderr
        read = f"cat {stores}/*-host$MONARCH_TORCHX_HOST_INDEX/mounts/code/hello.txt"
        res = mt(home, "exec", "--pool", pool_name, "--all", "--", "sh", "-c", read)
        assert res.returncode == 0, res.stdout + res.stderr
        assert res.stdout.count("synced before the grow") == 3, res.stdout
        # a source changed since: the joining hosts get it as it is now, and the grow says so
        (src / "hello.txt").write_text("changed\n")
        assert mt(home, "pool", "resize", pool_name, "--hosts", "1").returncode == 0
        res = mt(home, "pool", "resize", pool_name, "--hosts", "2")
        assert "the source changed since it was synced: sync it again" in res.stderr, res.stderr
    finally:
        mt(home, "pool", "stop", pool_name)


def test_a_pool_made_with_renew_stays_warm_across_walltimes(home, pool_name, tmp_path, monkeypatch):
    """renew=True on 2-minute allocations, renewed 105 s before their end (``renew_before``, so
    that the test waits seconds, not a minute): host 0 submits a successor for each allocation,
    whose agents wait on standby, get what was synced and are armed. A shrink that releases the
    grown allocation ends it and its successor. The app running on host 0 runs on to its end;
    host 0 is handed over once idle; the first allocation ends, and a run after that starts on the
    successor, warm, with the synced code: no repair, no new allocation. `pool stop` ends a
    successor waiting on standby too."""
    stores = tmp_path / "node-stores"
    monkeypatch.setenv("MONARCH_TORCHX_SYNC_STORE", str(stores))  # the agents inherit it
    cfg = "nodes=1,partition=debug,time=2,preload=none,renew=True,renew_before=105s"
    res = mt(home, "pool", "create", pool_name, "-s", "monarch_slurm", "-cfg", cfg)
    assert res.returncode == 0, res.stderr
    try:
        assert mt(home, "pool", "resize", pool_name, "--hosts", "2").returncode == 0
        first, second = _jobs(home, pool_name)
        src = tmp_path / "code"
        src.mkdir()
        (src / "hello.txt").write_text("synced before the renewal\n")
        assert mt(home, "sync", str(src), "--pool", pool_name, "--to", "code").returncode == 0
        long = run(home, f"pool={pool_name}", "utils.sh", "sleep", "40").stdout.strip().splitlines()[-1]
        wait_for(lambda: _state(home, long) == "RUNNING", what="the app across the renewal")
        pid0 = Registry.hosts(Registry(home).require(pool_name))[0].pid

        def successor(part: int, armed: bool = True) -> str | None:
            p = _status(home, pool_name)["allocation"]["allocations"][part]
            return p["successor"]["job_id"] if p["successor"] and (p["successor"]["armed"] or not armed) else None

        wait_for(lambda: successor(0), timeout=90, what="host 0's successor, readied")
        succ = successor(0)
        text = mt(home, "pool", "status", pool_name).stdout
        assert f"-> {succ}" in text and "1/1 agent(s) ready to take over" in text, text
        assert "renews its allocations before their walltime" in text, text
        # the busy host is not handed over: its app runs on, on the first allocation's agent
        assert _state(home, long) == "RUNNING"
        assert Registry.hosts(Registry(home).require(pool_name))[0].pid == pid0

        # a shrink releases the grown allocation and its successor (whether or not host 1, idle,
        # was handed over to it already)
        wait_for(lambda: successor(1, armed=False) or _jobs(home, pool_name)[1] != second, what="host 1's successor")
        part = allocations(Registry(home).require(pool_name))[1]
        assert mt(home, "pool", "resize", pool_name, "--hosts", "1").returncode == 0
        gone = {second, part.job_id, part.successor} - {""}
        wait_for(lambda: not gone & set(squeue_ids(f"monarch-{pool_name}")), timeout=30, what="host 1's jobs ended")
        state_dir = Registry(home).require(pool_name).path
        assert not (state_dir / "hosts" / "1.json").exists() and not (state_dir / "hosts" / "1.next.json").exists()

        wait_for(lambda: first not in squeue_ids(f"monarch-{pool_name}"), timeout=120, what="the first allocation")
        assert _state(home, long) == "SUCCEEDED"
        read = f"cat {stores}/{pool_name}-*-host0-*/mounts/code/hello.txt"
        res = run(home, f"pool={pool_name}", "--wait", "--log", "utils.sh", "sh", "-c", read)
        assert "synced before the renewal" in res.stdout + res.stderr, res.stdout + res.stderr
        assert "repairing" not in res.stderr and "creating pool" not in res.stderr, res.stderr
        assert _jobs(home, pool_name) == [succ]
        assert Registry.hosts(Registry(home).require(pool_name))[0].pid != pid0
        assert not list(stores.glob(f"{pool_name}-*-host0")), "the first agent's store was left behind"

        # the successor is renewed in turn; `pool stop` ends the next one while it waits
        busy = run(home, f"pool={pool_name}", "utils.sh", "sleep", "300").stdout.strip().splitlines()[-1]
        wait_for(lambda: _state(home, busy) == "RUNNING", what="an app on host 0")
        wait_for(lambda: successor(0), timeout=90, what="the successor's successor")
    finally:
        mt(home, "pool", "stop", pool_name)
    assert not squeue_ids(f"monarch-{pool_name}")
