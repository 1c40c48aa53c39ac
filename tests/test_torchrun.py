"""Warm torchrun: torchrun roles on a pool, compared with the real torchrun under stock local_cwd."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
import uuid
from pathlib import Path

import pytest

from monarch_torchx import torchrun
from monarch_torchx.errors import MonarchError
from monarch_torchx.pool import PoolRequest, attach, ensure_pool
from monarch_torchx.registry import Registry

from .conftest import BIN, module_pool, torchx, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("test_torchrun")]  # (its module-wide pool: one worker)

TRAIN = """
import hashlib, os, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
digest = lambda m: hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in m.parameters())).hexdigest()[:16]
init = digest(model)
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
g = torch.Generator().manual_seed(rank)  # each rank its own data: DDP keeps the replicas equal
for step in range(6):
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)
    loss = torch.nn.functional.mse_loss(ddp(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"params rank={rank} world={dist.get_world_size()} init={init} final={digest(model)}", flush=True)
dist.destroy_process_group()
"""

PROBE = """
import json, os, sys
import torch.distributed as dist
dist.init_process_group("gloo")
out = os.environ["PROBE_DIR"]
with open(os.path.join(out, os.environ["RANK"] + ".json"), "w") as f:
    json.dump(dict(os.environ), f)
dist.barrier()
dist.destroy_process_group()
"""

FLAKY = """
import os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"attempt rank={os.environ['RANK']} restart={restart}", flush=True)
if os.environ["RANK"] == os.environ.get("FAIL_RANK") and restart < int(os.environ.get("FAIL_TIMES", "99")):
    sys.exit(3)
dist.barrier()
dist.destroy_process_group()
"""

SLEEPER = """
import os, time
import torch.distributed as dist
dist.init_process_group("gloo")
print(f"sleeping rank={os.environ['RANK']} pid={os.getpid()}", flush=True)
while True:
    dist.barrier()
    time.sleep(0.2)
