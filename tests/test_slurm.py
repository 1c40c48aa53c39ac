"""monarch_slurm on the real local SLURM lab: 3 nodes, each in its own network namespace."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest

from monarch_torchx.registry import Registry

from .conftest import BIN, assert_host0_relays_to_host1, cli_env, node_store, squeue_ids, torchx, wait_for
from .test_cli import TRAIN

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("slurm_lab")]


def _handle(res) -> str:
    return res.stdout.strip().splitlines()[-1]


def _state(home, handle) -> str:
    out = torchx(home, "status", handle).stdout
    return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.strip().startswith("State:"))


def _msg(home, handle) -> str:
    out = torchx(home, "status", handle).stdout
    return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.strip().startswith("Msg:"))


def _job(home, pool) -> str:
    return Registry(home).get(pool).allocation["job_id"]


def test_provision_once_then_iterate_on_warm_nodes(home, pool_name, tmp_path):
    res = torchx(
        home,
        "run",
        "-s",
        "monarch_slurm",
        "-cfg",
        f"pool={pool_name},nodes=2,partition=debug,time=00:30:00",
        "monarch.hostinfo",
        "--replicas",
        "2",
        cwd=tmp_path,
    )
    h = _handle(res)
    assert h.startswith(f"monarch_slurm://torchx/{pool_name}:")
    assert "allocation" in res.stderr  # progress while the allocation starts
    wait_for(lambda: _state(home, h) == "SUCCEEDED", what="hostinfo")
    job = _job(home, pool_name)
    lines = sorted(torchx(home, "log", h).stdout.splitlines())
    assert re.search(rf"hostinfo/0 pool={pool_name} host=0 hostname=node\d pid=\d+ rank0=node\d", lines[0])
    hosts = {re.search(r"hostname=(node\d)", line).group(1) for line in lines}
    assert len(hosts) == 2  # two different nodes
    from torchx.schedulers import get_scheduler_factories

    resp = get_scheduler_factories()["monarch_slurm"]("torchx").describe(h.rsplit("/", 1)[1])
    assert {r.hostname for r in resp.roles_statuses[0].replicas} == hosts  # ReplicaStatus.hostname

    # again: no sbatch, same allocation, same agents
    agents = [a.pid for a in Registry.hosts(Registry(home).get(pool_name))]
    h2 = _handle(
        torchx(
            home,
            "run",
            "-s",
            "monarch_slurm",
            "-cfg",
            f"pool={pool_name}",
            "utils.python",
            "-c",
            "import socket; print('on', socket.gethostname())",
            cwd=tmp_path,
        )
    )
    wait_for(lambda: _state(home, h2) == "SUCCEEDED", what="python")
    assert re.match(r"python/0 on node\d", torchx(home, "log", h2).stdout)
    assert _job(home, pool_name) == job and squeue_ids(f"monarch-{pool_name}") == [job]
    assert [a.pid for a in Registry.hosts(Registry(home).get(pool_name))] == agents

    st = json.loads(torchx(home, "pool", "status", pool_name, "--json").stdout)
    assert st["state"] == "healthy" and st["allocation"]["job_id"] == job
    assert st["allocation"]["state"] == "RUNNING" and st["allocation"]["time_left"]
    text = torchx(home, "pool", "status", pool_name).stdout
    assert f"job id {job}" in text and "time left" in text
    listed = torchx(home, "list", "-s", "monarch_slurm").stdout
    assert h in listed and h2 in listed

    # cancel an app: the allocation stays
    h3 = _handle(torchx(home, "run", "-s", "monarch_slurm", "-cfg", f"pool={pool_name}", "utils.sh", "sleep", "600"))
    wait_for(lambda: _state(home, h3) == "RUNNING", what="sleep")
    torchx(home, "cancel", h3)
    wait_for(lambda: _state(home, h3) == "CANCELLED", what="cancel")
    assert squeue_ids(f"monarch-{pool_name}") == [job]

    torchx(home, "pool", "stop", pool_name)
    wait_for(lambda: not squeue_ids(f"monarch-{pool_name}"), timeout=30, what="allocation released")


def test_dist_ddp_gloo_all_reduce_across_two_nodes(home, pool_name, tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    h = _handle(
        torchx(
            home,
            "run",
            "-s",
            "monarch_slurm",
            "-cfg",
            f"pool={pool_name},nodes=2",
            "dist.ddp",
            "-j",
            "2x1",
            "--script",
            "train.py",
            cwd=tmp_path,
        )
    )
    wait_for(lambda: _state(home, h) in ("SUCCEEDED", "FAILED"), timeout=180, what="ddp")
    logs = torchx(home, "log", h).stdout
    assert _state(home, h) == "SUCCEEDED", logs
    ranks = re.findall(r"rank=(\d) world=2 sum=3.0 host=(\d)", logs)
    assert sorted(r for r, _ in ranks) == ["0", "1"] and sorted(hh for _, hh in ranks) == ["0", "1"]


def test_warm_torchrun_trains_ddp_on_two_nodes_by_two_procs(home, pool_name, tmp_path):
    from .test_torchrun import TRAIN as DDP_TRAIN

    (tmp_path / "train.py").write_text(DDP_TRAIN)
    args = ("dist.ddp", "-j", "2x2", "--script", "train.py")
    dry = torchx(
        home, "run", "--dryrun", "-s", "monarch_slurm", "-cfg", f"pool={pool_name},nodes=2", *args, cwd=tmp_path
    ).stdout
    assert "role train: warm torchrun" in dry
    outs = []
    for cfg in (f"pool={pool_name},nodes=2,partition=debug,time=00:30:00", f"pool={pool_name}"):  # create, then warm
        res = torchx(
            home, "run", "--wait", "--log", "-s", "monarch_slurm", "-cfg", cfg, *args, cwd=tmp_path, timeout=240
        )
        outs.append(res.stdout + res.stderr)
    for out in outs:
        found = re.findall(r"train/(\d) \[(\d)\]:params rank=(\d) world=4 init=(\w+) final=(\w+)", out)
        assert sorted(int(r) for _, _, r, _, _ in found) == [0, 1, 2, 3], out
        assert len({f for *_, f in found}) == 1 and found[0][3] != found[0][4]  # trained, equal on both nodes
        assert "SUCCEEDED" in out


def test_bad_requests_are_refused_in_one_line_and_leave_no_allocation(home, pool_name, tmp_path):
    cases = [
        (f"pool={pool_name},partition=nope", "Invalid partition"),
        (f"pool={pool_name},nodes=5", "can never start"),
        (f"pool={pool_name},time=abc", "not a SLURM time limit"),
    ]
    for cfg, want in cases:
        res = torchx(home, "run", "-s", "monarch_slurm", "-cfg", cfg, "utils.echo", check=False, timeout=120)
        assert res.returncode == 1, res
        assert want in res.stderr and "Traceback" not in res.stderr, res.stderr
        assert not squeue_ids(f"monarch-{pool_name}")
        assert Registry(home).get(pool_name) is None
    env = {**cli_env(home), "PATH": str(BIN)}  # no SLURM commands on PATH
    res = subprocess.run(
        [str(BIN / "torchx"), "run", "-s", "monarch_slurm", "-cfg", f"pool={pool_name}", "utils.echo"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1 and "sbatch not found on PATH" in res.stderr and "SLURM" in res.stderr


def test_a_job_dir_someone_else_made_is_refused_before_anything_is_submitted(home, pool_name, tmp_path):
    """On shared scratch, JOB_DIR/NAME made first by another user (or open to all) could let them
    swap the token or the sbatch script: such a directory is refused, and nothing is submitted."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    os.chmod(scratch, 0o1777)
    planted = scratch / pool_name
    for how in ("open", "theirs"):
        planted.mkdir(exist_ok=True)
        os.chmod(planted, 0o777 if how == "open" else 0o700)
        if how == "theirs":
            os.chown(planted, 65534, 65534)
        res = torchx(
            home,
            "run",
            "-s",
            "monarch_slurm",
            "-cfg",
            f"pool={pool_name},nodes=1,partition=debug,job_dir={scratch}",
            "utils.echo",
            check=False,
        )
        assert res.returncode == 1 and "refusing the pool's state dir" in res.stderr, res.stderr
        assert ("open to other users" if how == "open" else "belongs to uid 65534") in res.stderr
        assert "Traceback" not in res.stderr and not list(planted.iterdir())
        assert not squeue_ids(f"monarch-{pool_name}")


