"""Issue 41: `monarch-torchx exec` (and `torchx pool exec`): one command on some or all hosts of
a warm pool, through the real CLI, its output as it comes, the worst host's exit code as its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import BIN, cli_env, pids_running, process_alive, torchx, wait_for

pytestmark = pytest.mark.integration

MT = str(BIN / "monarch-torchx")


def mt(home: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([MT, *args], env=cli_env(home), capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def pool(home, pool_name):
    res = mt(home, "pool", "create", pool_name, "-cfg", "hosts=2,preload=none")
    assert res.returncode == 0, res.stderr
    return pool_name


def test_exec_on_every_host_prefixes_lines_and_exits_with_the_worst_code(home, pool):
    res = mt(
        home,
        "exec",
        "--pool",
        pool,
        "--all",
        "--",
        "sh",
        "-c",
        'echo "out of $MONARCH_TORCHX_HOST_INDEX"; echo "err of $MONARCH_TORCHX_HOST_INDEX" >&2; '
        "exit $((3 * MONARCH_TORCHX_HOST_INDEX))",
    )
    assert res.returncode == 3, res.stderr
    lines = res.stdout.splitlines()
    for i in (0, 1):
        assert f"[{i}] out of {i}" in lines and f"[{i}] err of {i}" in lines, res.stdout
    assert res.stderr.strip() == "monarch-torchx: exit codes host 1: 3 (of 2 host(s))"
    # the same through torchx, on the chosen host only, as JSON
    res = torchx(home, "pool", "exec", "--pool", pool, "--hosts", "1", "--json", "--", "echo", "a b", check=False)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["exit_code"] == 0 and [h["host"] for h in out["hosts"]] == [1]
    assert out["hosts"][0]["output"] == ["a b"] and out["hosts"][0]["state"] == "SUCCEEDED"
    listed = torchx(home, "list", "-s", "monarch_local").stdout
    assert out["app_id"] in listed  # an exec is work on the pool like any other


def test_a_command_that_is_not_there_is_127_from_that_host(home, pool):
    res = mt(home, "exec", "--pool", pool, "--hosts", "0", "--", "no-such-command-here", "x")
    assert res.returncode == 127
    assert res.stderr.strip() == (
        "monarch-torchx: exit codes host 0: 127 "
        "(No such file or directory: 'no-such-command-here' (not found on PATH)) (of 1 host(s))"
    )


def test_bad_input_is_one_line_with_usage_status(home, pool):
    for args, want in (
        (["--all"], "no command: give it after --"),
        (["--", "true"], "say where: --all (every host) or --hosts 0,2"),
        (["--hosts", "7", "--", "true"], f"pool {pool!r} has hosts 0..1; no host 7"),
        (["--all", "--timeout", "0", "--", "true"], "--timeout 0 is not a time to run"),
    ):
        res = mt(home, "exec", "--pool", pool, *args)
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert want in res.stderr and "Traceback" not in res.stderr
    res = mt(home, "exec", "--pool", "nopool", "--all", "--", "true")
    assert res.returncode == 1 and "no pool named 'nopool'" in res.stderr


def test_a_lost_host_is_reported_and_the_others_still_run(home, pool):
    from monarch_torchx.registry import Registry

    rec = Registry(home).get(pool)
    assert rec is not None
    lost = next(p for p in pids_running("monarch_torchx.agent", home) if "--index 1" in _cmdline(p))
    os.kill(lost, signal.SIGKILL)
    wait_for(lambda: not Path(f"/proc/{lost}").exists() or _zombie(lost), what="host 1's agent gone")
    res = mt(home, "exec", "--pool", pool, "--all", "--", "echo", "still here")
    assert res.returncode == 255, res.stderr
    assert "[0] still here" in res.stdout.splitlines()
    assert "[1] monarch-torchx: host 1 of pool" in res.stderr and "unreachable" in res.stderr


def test_output_is_streamed_as_it_comes_and_all_of_it_arrives(home, pool, tmp_path):
    go = tmp_path / "go"
    script = (
        "import os,sys,time\n"
        "print('first', flush=True)\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
        "line = 'x' * 99\n"
        "for i in range(50000): sys.stdout.write(f'{line} {i}\\n')\n"  # ~5 MB
    )
    p = subprocess.Popen(
        [MT, "exec", "--pool", pool, "--hosts", "0", "--", "python", "-c", script],
        env=cli_env(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    assert p.stdout.readline() == "[0] first\n"  # before the command went on: streamed, not at its end
    go.touch()
    rest = p.stdout.read().splitlines()
    assert p.wait(timeout=120) == 0, p.stderr.read() if p.stderr else ""
    assert len(rest) == 50000 and rest[-1] == f"[0] {'x' * 99} 49999"


# writes its pid into the directory it is given, says so, sleeps
SLEEP = "import os,sys,time; open(f'{sys.argv[1]}/{os.getpid()}','w'); print('started', flush=True); time.sleep(600)"


def test_ctrl_c_ends_it_on_every_host_and_a_timeout_is_124(home, pool, tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    p = subprocess.Popen(
        [MT, "exec", "--pool", pool, "--all", "--", "python", "-c", SLEEP, str(pids)],
        env=cli_env(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert p.stdout is not None
    seen = [p.stdout.readline(), p.stdout.readline()]
    assert sorted(seen) == ["[0] started\n", "[1] started\n"]
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "monarch-torchx: interrupted: the command was ended on every host"
    sleepers = [int(f.name) for f in pids.iterdir()]
    assert len(sleepers) == 2
    wait_for(lambda: not any(map(process_alive, sleepers)), timeout=15, what="the sleeps ended")
    for f in pids.iterdir():
        f.unlink()
    t0 = time.time()
    res = mt(home, "exec", "--pool", pool, "--all", "--timeout", "1", "--json", "--", "python", "-c", SLEEP, str(pids))
    assert res.returncode == 124 and time.time() - t0 < 60
    out = json.loads(res.stdout)
    assert [h["exit_code"] for h in out["hosts"]] == [124, 124]
    assert all("timed out after 1 s" in h["error"] for h in out["hosts"])
    sleepers = [int(f.name) for f in pids.iterdir()]
    wait_for(lambda: len(sleepers) == 2 and not any(map(process_alive, sleepers)), timeout=15, what="the sleeps ended")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
