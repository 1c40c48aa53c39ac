"""Issue 41: `breakpoint()` in a pool's processes and `monarch-torchx debug`: list the paused ones
(app, role, rank, host, file:line), cast a pdb command to several, attach with a real pdb session
through a pseudo-terminal here, continue; the faults: two clients, a process that ends attached."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .conftest import BIN, cli_env, torchx, wait_for
from .test_shell import Terminal

pytestmark = pytest.mark.integration

MT = str(BIN / "monarch-torchx")
PAUSES = textwrap.dedent(
    """\
    import os
    rank = int(os.environ["MONARCH_TORCHX_HOST_INDEX"])
    x = 10 * (rank + 1)
    breakpoint()
    y = x + 1
    print("done", rank, y, flush=True)
    """
)


def mt(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([MT, *args], env=cli_env(home), capture_output=True, text=True, timeout=120)


def paused(home: Path, pool: str, n: int) -> list[dict]:
    def listed() -> list[dict] | None:
        res = mt(home, "debug", "--pool", pool, "--json")
        assert res.returncode == 0, res.stderr
        got = json.loads(res.stdout)
        return got if len(got) == n else None

    return wait_for(listed, timeout=60, interval=0.3, what=f"{n} paused process(es)")


def _status(home: Path, handle: str) -> str:
    return torchx(home, "status", handle).stdout


def test_breakpoints_in_two_replicas_are_listed_cast_to_attached_and_continued(home, pool_name, tmp_path):
    (tmp_path / "pauses.py").write_text(PAUSES)
    cfg = f"pool={pool_name},hosts=2,preload=none"
    res = torchx(
        home,
        "run",
        "-s",
        "monarch_local",
        "-cfg",
        cfg,
        "utils.python",
        "--num_replicas",
        "2",
        "--script",
        "pauses.py",
        cwd=tmp_path,
    )
    handle = res.stdout.strip().splitlines()[-1]
    app = handle.rsplit(":", 1)[-1]
    found = paused(home, pool_name, 2)
    assert [(p["app_id"], p["role"], p["replica"], p["host"]) for p in found] == [
        (app, "python", 0, 0),
        (app, "python", 1, 1),
    ]
    assert all(p["where"] == f"{tmp_path / 'pauses.py'}:4" for p in found)
    table = mt(home, "debug", "--pool", pool_name).stdout
    assert "python/0" in table and "python/1" in table and "pauses.py:4" in table

    res = mt(home, "debug", "--pool", pool_name, "--cast", "p x")  # one command to both, each one's answer
    assert res.returncode == 0, res.stderr
    p0, p1 = (f"{p['host']}:{p['pid']}" for p in found)
    assert f"[{p0} python/0] 10" in res.stdout.splitlines() and f"[{p1} python/1] 20" in res.stdout.splitlines()

    # a real pdb session on rank 1, through a terminal: p, l, n, then continue
    t = Terminal(home, "debug", "--pool", pool_name, "--attach", p1)
    t.expect(rb"-> y = x \+ 1\r\n\(Pdb\) ")
    t.type(b"p x * 2\r")
    t.expect(rb"\r\n40(\r\n)+\(Pdb\) ")  # (the terminal may put a blank line before the prompt)
    t.type(b"l\r")
    t.expect(rb"4  \tbreakpoint\(\)(\r\n)+  5  ->\ty = x \+ 1")  # (blank lines between, as above)
    t.type(b"n\r")
    t.expect(rb"-> print\(\"done\", rank, y, flush=True\)")
    t.type(b"p y\r")
    t.expect(rb"\r\n21\r\n")
    t.type(b"c\r")
    t.expect(rb"process \d+ on host 1 continued")
    assert t.exit_code() == 0

    assert len(paused(home, pool_name, 1)) == 1  # rank 0 still waits
    res = mt(home, "debug", "--pool", pool_name, "--continue")
    assert res.returncode == 0 and f"[{p0} python/0] continued" in res.stdout, res.stdout + res.stderr
    wait_for(lambda: "SUCCEEDED" in _status(home, handle), timeout=60, what="the app ended")
    log = torchx(home, "log", handle).stdout
    assert "python/0 done 0 11" in log and "python/1 done 1 21" in log


def test_a_second_client_is_refused_and_a_process_that_ends_attached_ends_the_session(home, pool_name, tmp_path):
    (tmp_path / "pauses.py").write_text(PAUSES)
    cfg = f"pool={pool_name},hosts=1,preload=none"
    res = torchx(home, "run", "-s", "monarch_local", "-cfg", cfg, "utils.python", "--script", "pauses.py", cwd=tmp_path)
    handle = res.stdout.strip().splitlines()[-1]
    (p,) = paused(home, pool_name, 1)
    target = f"0:{p['pid']}"
    t = Terminal(home, "debug", "--pool", pool_name, "--attach", target)
    t.expect(rb"\(Pdb\) ")
    second = mt(home, "debug", "--pool", pool_name, "--attach", target)
    assert second.returncode == 1
    assert second.stderr.strip() == (
        f"error: cannot attach to process {p['pid']} on host 0: "
        f"process {p['pid']} on host 0 is already attached by another client"
    )
    listed = json.loads(mt(home, "debug", "--pool", pool_name, "--json").stdout)
    assert listed[0]["attached"] is True
    t.type(b"import os; os._exit(3)\r")
    t.expect(rb"process \d+ on host 0 ended while attached")
    assert t.exit_code() == 0
    wait_for(lambda: "FAILED" in _status(home, handle), timeout=60, what="the app failed")
    assert json.loads(mt(home, "debug", "--pool", pool_name, "--json").stdout) == []
    res = mt(home, "debug", "--pool", pool_name, "--cast", "p 1")
    assert res.returncode == 1 and "is paused at a breakpoint" in res.stderr


def test_a_breakpoint_in_an_actor_endpoint_pauses_that_proc_for_debug(home, pool_name, tmp_path):
    script = tmp_path / "actor_bp.py"
    script.write_text(
        textwrap.dedent(
            f"""\
            from monarch_torchx import Actor, attach, endpoint

            class Stepper(Actor):
                @endpoint
                def step(self, n: int) -> int:
                    m = n * 3
                    breakpoint()
                    return m + 1

            procs = attach({pool_name!r}).spawn_procs(per_host={{"procs": 1}})
            steppers = procs.spawn("steppers", Stepper)
            print("answer", steppers.step.call_one(4).get(timeout=120), flush=True)
            procs.stop().get()
            """
        )
    )
    res = mt(home, "pool", "create", pool_name, "-cfg", "hosts=1,preload=none")
    assert res.returncode == 0, res.stderr
    controller = subprocess.Popen(
        [sys.executable, str(script)],
        env=cli_env(home),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        (p,) = paused(home, pool_name, 1)
        assert p["function"] == "step" and p["role"] == "proc"
        res = mt(home, "debug", "--pool", pool_name, "--cast", "p m")
        assert res.stdout.strip().endswith("12"), res.stdout + res.stderr
        res = mt(home, "debug", "--pool", pool_name, "--continue")
        assert res.returncode == 0, res.stderr
        out, err = controller.communicate(timeout=120)
        assert controller.returncode == 0 and "answer 13" in out, err[-3000:]
    finally:
        if controller.poll() is None:
            controller.kill()
            controller.wait()


def test_post_mortem_pauses_a_replica_where_its_uncaught_exception_was_raised(home, pool_name, tmp_path):
    (tmp_path / "fails.py").write_text(
        textwrap.dedent(
            """\
            def step(batch):
                scale = 0
                return batch / scale

            step(7)
            """
        )
    )
    cfg = f"pool={pool_name},hosts=1,preload=none"
    res = torchx(home, "run", "-s", "monarch_local", "-cfg", cfg, "utils.python", "--script", "fails.py", cwd=tmp_path)
    first = res.stdout.strip().splitlines()[-1]
    wait_for(lambda: "FAILED" in _status(home, first), timeout=60, what="the app failed at once")  # not asked: no pause
    assert json.loads(mt(home, "debug", "--pool", pool_name, "--json").stdout) == []

    res = torchx(
        home, "run", "-s", "monarch_local", "-cfg", f"{cfg},post_mortem=True", "utils.python", "--script", "fails.py",
        cwd=tmp_path,
    )  # fmt: skip
    handle = res.stdout.strip().splitlines()[-1]
    (p,) = paused(home, pool_name, 1)
    assert (p["role"], p["where"], p["function"]) == ("python", f"{tmp_path / 'fails.py'}:3", "step")
    res = mt(home, "debug", "--pool", pool_name, "--cast", "p batch, scale")
    assert res.returncode == 0 and res.stdout.rstrip().endswith("(7, 0)"), res.stdout + res.stderr
    assert "RUNNING" in _status(home, handle)  # paused, not ended
    assert mt(home, "debug", "--pool", pool_name, "--continue").returncode == 0
    wait_for(lambda: "FAILED" in _status(home, handle), timeout=60, what="the app to end with its error")
    log = torchx(home, "log", handle, check=False).stdout
    assert "ZeroDivisionError: division by zero" in log and "paused at" in log


def test_quitting_a_breakpoint_under_post_mortem_ends_the_process_and_does_not_pause_it_again(
    home, pool_name, tmp_path
):
    (tmp_path / "pauses.py").write_text(PAUSES)
    cfg = f"pool={pool_name},hosts=1,preload=none,post_mortem=True"
    res = torchx(home, "run", "-s", "monarch_local", "-cfg", cfg, "utils.python", "--script", "pauses.py", cwd=tmp_path)
    handle = res.stdout.strip().splitlines()[-1]
    paused(home, pool_name, 1)
    assert mt(home, "debug", "--pool", pool_name, "--cast", "q").returncode == 0
    wait_for(lambda: "FAILED" in _status(home, handle), timeout=60, what="the app to end (BdbQuit)")
    assert json.loads(mt(home, "debug", "--pool", pool_name, "--json").stdout) == []