def test_torchxconfig_slurm_section_is_honoured(home, pool_name, tmp_path):
    (tmp_path / ".torchxconfig").write_text("[slurm]\npartition = from_torchxconfig\n")
    res = torchx(
        home, "run", "-s", "monarch_slurm", "-cfg", f"pool={pool_name}", "utils.echo", cwd=tmp_path, check=False
    )
    assert res.returncode == 1 and "Invalid partition" in res.stderr  # the [slurm] default was used
    dry = torchx(
        home, "run", "--dryrun", "-s", "monarch_slurm", "-cfg", f"pool={pool_name}", "utils.echo", cwd=tmp_path
    )
    assert "partition=from_torchxconfig" in dry.stdout
    h = _handle(
        torchx(
            home, "run", "-s", "monarch_slurm", "-cfg", f"pool={pool_name},partition=debug", "utils.echo", cwd=tmp_path
        )
    )
    wait_for(lambda: _state(home, h) == "SUCCEEDED", what="echo with -cfg over [slurm]")


def test_allocation_cancelled_outside_fails_apps_and_the_next_run_reprovisions(home, pool_name):
    h = _handle(
        torchx(home, "run", "-s", "monarch_slurm", "-cfg", f"pool={pool_name},nodes=2", "utils.sh", "sleep", "600")
    )
    wait_for(lambda: _state(home, h) == "RUNNING", what="sleep")
    job = _job(home, pool_name)
    subprocess.run(["scancel", job], check=True)
    wait_for(lambda: _state(home, h) == "FAILED", timeout=15, what="app FAILED after scancel")
    assert f"allocation {job} is CANCELLED" in _msg(home, h)
    st = json.loads(torchx(home, "pool", "status", pool_name, "--json").stdout)
    assert st["state"] == "stopped" and st["allocation"]["state"] == "CANCELLED"
    res = torchx(home, "run", "-s", "monarch_slurm", "-cfg", f"pool={pool_name}", "utils.echo")
    assert "repairing" in res.stderr
    h2 = _handle(res)
    wait_for(lambda: _state(home, h2) == "SUCCEEDED", what="echo on the new allocation")
    assert _job(home, pool_name) != job