"""

CONTRACT = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "OMP_NUM_THREADS",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _handle(res) -> str:
    return res.stdout.strip().splitlines()[-1]


def _status(home: Path, handle: str) -> dict:
    out = torchx(home, "status", handle).stdout
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines()) if v}


# ------------------------------------------------------------------ no pool needed


def test_option_table_is_torchruns():
    from torch.distributed.run import get_args_parser

    theirs = {
        tuple(a.option_strings): (a.nargs != 0, a.default)
        for a in get_args_parser()._actions
        if a.option_strings and a.dest != "help"
    }
    ours = {
        names: (takes, default if default is not None or not takes else None)
        for names, takes, default in torchrun.OPTIONS
    }
    assert set(ours) == set(theirs), "torchrun's options changed: update monarch_torchx/torchrun.py OPTIONS"
    for names, (takes, default) in theirs.items():
        assert ours[names][0] == takes, names
        if takes and not isinstance(default, list):
            assert str(ours[names][1]) == str(default), names


def test_shell_words_follow_bash():
    cmd = (
        "torchrun --rdzv_backend c10d --rdzv_endpoint ${TORCHX_RANK0_HOST:=localhost}:29500 --rdzv_id 'p:a-1' "
        "--nnodes 2 --nproc_per_node 2 --tee 3 --role '' train.py --lr \"$LR\" 'it''s' a\\ b $EMPTY"
    )
    env = {"LR": "0.1 x"}
    assert torchrun.shell_words(cmd, env) == [
        "torchrun",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        "localhost:29500",
        "--rdzv_id",
        "p:a-1",
        "--nnodes",
        "2",
        "--nproc_per_node",
        "2",
        "--tee",
        "3",
        "--role",
        "",
        "train.py",
        "--lr",
        "0.1 x",
        "its",
        "a b",
    ]
    assert env["TORCHX_RANK0_HOST"] == "localhost"  # := assigns, as in bash
    assert torchrun.shell_words("a ${H:-x}", {"H": ""}) == ["a", "x"]
    for bad in (
        "torchrun a.py | tee log",
        "cd x && torchrun a.py",
        "torchrun $(cat args)",
        "X=1 torchrun a.py",
        "torchrun *.py",
        "torchrun a.py > out",
    ):
        with pytest.raises(torchrun.ShellTooComplex):
            torchrun.shell_words(bad, {})


def test_which_roles_run_warm_and_why():
    ddp = [
        "bash",
        "-c",
        "torchrun --rdzv_backend c10d --rdzv_endpoint ${TORCHX_RANK0_HOST:=localhost}:29500 "
        "--rdzv_id x --nnodes 2 --nproc_per_node 2 --tee 3 --role '' train.py",
    ]
    plan = torchrun.plan_role(ddp, {}, 2, "train")
    assert plan.warm and plan.argv[:3] == ["python", "-m", torchrun.NODE_MODULE] and plan.nnodes == 2
    assert torchrun.plan_role(
        ["torchrun", "--nnodes", "1:4", "--rdzv-backend=c10d", "-m", "pkg.train"], {}, 3, "r"
    ).warm
    assert torchrun.plan_role(["python3", "-m", "torch.distributed.run", "--standalone", "t.py"], {}, 1, "r").warm
    assert torchrun.plan_role(["torchrun", "--nproc_per_node", "2", "t.py"], {}, 1, "r").warm  # static, 1 node
    assert torchrun.plan_role(["python", "train.py"], {}, 1, "r") is None  # not torchrun at all
    for argv, why in [
        (["torchrun", "--rdzv_backend", "etcd", "--rdzv_endpoint", "e:2379", "t.py"], "etcd"),
        (["torchrun", "--rdzv_backend", "c10d", "--no-such-flag", "t.py"], "would not accept"),
        (["bash", "-c", "torchrun --rdzv_backend c10d t.py | tee out"], "does more than run torchrun"),
        (["torchrun", "--nnodes", "1:2", "t.py"], "static"),  # torchrun's default backend, multi-node
    ]:
        plan = torchrun.plan_role(argv, {}, 1, "r")
        assert not plan.warm and why in plan.reason and plan.argv == argv, (argv, plan)
    assert torchrun.plan_role(["torchrun", "--nnodes", "2", "t.py"], {"PET_RDZV_BACKEND": "c10d"}, 2, "r").warm
    with pytest.raises(MonarchError, match=r"--nnodes 3 asks for 3 node\(s\) but the role has 2"):
        torchrun.plan_role(["torchrun", "--rdzv_backend", "c10d", "--nnodes", "3", "t.py"], {}, 2, "r")
    # the real torchrun (static rendezvous) with too few replicas would hang: refused too
    with pytest.raises(
        MonarchError,
        match=r"the role has 1 replica\(s\) \(torchrun would wait for nodes that "
        r"never come\); pass -j 3x2 .* or --num_replicas 3 \(utils.sh\)",
    ):
        torchrun.plan_role(["torchrun", "--nnodes", "3", "--nproc_per_node", "2", "t.py"], {}, 1, "r")
    with pytest.raises(MonarchError, match=r"asks for 2 to 4 node\(s\) but the role has 1"):
        torchrun.plan_role(["torchrun", "--nnodes", "2:4", "--rdzv_backend", "etcd", "t.py"], {}, 1, "r")
    assert not torchrun.plan_role(["torchrun", "--nnodes", "1:4", "--rdzv_backend", "etcd", "t.py"], {}, 1, "r").warm


def test_torchrun_with_more_nodes_than_replicas_is_refused_at_submit(home, pool_name, tmp_path):
    """`utils.sh torchrun --nnodes 3` on one replica (the real torchrun, static rendezvous) would
    wait forever for two nodes no replica starts: `--dryrun` and `run` refuse it in one line
    with the options that fix it, and nothing is created."""
    from .conftest import agent_pids

    (tmp_path / "train.py").write_text("print('hi')\n")
    want = (
        "torchx: error: role 'sh': torchrun --nnodes 3 asks for 3 node(s) but the role has 1 replica(s) "
        "(torchrun would wait for nodes that never come); pass -j 3x1 (dist.ddp, dist.torchrun) or "
        "--num_replicas 3 (utils.sh)"
    )
    for dry in (["--dryrun"], []):
        res = torchx(
            home,
            "run",
            *dry,
            "-s",
            "monarch_local",
            "-cfg",
            f"pool={pool_name}",
            "utils.sh",
            "torchrun",
            "--nnodes",
            "3",
            "--nproc_per_node",
            "1",
            "train.py",
            cwd=tmp_path,
            check=False,
            timeout=60,
        )
        assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
        assert res.stderr.strip().splitlines()[-1] == want, res.stderr
    assert Registry(home).get(pool_name) is None and not agent_pids(home)


# ------------------------------------------------------------------ on a warm pool


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    with module_pool(tmp_path_factory, f"trwarm{uuid.uuid4().hex[:6]}", hosts=2) as (name, home):
        pool = attach(name, Registry(home))
        wait_for(lambda: all(pool.call(i, "info")["warm"]["ready"] for i in range(2)), 120, what="warm fork servers")
        yield name, home


def _run(home: Path, pool: str, cwd: Path, *args: str, check: bool = True):
    return torchx(
        home,
        "run",
        "--wait",
        "--log",
        "-s",
        "monarch_local",
        "-cfg",
        f"pool={pool}",
        *args,
        cwd=cwd,
        check=check,
        timeout=180,
    )


def test_ddp_trains_on_two_hosts_by_two_procs_and_replicas_agree(warm, tmp_path):
    pool, home = warm
    (tmp_path / "train.py").write_text(TRAIN)
    dry = torchx(
        home,
        "run",
        "--dryrun",
        "-s",
        "monarch_local",
        "-cfg",
        f"pool={pool}",
        "dist.ddp",
        "-j",
        "2x2",
        "--script",
        "train.py",
        cwd=tmp_path,
    ).stdout
    assert "role train: warm torchrun" in dry
    res = _run(home, pool, tmp_path, "dist.ddp", "-j", "2x2", "--script", "train.py")
    out = res.stdout + res.stderr
    found = re.findall(r"train/(\d) \[(\d)\]:params rank=(\d) world=4 init=(\w+) final=(\w+)", out)
    assert sorted(int(r) for _, _, r, _, _ in found) == [0, 1, 2, 3], out
    assert {(h, int(r) // 2) for h, _, r, _, _ in found} == {("0", 0), ("1", 1)}  # ranks 0-1 on host 0
    assert len({f for *_, f in found}) == 1 and found[0][3] != found[0][4]  # trained, and equal everywhere
    assert "SUCCEEDED" in out


def test_env_contract_is_the_real_torchruns(warm, tmp_path):
    pool, home = warm
    (tmp_path / "probe.py").write_text(PROBE)
    envs = {}
    for sched in ("local_cwd", "monarch_local"):
        d = tmp_path / sched
        d.mkdir()
        cfg = [f"pool={pool}"] if sched == "monarch_local" else [f"log_dir={tmp_path / 'lcwd'}"]
        torchx(
            home,
            "run",
            "--wait",
            "-s",
            sched,
            "-cfg",
            *cfg,
            "dist.ddp",
            "-j",
            "2x2",
            "--rdzv_port",
            str(_free_port()),
            "--env",
            f"PROBE_DIR={d}",
            "--script",
            "probe.py",
            cwd=tmp_path,
            timeout=180,
        )
        envs[sched] = {int(p.stem): json.loads(p.read_text()) for p in d.glob("*.json")}
    stock, warm_envs = envs["local_cwd"], envs["monarch_local"]
    assert sorted(stock) == sorted(warm_envs) == [0, 1, 2, 3]
    for rank in range(4):
        s, w = stock[rank], warm_envs[rank]
        for key in CONTRACT:
            assert key in s and key in w, (rank, key)
        # what differs by design: run ids and ports; the error file lives in each scheduler's log dir;
        # MASTER_ADDR is the pool's address of the first host (stock: that host's FQDN)
        differ = {"TORCHELASTIC_RUN_ID", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "MASTER_ADDR"}
        assert {k: s[k] for k in CONTRACT if k not in differ} == {k: w[k] for k in CONTRACT if k not in differ}, rank
        assert w["TORCHELASTIC_RUN_ID"].startswith(pool + ":") and s["TORCHELASTIC_RUN_ID"]
        assert w["TORCHELASTIC_ERROR_FILE"].endswith("error.json")
    assert {w["MASTER_ADDR"] for w in warm_envs.values()} == {"127.0.0.1"}
    assert len({w["MASTER_PORT"] for w in warm_envs.values()}) == 1


def _flaky_app(script: str, max_restarts: int, env: dict, nnodes: int):
    from torchx.specs import AppDef, Role

    args = [
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        f"localhost:{_free_port()}",
        "--rdzv_id",
        "flaky",
        "--nnodes",
        str(nnodes),
        "--nproc_per_node",
        "2",
        "--max_restarts",
        str(max_restarts),
        "--tee",
        "3",
        script,
    ]
    return AppDef(
        name="flaky",
        roles=[Role(name="flaky", image=".", entrypoint="torchrun", args=args, num_replicas=nnodes, env=dict(env))],
    )


def _runner_outcome(sched: str, cfg: dict, app, cwd: Path):
    from torchx.runner import get_runner

    old = os.getcwd()
    os.chdir(cwd)
    try:
        with get_runner() as runner:
            h = runner.run(app, sched, cfg)
            # the app is FAILED as soon as one replica is; the others end a moment later
            done = ("SUCCEEDED", "FAILED", "CANCELLED")
            want = [True] * app.roles[0].num_replicas
            st = wait_for(
                lambda: (
                    (s := runner.status(h))
                    and s.is_terminal()  # (local_cwd lists no replicas)
                    and (not s.roles or [r.state.name in done for rs in s.roles for r in rs.replicas] == want)
                    and s
                ),
                120,
                what=f"flaky app on {sched}",
            )
            logs = "".join(
                line if line.endswith("\n") else line + "\n"
                for k in range(app.roles[0].num_replicas)
                for line in runner.log_lines(h, "flaky", k)
            )
            return st, sorted(set(re.findall(r"attempt rank=(\d) restart=(\d)", logs)))
    finally:
        os.chdir(old)


@pytest.fixture
def flaky(warm, tmp_path, monkeypatch):
    pool, pool_home = warm
    (tmp_path / "flaky.py").write_text(FLAKY)
    monkeypatch.setenv("MONARCH_TORCHX_HOME", str(pool_home))
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ['PATH']}")  # stock local_cwd finds torchrun
    return pool


def test_a_failure_ends_as_with_the_real_torchrun(flaky, tmp_path):
    env = {"FAIL_RANK": "1", "FAIL_TIMES": "99"}
    stock, stock_attempts = _runner_outcome(
        "local_cwd", {"log_dir": str(tmp_path / "lcwd")}, _flaky_app("flaky.py", 0, env, 1), tmp_path
    )
    ours, attempts = _runner_outcome("monarch_local", {"pool": flaky}, _flaky_app("flaky.py", 0, env, 1), tmp_path)
    assert (stock.state.name, stock_attempts) == (ours.state.name, attempts) == ("FAILED", [("0", "0"), ("1", "0")])
    # the replica's message names the failing rank and its exit code (torchrun's summary, in one line)
    assert re.search(r"flaky/0: exited with code 1: .*rank 1 \(local_rank 1 on \S+\) exited with code 3", ours.msg), (
        ours.msg
    )


# (stock torchrun 2.13 is no reference for restarts: after one, its new workers often hang in
# init_process_group, reading the old attempt's keys from the store it keeps across rounds; each
# round of the pool's rendezvous has a store of its own)
@pytest.mark.parametrize("nnodes", [1, 2])
@pytest.mark.parametrize("fail_times,final", [(1, "SUCCEEDED"), (99, "FAILED")])
def test_a_failing_worker_restarts_the_role_on_every_host(flaky, tmp_path, nnodes, fail_times, final):
    env = {"FAIL_RANK": str(2 * nnodes - 1), "FAIL_TIMES": str(fail_times)}
    ours, attempts = _runner_outcome("monarch_local", {"pool": flaky}, _flaky_app("flaky.py", 1, env, nnodes), tmp_path)
    assert ours.state.name == final, ours.msg
    assert attempts == [(str(r), str(a)) for r in range(2 * nnodes) for a in range(2)]  # every rank ran twice
    if final == "FAILED":
        assert re.search(rf"rank {2 * nnodes - 1} \(local_rank 1 on \S+\) exited with code 3", ours.msg), ours.msg
        assert "(after 1 restart)" in ours.msg


def test_the_ddp_tutorial_runs_unchanged_in_a_workspace_and_resumes_from_its_snapshot(warm, tmp_path):
    pool, home = warm
    ws = tmp_path / "proj"
    ws.mkdir()
    (ws / "ddp_snapshot.py").write_text((Path(__file__).parents[1] / "examples" / "ddp_snapshot.py").read_text())

    def run(epochs: int) -> str:
        res = torchx(
            home,
            "run",
            "--wait",
            "--log",
            "-s",
            "monarch_local",
            "-cfg",
            f"pool={pool},workspace_mount=tut",
            "dist.ddp",
            "-j",
            "2x2",
            "--script",
            "ddp_snapshot.py",
            "--",
            str(epochs),
            "2",
            cwd=ws,
            timeout=240,
        )
        return res.stdout + res.stderr

    first = run(4)
    assert "resuming" not in first and len(re.findall(r"epoch 3 \| loss", first)) == 4, first
    snap = home / "workspaces" / pool / "tut" / "shared" / "snapshot.pt"  # rank 0's, in the hosts' shared cwd
    assert snap.is_file() and len(re.findall(r"snapshot saved at " + re.escape(str(snap)), first)) == 2, first
    second = run(6)
    assert len(re.findall(r"resuming from snapshot at epoch 4", second)) == 4, second
    assert "epoch 3 | loss" not in second and len(re.findall(r"epoch 5 \| loss", second)) == 4


def test_cancel_stops_every_worker_on_every_host(warm, tmp_path):
    pool, home = warm
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    h = _handle(
        torchx(
            home,
            "run",
            "-s",
            "monarch_local",
            "-cfg",
            f"pool={pool}",
            "dist.ddp",
            "-j",
            "2x2",
            "--script",
            "sleeper.py",
            cwd=tmp_path,
        )
    )
    wait_for(
        lambda: len(re.findall(r"sleeping rank", torchx(home, "log", h, check=False).stdout)) == 4, 60, what="4 workers"
    )
    torchx(home, "cancel", h)
    wait_for(lambda: _status(home, h).get("State") == "CANCELLED", 30, what="cancelled")
    workers = [int(p) for p in re.findall(r"pid=(\d+)", torchx(home, "log", h).stdout)]
    wait_for(lambda: not [p for p in workers if os.path.exists(f"/proc/{p}")], 15, what="workers to exit")


def test_bad_torchrun_input_fails_clearly(warm, tmp_path):
    pool, home = warm
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "broken.py").write_text("import torch\ndef f(:\n    pass\n")
    # --nnodes the role can never meet: refused before anything starts
    res = torchx(
        home,
        "run",
        "-s",
        "monarch_local",
        "-cfg",
        f"pool={pool}",
        "utils.sh",
        "torchrun",
        "--rdzv_backend",
        "c10d",
        "--nnodes",
        "3",
        "train.py",
        cwd=tmp_path,
        check=False,
    )
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "torchx: error: role 'sh': torchrun --nnodes 3 asks for 3 node(s) but the role has 1" in res.stderr
    # a syntax error: FAILED naming the rank and code; the log has Python's own report
    res = _run(home, pool, tmp_path, "dist.ddp", "-j", "1x2", "--script", "broken.py", check=False)
    out = res.stdout + res.stderr
    assert res.returncode == 1 and "SyntaxError" in out
    assert "forkserver.py" not in out and "torchrun_node.py" not in out.split("SyntaxError")[0]
    assert re.search(r"rank \d \(local_rank \d on \S+\) exited with code 1", out), out
    # an unknown flag: the real torchrun runs and says what is wrong
    dry = torchx(
        home,
        "run",
        "--dryrun",
        "-s",
        "monarch_local",
        "-cfg",
        f"pool={pool}",
        "utils.sh",
        "torchrun",
        "--rdzv_backend",
        "c10d",
        "--bogus",
        "train.py",
        cwd=tmp_path,
    ).stdout
    assert "real torchrun: torchrun would not accept the command" in dry
    res = _run(
        home, pool, tmp_path, "utils.sh", "torchrun", "--rdzv_backend", "c10d", "--bogus", "train.py", check=False
    )
    assert res.returncode == 1 and "unrecognized arguments: --bogus" in res.stdout + res.stderr  # torchrun's words
    # more procs than cores: a warning, then it works
    res = _run(home, pool, tmp_path, "dist.ddp", "-j", "1x3", "--script", "train.py")
    out = res.stdout + res.stderr
    if (os.cpu_count() or 1) < 3:
        assert "more than this host's" in out
    assert len(re.findall(r"params rank=\d world=3", out)) == 3


def test_thread_counts_reach_forked_workers_and_spmd_runs_warm(warm, tmp_path):
    pool, home = warm
    (tmp_path / "threads.py").write_text(
        "import os, torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
        "print('threads', os.environ['RANK'], os.environ['OMP_NUM_THREADS'], torch.get_num_threads(), flush=True)\n"
        # (no rank leaves before the others are connected: gloo's mesh may still be forming on a loaded machine)
        "dist.barrier()\ndist.destroy_process_group()\n"
    )
    # (spmd's default -h gpu.small asks 32 GB, more than these hosts have: a CPU size, as on a laptop)
    for component, env, want in (
        ("dist.ddp", ["--env", "OMP_NUM_THREADS=2"], "2"),
        ("dist.spmd", ["-h", "cpu.small"], "1"),
    ):
        dry = torchx(
            home,
            "run",
            "--dryrun",
            "-s",
            "monarch_local",
            "-cfg",
            f"pool={pool}",
            component,
            "-j",
            "1x2",
            *env,
            "--script",
            "threads.py",
            cwd=tmp_path,
        ).stdout
        assert "warm torchrun" in dry, dry
        res = _run(home, pool, tmp_path, component, "-j", "1x2", *env, "--script", "threads.py")
        found = sorted(re.findall(r"threads (\d) (\d+) (\d+)", res.stdout + res.stderr))
        assert found == [("0", want, want), ("1", want, want)], res.stdout + res.stderr


def test_two_ddp_apps_at_once_on_one_pool_need_no_port(warm, tmp_path):
    pool, home = warm
    (tmp_path / "train.py").write_text(TRAIN)
    handles = [
        _handle(
            torchx(
                home,
                "run",
                "-s",
                "monarch_local",
                "-cfg",
                f"pool={pool}",
                "dist.ddp",
                "-j",
                "2x1",
                "--script",
                "train.py",
                cwd=tmp_path,
            )
        )
        for _ in range(2)
    ]
    for h in handles:
        wait_for(lambda: _status(home, h).get("State") in ("SUCCEEDED", "FAILED"), 120, what=h)  # noqa: B023
        assert _status(home, h)["State"] == "SUCCEEDED", torchx(home, "log", h).stdout


def test_forked_traceback_is_line_for_line_the_interpreters(warm, tmp_path):
    import subprocess
    import sys

    pool, home = warm
    (tmp_path / "fail.py").write_text("import torch\n\ndef f():\n    raise ValueError('boom')\n\nf()\n")
    real = subprocess.run([sys.executable, "fail.py"], cwd=tmp_path, capture_output=True, text=True).stderr
    h = _handle(
        torchx(
            home,
            "run",
            "-s",
            "monarch_local",
            "-cfg",
            f"pool={pool}",
            "utils.python",
            "--script",
            "fail.py",
            cwd=tmp_path,
        )
    )
    wait_for(lambda: _status(home, h).get("State") == "FAILED", 60, what="fail.py")
    ours = "".join(
        line.split(" ", 1)[1] + "\n" if " " in line else "\n" for line in torchx(home, "log", h).stdout.splitlines()
    )
    assert ours.strip() == real.strip()


def _warm_fork_server(agent_pid: int) -> int:
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == agent_pid:
                cmd = (p / "cmdline").read_bytes().split(b"\0")
                if b"monarch_torchx.agent.forkserver" in cmd and b"torch" in cmd:
                    return int(p.name)
        except (OSError, ValueError, IndexError):
            continue
    raise AssertionError(f"no warm fork server under agent {agent_pid}")


def test_cancel_during_rendezvous_ends_the_waiting_node(home, pool_name, tmp_path):
    import subprocess

    from .conftest import TORCHX, cli_env

    ensure_pool(PoolRequest("monarch_local", pool_name, {"hosts": 2, "preload": "torch"}))
    pool = attach(pool_name)
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    held = _warm_fork_server(pool.hosts[1].pid)
    os.kill(held, signal.SIGSTOP)  # host 1's node cannot start: host 0's node waits in the rendezvous
    try:
        run = subprocess.Popen(
            [
                TORCHX,
                "run",
                "-s",
                "monarch_local",
                "-cfg",
                f"pool={pool_name}",
                "dist.ddp",
                "-j",
                "2x1",
                "--script",
                "sleeper.py",
            ],
            cwd=tmp_path,
            env=cli_env(home),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        rec = Registry().get(pool_name)
        app = wait_for(lambda: Registry.list_apps(rec), 60, what="the app record")[0]
        node0 = wait_for(
            lambda: [r for r in pool.call(0, "describe", app_id=app.app_id) if r["state"] == "RUNNING"],
            30,
            what="node 0 to start",
        )[0]
        time.sleep(1.0)
        assert (
            "sleeping"
            not in torchx(home, "log", f"monarch_local://torchx/{pool_name}:{app.app_id}/sleeper/0", check=False).stdout
        )  # still in the rendezvous
        torchx(home, "cancel", f"monarch_local://torchx/{pool_name}:{app.app_id}")
    finally:
        os.kill(held, signal.SIGCONT)
    out, err = run.communicate(timeout=60)
    handle = f"monarch_local://torchx/{pool_name}:{app.app_id}"
    wait_for(lambda: _status(home, handle).get("State") == "CANCELLED", 30, what="cancelled")
    states = wait_for(
        lambda: (st := pool.call(1, "describe", app_id=app.app_id)) and st[0]["state"] != "RUNNING" and st,
        30,
        what="node 1 to end",
    )
    assert states[0]["state"] == "CANCELLED"
    assert not os.path.exists(f"/proc/{node0['pid']}")


def test_a_lost_host_fails_the_role_instead_of_hanging(home, pool_name, tmp_path):
    ensure_pool(PoolRequest("monarch_local", pool_name, {"hosts": 2, "preload": "torch"}))
    pool = attach(pool_name)
    wait_for(lambda: all(pool.call(i, "info")["warm"]["ready"] for i in range(2)), 120, what="warm")
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    h = _handle(
        torchx(
            home,
            "run",
            "-s",
            "monarch_local",
            "-cfg",
            f"pool={pool_name}",
            "dist.ddp",
            "-j",
            "2x1",
            "--script",
            "sleeper.py",
            cwd=tmp_path,
        )
    )
    wait_for(
        lambda: len(re.findall(r"sleeping rank", torchx(home, "log", h, check=False).stdout)) == 2, 60, what="2 workers"
    )
    os.kill(pool.hosts[1].pid, signal.SIGKILL)  # host 1 is gone, with its fork servers and workers
    t0 = time.time()
    wait_for(lambda: _status(home, h).get("State") == "FAILED", 60, what="the app to fail")
    assert time.time() - t0 < 60
