"""Issue 40: a pool that shares itself. Capacity per host, placement by what each replica asks,
GPUs never shared by mistake, and a queue held by the pool that outlives the client.

GPUs are declared (``-cfg gpus_per_host=2``): these hosts have none, and the declared devices go
through the same admission, placement and ``CUDA_VISIBLE_DEVICES`` as detected ones.
"""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from monarch_torchx.errors import MonarchError
from monarch_torchx.registry import Registry

from .conftest import torchx, wait_for
from .test_history import _handle, _status

pytestmark = pytest.mark.integration

RUN = ("run", "-s", "monarch_local")
# prints where it ran and which GPUs it holds, then sleeps until the file it names exists
HOLD = (
    "import os,sys,time\n"
    "print('at',os.environ['MONARCH_TORCHX_HOST_INDEX'],'cvd',os.environ.get('CUDA_VISIBLE_DEVICES'),flush=True)\n"
    "while not os.path.exists(sys.argv[1]): time.sleep(0.1)"
)


def _ddp(home, pool_name: str, j: str, *args: str, cwd) -> str:
    """``torchx run`` of ``dist.ddp -j J --gpu 1 --script train.py ARGS`` on the pool; its handle."""
    cmd = ["-cfg", f"pool={pool_name}", "dist.ddp", "-j", j, "--gpu", "1", "--script", "train.py"]
    return _handle(torchx(home, *RUN, *cmd, *(["--", *args] if args else []), cwd=cwd))


def _kill_agent(home, pool_name: str, index: int) -> None:
    """SIGKILL of one host's agent (its replicas go with it)."""
    rec = Registry(home).get(pool_name)
    assert rec is not None
    agent = Registry.read_host(rec.path, index)
    assert agent is not None
    os.kill(agent.pid, signal.SIGKILL)


def _where(home, handle) -> tuple[str, str]:
    """(host index, CUDA_VISIBLE_DEVICES) the replica printed."""

    def found():
        return re.search(r"\bat (\d+) cvd (\S+)", torchx(home, "log", handle, check=False).stdout)

    m = wait_for(found, timeout=30, what=f"{handle} to print where it runs")
    return m.group(1), m.group(2)


def _hold(home, cfg: str, release, *extra: str, gpu: int = 0):
    return torchx(home, *RUN, "-cfg", cfg, "utils.python", "--gpu", str(gpu), *extra, "-c", HOLD, "--", str(release))


def test_apps_spread_over_hosts_and_capacity_shows_in_status(home, pool_name, tmp_path):
    release = tmp_path / "go"
    cfg = f"pool={pool_name},hosts=2,preload=none,cpus_per_host=2"
    handles = [_handle(_hold(home, cfg, release)) for _ in range(4)]
    hosts = sorted(_where(home, h)[0] for h in handles)
    assert hosts == ["0", "0", "1", "1"]  # four one-CPU apps on two 2-CPU hosts: two each, not four on host 0

    status = json.loads(torchx(home, "pool", "status", pool_name, "--json").stdout)
    for h in status["hosts"]:
        cap = h["capacity"]
        assert cap["total"]["cpus"] == 2 and cap["used"]["cpus"] == 2 and cap["sources"]["cpus"] == "declared"
        assert len(cap["holdings"]) == 2 and cap["gpu_note"].startswith("no GPUs")
    text = torchx(home, "pool", "status", pool_name).stdout
    assert "cpus 2/2" in text

    # a fifth waits in the pool's queue, says for what, and starts when one ends
    fifth = _hold(home, f"pool={pool_name}", tmp_path / "go5")
    assert "waits in the queue of pool" in fifth.stderr and "1 CPU" in fifth.stderr
    h5 = _handle(fifth)
    st = _status(home, h5)
    assert st["state"] == "PENDING" and "waits for 1 CPU, 1024 MB; 1st in queue" in st["msg"]
    listed = torchx(home, "list", "-s", "monarch_local").stdout
    assert any(h5.split("/")[-1] in line and "PENDING" in line for line in listed.splitlines())
    release.touch()
    wait_for(lambda: all(_status(home, h)["state"] == "SUCCEEDED" for h in handles), what="the four to end")
    wait_for(lambda: _status(home, h5)["state"] == "RUNNING", what="the queued app to start")
    (tmp_path / "go5").touch()
    wait_for(lambda: _status(home, h5)["state"] == "SUCCEEDED", what="the queued app to end")