def test_killed_node_agent_fails_its_apps_and_the_pool_is_replaced(home, pool_name):
    h = _handle(
        torchx(home, "run", "-s", "monarch_slurm", "-cfg", f"pool={pool_name},nodes=2", "utils.sh", "sleep", "600")
    )
    wait_for(lambda: _state(home, h) == "RUNNING", what="sleep")
    job = _job(home, pool_name)
    victim = Registry.hosts(Registry(home).get(pool_name))[0]
    os.kill(victim.pid, signal.SIGKILL)
    wait_for(lambda: _state(home, h) == "FAILED", timeout=15, what="app FAILED after its agent died")
    assert "host 0" in _msg(home, h)
    st = json.loads(torchx(home, "pool", "status", pool_name, "--json").stdout)
    assert st["state"] == "degraded" and [x["state"] for x in st["hosts"]] == ["lost", "ok"]
    h2 = _handle(torchx(home, "run", "-s", "monarch_slurm", "-cfg", f"pool={pool_name}", "utils.echo"))
    wait_for(lambda: _state(home, h2) == "SUCCEEDED", what="echo after replacement")
    assert _job(home, pool_name) != job
    wait_for(lambda: job not in squeue_ids(f"monarch-{pool_name}"), timeout=30, what="old allocation gone")


def test_idle_timeout_releases_the_allocation(home, pool_name):
    torchx(home, "pool", "create", pool_name, "-s", "monarch_slurm", "-cfg", "nodes=1,preload=none,idle_timeout=2s")
    job = _job(home, pool_name)
    assert squeue_ids(f"monarch-{pool_name}") == [job]
    wait_for(lambda: not squeue_ids(f"monarch-{pool_name}"), timeout=60, what="idle allocation released")
    st = json.loads(torchx(home, "pool", "status", pool_name, "--json").stdout)
    assert st["state"] == "stopped" and "idle" in st["hosts"][0]["error"]


def test_pending_allocation_shows_slurms_reason_until_it_starts(home, pool_name):
    blocker = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "-N3",
            "--exclusive",
            "-J",
            f"blocker-{pool_name}",
            "-o",
            "/dev/null",
            "--wrap",
            "sleep 600",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    try:
        wait_for(
            lambda: (
                blocker
                in subprocess.run(
                    ["squeue", "-h", "-t", "R", "-o", "%i"], capture_output=True, text=True
                ).stdout.split()
            ),
            what="the blocker to run",
        )
        create = subprocess.Popen(
            [str(BIN / "torchx"), "pool", "create", pool_name, "-s", "monarch_slurm", "-cfg", "nodes=1,preload=none"],
            env=cli_env(home),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

        def pending():
            res = torchx(home, "pool", "status", pool_name, "--json", check=False)
            return res.returncode == 0 and json.loads(res.stdout)

        st = wait_for(lambda: (s := pending()) and s["state"] == "pending" and s, timeout=30, what="pending pool")
        assert st["allocation"]["state"] == "PENDING" and st["allocation"]["reason"] in ("Resources", "Priority")
        assert "PENDING" in torchx(home, "pool", "status", pool_name).stdout
        subprocess.run(["scancel", blocker], check=True)
        out, err = create.communicate(timeout=60)
        assert create.returncode == 0, err
        assert "PENDING (Resources)" in err and "ready: 1 host(s)" in out
    finally:
        subprocess.run(["scancel", blocker])


def test_job_dir_holds_the_pool_state(home, pool_name, tmp_path):
    job_dir = tmp_path / "jobs"
    torchx(home, "pool", "create", pool_name, "-s", "monarch_slurm", "-cfg", f"nodes=1,preload=none,job_dir={job_dir}")
    rec = Registry(home).get(pool_name)
    assert Path(rec.state_dir) == job_dir / pool_name
    assert (job_dir / pool_name / "hosts" / "0.json").exists()
    assert list((job_dir / pool_name / "logs").glob("slurm-*.out"))


def test_walltime_ends_the_allocation_and_its_apps_say_why(home, pool_name):
    """time=1 (one minute, SLURM's smallest): the allocation ends under a running app."""
    h = _handle(
        torchx(
            home,
            "run",
            "-s",
            "monarch_slurm",
            "-cfg",
            f"pool={pool_name},nodes=1,time=1,preload=none",
            "utils.sh",
            "sleep",
            "600",
        )
    )
    job = _job(home, pool_name)
    wait_for(lambda: _state(home, h) == "FAILED", timeout=180, interval=1, what="the walltime to end the app")
    assert f"allocation {job} is TIMEOUT" in _msg(home, h)
    assert not squeue_ids(f"monarch-{pool_name}")


def test_actor_mesh_on_a_slurm_pool_across_network_namespaces(home, pool_name):
    """attach() works on any scheduler's pool: procs on two SLURM nodes, called directly."""
    from monarch_torchx import Channel, SupervisionError
    from monarch_torchx import attach as attach_hosts

    from .fixtures.actors import Counter

    torchx(home, "pool", "create", pool_name, "-s", "monarch_slurm", "-cfg", "nodes=2,partition=debug,time=00:30:00")
    hosts = attach_hosts(pool_name)
    assert hosts.sizes == {"hosts": 2}
    procs = hosts.spawn_procs(per_host={"procs": 2})
    counters = procs.spawn("counters", Counter)
    names = counters.hostname.call().get()
    assert names.item(hosts=0, procs=0) == names.item(hosts=0, procs=1) != names.item(hosts=1, procs=0)
    assert {v for v in names.values()} <= {"node1", "node2", "node3"}
    assert list(counters.incr.call(2).get().values()) == [2, 2, 2, 2]
    port, rx = Channel.open()  # procs in the nodes' namespaces reach the controller's inbox
    counters.send_rank.broadcast(port)
    assert sorted(rx.recv().get(timeout=30) for _ in range(4)) == [0, 1, 2, 3]
    # the controller's own proc (get_or_spawn_controller's actors run in this process) is reached
    # from the nodes' namespaces too, on the pool's protocol
    from monarch_torchx.actor import get_or_spawn_controller

    from .fixtures.actors import Store, StoreUser

    store = get_or_spawn_controller("store", Store).get(timeout=60)
    assert store.put.call_one("k", 7).get(timeout=30) == "first" and store.pid.call_one().get() == os.getpid()
    assert set(procs.spawn("users", StoreUser).read.call("k").get(timeout=60).values()) == {7}
    victim = counters.slice(hosts=1, procs=1)
    pid = victim.pid.call_one().get()
    node = victim.hostname.call_one().get()
    os.kill(pid, signal.SIGKILL)  # the lab's nodes share the PID namespace
    with pytest.raises(SupervisionError, match=f"proc 3 of mesh .* on host 1 \\({node}\\) killed by signal SIGKILL"):
        victim.incr.call_one().get(timeout=30)
    assert list(counters.slice(hosts=0).incr.call().get(timeout=30).values()) == [3, 3]
    procs.stop().get()
    torchx(home, "pool", "stop", pool_name)


def test_rdma_buffers_across_slurm_nodes_use_tcp(home, pool_name):
    """Owner on one lab node, readers on another node and in the controller: tcp over veth."""
    import torch

    from monarch_torchx import attach as attach_hosts
    from monarch_torchx.rdma import RDMAError

    from .fixtures.rdma_actors import Weights

    torchx(home, "pool", "create", pool_name, "-s", "monarch_slurm", "-cfg", "nodes=2,partition=debug,time=00:30:00")
    procs = attach_hosts(pool_name).spawn_procs(per_host={"procs": 1})
    n = 4 << 20  # 16 MiB: several streams
    w = procs.spawn("w", Weights, n)
    buf = w.slice(hosts=0).handle.call_one().get()
    assert buf.backend == "tcp"  # another host (its own namespace and host name): no cma
    assert w.slice(hosts=1).read_from.call_one(buf, n).get() == float(torch.arange(n, dtype=torch.float64).sum())
    dst = torch.empty(n)
    buf.read_into(dst.view(torch.uint8)).get(timeout=60)
    assert torch.equal(dst, torch.arange(n, dtype=torch.float32))
    buf.write_from(torch.zeros(2).view(torch.uint8)).get()
    assert w.slice(hosts=0).head.call_one(3).get() == [0.0, 0.0, 2.0]
    os.kill(w.slice(hosts=0).pid.call_one().get(), signal.SIGKILL)
    with pytest.raises(RDMAError, match="owner"):
        buf.read_into(dst.view(torch.uint8), timeout=20).get(timeout=30)
    procs.stop().get()
    torchx(home, "pool", "stop", pool_name)


def test_torchx_workspace_is_synced_to_the_nodes_and_served_by_fuse_there(home, pool_name, tmp_path, monkeypatch):
    """`-cfg workspace_mount=ws` on real SLURM nodes: each node's agent mounts its copy (FUSE, in the
    node's own namespace) and role 0 runs in it; an edit reaches the next run on the warm pool."""
    monkeypatch.setenv("MONARCH_TORCHX_SYNC_STORE", str(tmp_path / "node-stores"))  # the agents inherit it
    ws = tmp_path / "proj"
    ws.mkdir()
    (ws / "main.py").write_text(
        "import os, socket\ncode = os.path.dirname(os.path.realpath('main.py'))\n"
        "print('ran', open('v.txt').read().strip(), socket.gethostname(), "
        "code, os.path.ismount(code), os.access('.', os.W_OK))\n"
    )

    def run(version: str, *cfg: str) -> list:
        (ws / "v.txt").write_text(version + "\n")
        res = torchx(
            home,
            "run",
            "-s",
            "monarch_slurm",
            "-cfg",
            ",".join((f"pool={pool_name}", "workspace_mount=ws", *cfg)),
            "--wait",
            "--log",
            "utils.python",
            "--num_replicas",
            "2",
            "--script",
            "main.py",
            cwd=ws,
            timeout=240,
        )
        return sorted(
            line.split(" ", 1)[1].split() for line in (res.stdout + res.stderr).splitlines() if " ran " in line
        )

    for version, cfg in (("v1", ("nodes=2", "partition=debug", "time=00:30:00")), ("v2", ())):
        out = run(version, *cfg)
        assert len(out) == 2, out
        for k, (_, v, node, code, mounted, writable) in enumerate(out):
            assert v == version and re.fullmatch(r"node\d", node) and mounted == "True" and writable == "True"
            assert code == str(node_store(tmp_path / "node-stores", pool_name, k) / "mounts" / "ws")
        assert out[0][2] != out[1][2]  # two nodes, each serving its own copy


def test_the_ddp_tutorials_snapshot_by_rank_0_resumes_every_rank_across_nodes(home, pool_name, tmp_path, monkeypatch):
    """Issue 38: the DDP tutorial's shape (global rank 0 alone saves snapshot.pt in its cwd, every
    rank loads it at start) on two nodes: their shared working directory is on the file system the
    state dir is on, so the resume starts every rank at one epoch. The lab's nodes share /tmp but
    not their mounts, so a relative mount's per-node view cannot be one path there: the workspace
    goes to an absolute mount (each node mounts it at that path), and a relative one is said once
    to run per host."""
    from .test_workspace_shared import run_tutorial_twice, write_tutorial

    monkeypatch.setenv("MONARCH_TORCHX_SYNC_STORE", str(tmp_path / "node-stores"))  # the agents inherit these
    monkeypatch.setenv("MONARCH_TORCHX_SYNC_ROOTS", str(tmp_path / "roots"))
    ws, mount = write_tutorial(tmp_path), str(tmp_path / "roots" / "tut")
    cfg = f"pool={pool_name},nodes=2,partition=debug,time=00:30:00,idle_timeout=300s"

    def run(
        epochs: int, mount: str = mount, script: tuple = ("dist.ddp", "-j", "2x1", "--script", "tutorial.py")
    ) -> str:
        res = torchx(
            home,
            "run",
            "--wait",
            "--log",
            "-s",
            "monarch_slurm",
            "-cfg",
            f"{cfg},workspace_mount={mount}",
            *script,
            "--",
            str(epochs),
            "1",
            cwd=ws,
            timeout=240,
        )
        return res.stdout + res.stderr

    cwds = run_tutorial_twice(run)
    shared = home / "workspaces" / pool_name / mount.strip("/").replace("/", "_") / "shared"
    assert cwds == [str(shared)] * 2 and (shared / "snapshot.pt").is_file()

    per_host = [run(0, "rel", ("utils.python", "--num_replicas", "2", "-c", "print('ran')")) for _ in range(2)]
    assert "each host runs in a working directory of its own" in per_host[0] and "docs/syncfs.md" in per_host[0]
    assert "working directory of its own" not in per_host[1]  # said once per pool and mount


class _Capture:
    """Every frame crossing the lab's veth links while it runs (an AF_PACKET socket in the root
    namespace: the node ends of the links are slveth1..3), as tcpdump on them would see it."""

    def __init__(self):
        import socket as _socket
        import threading

        self.data = bytearray()
        self._sock = _socket.socket(_socket.AF_PACKET, _socket.SOCK_RAW, _socket.htons(0x0003))
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):

        while not self._stop.is_set():
            try:
                frame, addr = self._sock.recvfrom(1 << 16)
            except TimeoutError:
                continue
            if addr[0].startswith("slveth"):
                self.data += frame

    def stop(self) -> bytes:
        self._stop.set()
        self._t.join(5)
        self._sock.close()
        return bytes(self.data)