def test_gpus_are_exclusive_and_a_run_that_does_not_fit_waits_or_is_refused(home, pool_name, tmp_path):
    go_a, go_b = tmp_path / "a", tmp_path / "b"
    cfg = f"pool={pool_name},hosts=1,preload=none,gpus_per_host=2"
    a = _handle(_hold(home, cfg, go_a, gpu=1))
    b = _handle(_hold(home, f"pool={pool_name}", go_b, gpu=1))
    assert {_where(home, a)[1], _where(home, b)[1]} == {"0", "1"}  # disjoint devices

    text = torchx(home, "pool", "status", pool_name).stdout
    assert "gpus 2/2 used" in text and "HELD BY" in text

    # larger than any host: refused at submit, in one line naming the biggest host
    big = torchx(home, *RUN, "-cfg", f"pool={pool_name}", "utils.python", "--gpu", "4", "-c", "0", check=False)
    assert big.returncode != 0 and "the biggest, host 0, has 2 GPU(s)" in big.stderr
    assert "Traceback" not in big.stderr and len(big.stderr.strip().splitlines()) <= 2

    # queue=False refuses what does not fit now
    no = torchx(
        home, *RUN, "-cfg", f"pool={pool_name},queue=False", "utils.python", "--gpu", "2", "-c", "0", check=False
    )
    assert no.returncode != 0 and "queue=False" in no.stderr and "Traceback" not in no.stderr

    # two queued: the first is cancelled while it waits, the second runs on the freed devices
    c = _handle(_hold(home, f"pool={pool_name}", tmp_path / "c", gpu=2))
    d = _handle(_hold(home, f"pool={pool_name}", tmp_path / "d", gpu=2))
    assert _status(home, c)["state"] == "PENDING" and "2nd in queue" in _status(home, d)["msg"]
    torchx(home, "cancel", c)
    st = _status(home, c)
    assert st["state"] == "CANCELLED", st
    assert torchx(home, "log", c).stdout == ""  # it never ran: no lines, and no host to ask for them
    go_a.touch()
    go_b.touch()
    wait_for(lambda: _status(home, d)["state"] == "RUNNING", what="the second queued app to start")
    assert _where(home, d)[1] == "0,1"
    (tmp_path / "d").touch()
    wait_for(lambda: _status(home, d)["state"] == "SUCCEEDED", what="it to end")


def test_the_queue_outlives_its_client_and_host0_and_pool_stop_cancels_it(home, pool_name, tmp_path):
    go = tmp_path / "go"
    cfg = f"pool={pool_name},hosts=2,preload=none,gpus_per_host=1"
    first = [_handle(_hold(home, cfg, go, gpu=1)) for _ in range(2)]
    assert sorted(_where(home, h)[0] for h in first) == ["0", "1"]
    queued = _handle(_hold(home, f"pool={pool_name}", tmp_path / "q", gpu=1))  # its client exits at once
    assert _status(home, queued)["state"] == "PENDING"

    # host 0, which holds the queue, is killed; the next run repairs it and the new agent reads it back
    _kill_agent(home, pool_name, 0)
    wait_for(lambda: _status(home, queued)["state"] in ("UNKNOWN", "PENDING"), what="status without host 0")
    go.touch()
    torchx(home, *RUN, "-cfg", f"pool={pool_name}", "utils.echo", "--msg", "repair")
    wait_for(lambda: _status(home, queued)["state"] == "RUNNING", timeout=60, what="the read-back app to start")
    (tmp_path / "q").touch()
    wait_for(lambda: _status(home, queued)["state"] == "SUCCEEDED", what="it to end")

    # occupy both GPUs, queue one more, stop the pool: the queued one ends CANCELLED with the reason
    go2 = tmp_path / "go2"
    [_hold(home, f"pool={pool_name}", go2, gpu=1) for _ in range(2)]
    last = _handle(_hold(home, f"pool={pool_name}", go2, gpu=1))
    assert _status(home, last)["state"] == "PENDING"
    torchx(home, "pool", "stop", pool_name)
    st = _status(home, last)
    assert st["state"] == "CANCELLED" and "pool was stopped" in st["msg"], st


def _hold_task(release: str, seen: str) -> str:
    """A submitit task: notes that it runs (a file per task), then waits for ``release``."""
    import os
    import time
    import uuid
    from pathlib import Path

    Path(seen, uuid.uuid4().hex).write_text(os.environ["MONARCH_TORCHX_HOST_INDEX"])
    while not os.path.exists(release):
        time.sleep(0.05)
    return os.environ["MONARCH_TORCHX_HOST_INDEX"]