def _echo_captured(home, pool: str, cfg: str, marker: str) -> bytes:
    cap = _Capture()
    try:
        h = _handle(
            torchx(
                home,
                "run",
                "-s",
                "monarch_slurm",
                "-cfg",
                f"pool={pool},nodes=1,partition=debug{cfg}",
                "utils.echo",
                "--msg",
                marker,
            )
        )
        wait_for(lambda: _state(home, h) == "SUCCEEDED", what="echo")
        assert marker in torchx(home, "log", h).stdout  # the marker went out to the node and came back
    finally:
        seen = cap.stop()
    return seen


def test_traffic_between_nodes_is_tls_by_default_and_plaintext_only_when_asked(home, pool_name):
    """A SLURM pool's connections are TLS: a capture on the lab's veth links never shows the
    app's arguments or its output, only TLS records. The same run on a pool made with tls=False
    shows them in the clear, which proves the capture sees this traffic."""
    marker = f"PLAINTEXT-MARKER-{pool_name}"
    seen = _echo_captured(home, pool_name, "", marker)
    assert Registry(home).get(pool_name).spec["tls"] is True
    assert b"\x17\x03\x03" in seen  # TLS 1.3 application-data records went by
    assert marker.encode() not in seen
    assert b"MTX1" not in seen  # not even the handshake's greeting is visible
    plain = f"{pool_name}p"
    seen = _echo_captured(home, plain, ",tls=False", marker + "p")
    assert (marker + "p").encode() in seen


def _node_mounts(node: str) -> str:
    """/proc/mounts as node ``node``'s slurmd (its own mount namespace) sees it."""
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if cmd[:1] and cmd[0].endswith(b"slurmd") and node.encode() in cmd:
                return subprocess.run(
                    ["nsenter", f"--mount=/proc/{p.name}/ns/mnt", "cat", "/proc/mounts"],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
    raise AssertionError(f"no slurmd for {node}")


def test_pool_stop_ends_what_a_killed_node_agent_left(home, pool_name, tmp_path, monkeypatch):
    """An agent SIGKILLed on its node (with its FUSE server, as an OOM kill takes both) leaves a
    mount and a sync store there; `pool stop` ends them with a job step on that node before it
    releases the allocation, and the healthy node cleans up after itself as always."""
    from monarch_torchx.pool import attach

    from .test_syncfs import fuse_servers

    stores = tmp_path / "node-stores"
    monkeypatch.setenv("MONARCH_TORCHX_SYNC_STORE", str(stores))  # (passed to the nodes by sbatch and srun)
    torchx(home, "pool", "create", pool_name, "-s", "monarch_slurm", "-cfg", "nodes=2,preload=none")
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text("print('hi')\n")
    from monarch_torchx.syncfs import sync

    report = sync(attach(pool_name), str(src), "ws")
    assert report.ok
    victim = Registry.hosts(Registry(home).get(pool_name))[1]
    store = node_store(stores, pool_name, 1)
    mount = report.hosts[1].path
    assert mount in _node_mounts(victim.hostname) and fuse_servers(store)
    for pid in [victim.pid, *fuse_servers(store)]:
        os.kill(pid, signal.SIGKILL)
    assert mount in _node_mounts(victim.hostname) and store.is_dir()  # left behind
    res = torchx(home, "pool", "stop", pool_name)
    assert f"host 1: sync store {store}" in res.stderr and f"host 1: mount {mount}" in res.stderr
    assert not store.exists() and mount not in _node_mounts(victim.hostname)
    assert not list(stores.glob(f"{pool_name}-*"))  # host 0's store: removed by its own agent


def test_workers_started_by_the_users_own_sbatch_are_attached_over_tls(home, pool_name, tmp_path):
    """Monarch's bootstrap: the user's own `sbatch` + `srun` start run_worker_loop_forever on two
    nodes; the controller attaches with the shared secret file, and its shutdown ends the job."""
    from monarch_torchx.actor import attach_to_workers

    from .fixtures.actors import Counter

    secret = tmp_path / "secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    port = 29000 + os.getpid() % 2000
    (tmp_path / "worker.py").write_text(
        textwrap.dedent(f"""
        import os, socket
        from monarch_torchx.actor import run_worker_loop_forever
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # this node's address toward the controller
            s.connect(("10.77.0.1", 9))
            addr = f"tcp://{{s.getsockname()[0]}}:{port}"
        with open({str(tmp_path)!r} + "/addr-" + os.environ["SLURM_PROCID"], "w") as f:
            f.write(addr)
        run_worker_loop_forever(address=addr, ca={str(secret)!r})
    """)
    )
    script = tmp_path / "workers.sh"
    script.write_text(
        f"#!/bin/bash\n#SBATCH -J {pool_name} -N 2 -n 2 -p debug -t 00:10:00 -o {tmp_path}/workers.out\n"
        f"srun {BIN}/python {tmp_path}/worker.py\n"
    )
    job = subprocess.run(
        ["sbatch", "--parsable", str(script)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    ).stdout.strip()
    try:
        files = [tmp_path / f"addr-{i}" for i in range(2)]
        wait_for(
            lambda: all(f.exists() and f.read_text() for f in files),
            timeout=60,
            what=f"the workers to start ({tmp_path}/workers.out)",
        )
        addrs = [f.read_text() for f in files]
        hosts = attach_to_workers(ca=secret, workers=addrs, name=pool_name)
        assert hosts.initialized.get(timeout=120) is True
        assert Registry(home).get(pool_name).tls_pem  # off loopback: TLS, derived from the secret
        counters = hosts.spawn_procs(per_host={"procs": 2}).spawn("c", Counter)
        names = counters.hostname.call().get(timeout=60)
        assert len(set(names.values())) == 2 and set(names.values()) <= {"node1", "node2", "node3"}
        assert list(counters.incr.call().get(timeout=30).values()) == [1, 1, 1, 1]
        assert attach_to_workers(ca=secret, workers=addrs, name=pool_name).pool == pool_name  # reused
        hosts.shutdown().get(timeout=60)
        wait_for(
            lambda: not subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip(),
            timeout=60,
            what="the workers' job to end once its hosts were shut down",
        )
    finally:
        subprocess.run(["scancel", job], capture_output=True)


def test_the_relay_tree_runs_between_slurm_nodes_over_tls(home, pool_name, monkeypatch):
    """The tree forced on (fan-out 2) on a 3-node pool: the client asks hosts 0 and 2, and host 0
    relays to host 1 across the lab's network, with the pool's TLS; runs, logs, SQL aggregates
    and the pool's status all go that way."""
    import monarch_torchx.net.fanout as relay

    monkeypatch.setenv("MONARCH_TORCHX_TREE_MIN_HOSTS", "2")
    monkeypatch.setenv("MONARCH_TORCHX_TREE_FANOUT", "2")  # for the CLI runs below
    monkeypatch.setattr(relay, "FANOUT", 2)  # for this process
    h = _handle(
        torchx(
            home,
            "run",
            "-s",
            "monarch_slurm",
            "-cfg",
            f"pool={pool_name},nodes=3,preload=none",
            "utils.echo",
            "--msg",
            "through-the-tree",
            "--num_replicas",
            "3",
        )
    )
    wait_for(lambda: _state(home, h) == "SUCCEEDED", timeout=120, what="echo on 3 nodes")
    assert torchx(home, "log", h).stdout.count("through-the-tree") == 3
    assert Registry(home).get(pool_name).spec["tls"] is True
    _, info = assert_host0_relays_to_host1(home, pool_name, "through-the-tree")
    assert len({v["hostname"] for _, v, _ in info}) == 3