def test_submitit_map_array_runs_what_fits_and_queues_the_rest(home, pool_name, tmp_path):
    import submitit

    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=2,preload=none,cpus_per_host=1")
    release, seen = tmp_path / "release", tmp_path / "seen"
    seen.mkdir()
    ex = submitit.AutoExecutor(folder=str(tmp_path / "logs" / "%j"), cluster="monarch")
    ex.update_parameters(monarch_pool=pool_name, cpus_per_task=1, timeout_min=5)
    jobs = ex.map_array(_hold_task, [str(release)] * 6, [str(seen)] * 6)
    wait_for(lambda: len(list(seen.iterdir())) == 2, what="two tasks to run")
    states = [j.state for j in jobs]
    assert states.count("RUNNING") == 2 and states.count("PENDING") == 4, states  # one per 1-CPU host
    assert sorted(p.read_text() for p in seen.iterdir()) == ["0", "1"]
    jobs[-1].cancel()  # a queued task is cancelled where it waits
    assert jobs[-1].state == "CANCELLED"
    release.touch()
    assert sorted(j.result() for j in jobs[:-1]).count("0") >= 1
    assert len(list(seen.iterdir())) == 5  # the cancelled one never ran

    # more than any host has: refused at submit, naming the biggest host
    big = submitit.AutoExecutor(folder=str(tmp_path / "logs2"), cluster="monarch")
    big.update_parameters(monarch_pool=pool_name, mem_gb=10**6)
    with pytest.raises(MonarchError, match=r"asks \d+ MB, more than any host .* MB of memory"):
        big.submit(_hold_task, str(release), str(seen))


def test_an_actor_mesh_and_an_app_never_share_a_gpu(home, pool_name, tmp_path):
    from monarch_torchx import attach
    from tests.fixtures.actors import GpuHolder

    # (8 CPUs: dist.ddp asks 2 by default, and only GPUs are to be short here)
    torchx(home, "pool", "create", pool_name, "-cfg", "hosts=1,preload=none,gpus_per_host=2,cpus_per_host=8")
    procs = attach(pool_name).spawn_procs(per_host={"gpus": 1})  # Monarch's "gpus" dim: one GPU per proc
    try:
        assert list(procs.spawn("holder", GpuHolder).visible.call().get().values()) == ["0"]
        (tmp_path / "train.py").write_text(HOLD)  # a warm torchrun node: its worker gets the node's GPU
        app = _ddp(home, pool_name, "1x1", str(tmp_path / "a"), cwd=tmp_path)
        assert _where(home, app)[1] == "1"
        waits = _handle(_hold(home, f"pool={pool_name}", tmp_path / "b", gpu=1))
        assert _status(home, waits)["state"] == "PENDING"
        with pytest.raises(MonarchError, match="asks 1 GPU, and gpus are short"):  # no device free: refused
            attach(pool_name).spawn_procs(per_host={"gpus": 1}).initialized.get()
    finally:
        procs.stop().get()
    wait_for(lambda: _status(home, waits)["state"] == "RUNNING", what="the waiting app to get the mesh's GPU")
    assert _where(home, waits)[1] == "0"
    (tmp_path / "a").touch()
    (tmp_path / "b").touch()
    wait_for(lambda: _status(home, waits)["state"] == "SUCCEEDED", what="it to end")


def test_a_queued_gang_says_so_when_the_hosts_it_needs_do_not_answer(home, pool_name, tmp_path):
    go = tmp_path / "go"
    cfg = f"pool={pool_name},hosts=2,preload=none,gpus_per_host=1,cpus_per_host=8"
    [_handle(_hold(home, cfg, go, gpu=1)) for _ in range(2)]
    (tmp_path / "train.py").write_text("print('ran')")
    gang = _ddp(home, pool_name, "2x1", cwd=tmp_path)
    assert "waits for 2 GPUs" in _status(home, gang)["msg"] and "on 2 hosts" in _status(home, gang)["msg"]
    _kill_agent(home, pool_name, 1)  # the gang needs two distinct hosts: one does not answer now
    wait_for(
        lambda: "cannot start on the 1 of 2 host(s) that answer now" in _status(home, gang)["msg"],
        what="the queue to say the gang cannot start on what is left",
    )
    assert _status(home, gang)["state"] == "PENDING"  # (the host may come back: it still waits)
    go.touch()
