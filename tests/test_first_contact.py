"""A new user's first mistakes, through the real ``torchx`` and ``monarch-torchx`` CLIs.

Each bad input gives one line that says the cause and what fixes it (no traceback), the right
exit status, and leaves no agent running (issue 38, "first contact").
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torchx

from .conftest import BIN, agent_pids, cli_env
from .conftest import torchx as run_torchx

pytestmark = pytest.mark.integration

MT = str(BIN / "monarch-torchx")
TORCHX07 = torchx.__version__.startswith("0.7")
# TorchX's own log lines ("torchx 2026-12-04 20:27:17 INFO     tracker configurations: {}"): not ours
_TORCHX_LOG = re.compile(r"^torchx \d{4}-\d\d-\d\d [\d:]+ (INFO|DEBUG) ")


def said(res: subprocess.CompletedProcess) -> list[str]:
    """What the command said on stderr, less TorchX's own informational log lines."""
    return [line for line in res.stderr.splitlines() if line.strip() and not _TORCHX_LOG.match(line)]


def one_line(res: subprocess.CompletedProcess, code: int, *fragments: str) -> str:
    """The command failed with exit status ``code`` and said one line holding every fragment."""
    lines = said(res)
    assert "Traceback" not in res.stderr + res.stdout, res.stderr
    assert res.returncode == code, (res.returncode, res.stderr)
    assert len(lines) == 1, lines
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


def mt(home: Path, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [MT, *args], env={**cli_env(home), **(env or {})}, capture_output=True, text=True, timeout=timeout
    )


def tx(home: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return run_torchx(home, *args, cwd=cwd, check=False)


# ------------------------------------------------------------------ .torchxconfig


def test_a_misspelled_scheduler_in_torchxconfig_is_one_line(home, tmp_path):
    (tmp_path / ".torchxconfig").write_text("[cli:run]\nscheduler = monarch_locl\n")
    one_line(
        tx(home, "run", "utils.echo", cwd=tmp_path), 1, "no scheduler 'monarch_locl'", "did you mean 'monarch_local'"
    )
    assert not agent_pids(home)


def test_a_bad_value_in_torchxconfig_is_one_line_naming_file_section_and_key(home, tmp_path):
    (tmp_path / ".torchxconfig").write_text("[monarch_local]\nhosts = abc\n")
    one_line(
        tx(home, "run", "--dryrun", "utils.echo", cwd=tmp_path),
        1,
        str(tmp_path / ".torchxconfig"),
        "[monarch_local] hosts = abc is not an integer",
    )
    # a value -cfg gives is the one used: the file's is not read, so not refused
    ok = tx(home, "run", "--dryrun", "-cfg", "hosts=1", "utils.echo", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr


def test_a_misspelled_section_in_torchxconfig_is_a_warning_naming_it_and_the_known_ones(home, tmp_path):
    (tmp_path / ".torchxconfig").write_text("[monarch_locl]\nhosts = 2\n")
    res = tx(home, "run", "--dryrun", "utils.echo", cwd=tmp_path)
    assert res.returncode == 0 and "Traceback" not in res.stderr
    [warning] = [line for line in said(res) if "warning" in line]
    assert "[monarch_locl] is not a scheduler" in warning and "did you mean [monarch_local]" in warning
    assert "monarch_slurm" in warning  # the known ones


@pytest.mark.skipif(TORCHX07, reason="torchx 0.7.0 ignores unknown run options of its own schedulers")
def test_an_unknown_run_option_of_a_stock_scheduler_is_one_line(home, tmp_path):
    one_line(
        tx(home, "run", "-s", "local_cwd", "-cfg", "hostz=1", "utils.echo", cwd=tmp_path),
        1,
        "hostz",
        "torchx runopts local_cwd",
    )


def test_loaded_configs_is_logged_once(home, tmp_path):
    """monarch_slurm reads .torchxconfig's [slurm] section at each look-up of its run options:
    TorchX's "loaded configs" line was printed for each (6 per command)."""
    (tmp_path / ".torchxconfig").write_text("[monarch_slurm]\nnodes = 1\n[slurm]\npartition = debug\n")
    res = tx(home, "run", "--dryrun", "-s", "monarch_slurm", "utils.echo", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("loaded configs") == 1, res.stderr


# ------------------------------------------------------------------ the registry home

_NO_DAC = [
    "setpriv",
    "--inh-caps=-dac_override,-dac_read_search,-fowner",
    "--bounding-set=-dac_override,-dac_read_search,-fowner",
]


def unprivileged(argv: list[str]) -> list[str]:
    """``argv`` as a user that file modes apply to: root without its override of them."""
    if os.geteuid() != 0:
        return argv
    if not shutil.which("setpriv"):
        pytest.skip("needs setpriv (util-linux) to drop root's file-permission override")
    return [*_NO_DAC, *argv]


def run_as_user(home: Path, argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(unprivileged(argv), env=cli_env(home), capture_output=True, text=True, timeout=120)


def test_another_users_home_says_whose_it_is_and_what_to_do(home, pool_name):
    if os.geteuid() != 0:
        pytest.skip("making a home another user's takes root (chown)")
    assert mt(home, "pool", "create", pool_name, "-cfg", "hosts=1,preload=none").returncode == 0
    assert mt(home, "pool", "stop", pool_name).returncode == 0
    subprocess.run(["chown", "-R", "65534", str(home)], check=True)
    try:
        for argv in (
            [MT, "pool", "status", pool_name],
            [MT, "pool", "list"],
            [str(BIN / "torchx"), "run", "utils.echo"],
        ):
            line = one_line(run_as_user(home, argv), 1, str(home), "owned by uid 65534", "MONARCH_TORCHX_HOME")
            assert "corrupt" not in line and "remove" not in line  # not the cause; nothing is to be removed
    finally:
        subprocess.run(["chown", "-R", str(os.getuid()), str(home)], check=True)
    assert not agent_pids(home)


def test_an_unwritable_home_is_one_line(home):
    home.mkdir(mode=0o500)
    try:
        res = run_as_user(home, [MT, "pool", "create", "p", "-cfg", "hosts=1,preload=none"])
        one_line(res, 1, f"cannot keep pools in {home}", "not writable by you (mode 500)", f"chmod 700 {home}")
        res = run_as_user(home, [str(BIN / "torchx"), "run", "-cfg", "preload=none", "utils.echo"])
        one_line(res, 1, "not writable by you")
    finally:
        home.chmod(0o700)
    assert not agent_pids(home)


def test_a_read_only_home_is_one_line(home):
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("a read-only mount in a private mount namespace takes root (unshare -m)")
    home.mkdir(mode=0o700)
    mount = ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o ro,mode=700 tmpfs "{home}" && exec "$@"', "sh"]
    probe = subprocess.run([*mount, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no mount namespace here: {probe.stderr.strip()}")
    for argv in (
        [MT, "pool", "create", "p", "-cfg", "hosts=1,preload=none"],
        [str(BIN / "torchx"), "run", "-cfg", "preload=none", "utils.echo"],
    ):
        res = subprocess.run([*mount, *argv], env=cli_env(home), capture_output=True, text=True, timeout=120)
        one_line(res, 1, f"cannot keep pools in {home}", "read-only file system", "MONARCH_TORCHX_HOME")
    assert not agent_pids(home)


# ------------------------------------------------------------------ monarch-torchx itself


def test_json_errors_are_one_json_object_with_a_stable_kind(home):
    res = mt(home, "pool", "status", "nosuch", "--json")
    assert res.returncode == 1 and res.stderr == "" and len(res.stdout.splitlines()) == 1
    err = json.loads(res.stdout)
    assert err["kind"] == "pool_not_found" and "no pool named 'nosuch'" in err["error"]
    res = mt(home, "sql", "--pool", "nosuch", "--json", "--timeout", "0", "SELECT 1")
    assert res.returncode == 2 and json.loads(res.stdout)["kind"] == "usage"
    res = mt(home, "pool", "list", "--json")
    assert res.returncode == 0 and json.loads(res.stdout) == []


def test_sql_refuses_a_timeout_that_is_not_positive(home):
    one_line(mt(home, "sql", "--pool", "nosuch", "--timeout", "0", "SELECT 1"), 2, "--timeout 0", "above 0")
    one_line(mt(home, "sql", "--pool", "nosuch", "--timeout", "-1", "SELECT 1"), 2, "--timeout -1")


def test_a_closed_pipe_is_quiet(home):
    """``monarch-torchx pool list | head -1``: the reader closed its end before we wrote."""
    r, w = os.pipe()
    os.close(r)
    try:
        res = subprocess.run(
            [MT, "pool", "list"], env=cli_env(home), stdout=w, stderr=subprocess.PIPE, text=True, timeout=60
        )
    finally:
        os.close(w)
    assert res.returncode == 1 and res.stderr == "", res.stderr  # as the Python docs do it for SIGPIPE


def test_stopping_a_stopped_pool_says_so_and_succeeds(home, pool_name):
    assert mt(home, "pool", "create", pool_name, "-cfg", "hosts=1,preload=none").returncode == 0
    assert mt(home, "pool", "stop", pool_name).returncode == 0
    res = mt(home, "pool", "stop", pool_name)
    assert res.returncode == 0 and res.stdout.strip() == f"pool {pool_name!r} is already stopped", res
    assert "create" not in res.stdout + res.stderr
    one_line(mt(home, "pool", "stop", "neverwas"), 1, "no pool named 'neverwas'")
    assert not agent_pids(home)


def test_cancel_of_an_app_that_does_not_exist_is_one_line_and_fails(home):
    one_line(
        tx(home, "cancel", "monarch_local://x/nosuch:app"),
        1,
        "no app 'nosuch:app' on monarch_local",
        "torchx list -s monarch_local",
    )


def test_version_and_license():
    from importlib.metadata import metadata, version

    res = subprocess.run([MT, "--version"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == f"monarch-torchx {version('monarch-torchx')}"
    text = (Path(__file__).resolve().parents[1] / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License") and "monarch-torchx contributors" in text
    assert (
        metadata("monarch-torchx")["License-Expression"] == "BSD-3-Clause"
        or metadata("monarch-torchx")["License"] == "BSD-3-Clause"
    )


def test_a_local_pool_of_absurdly_many_hosts_is_refused_naming_the_override(home, tmp_path):
    for args in (
        ["run", "--dryrun", "-s", "monarch_local", "utils.echo", "--num_replicas", "100000"],
        ["run", "-s", "monarch_local", "utils.echo", "--num_replicas", "100000"],
        ["pool", "create", "big", "-cfg", "hosts=100000"],
    ):
        one_line(tx(home, *args, cwd=tmp_path), 1, "100000 agent processes", "MONARCH_TORCHX_MAX_LOCAL_HOSTS=100000")
    assert not (home / "pools" / "big.json").exists() and not agent_pids(home)


# ------------------------------------------------------------------ Ctrl-C


def interrupt_at(home: Path, marker: str, argv: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Runs ``argv`` and sends it SIGINT (Ctrl-C) once ``marker`` shows on its stderr."""
    env = {**cli_env(home), "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen(
        argv,
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # (a suite started in the background of a script inherits SIGINT ignored, and so would the CLI)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    seen = ""
    while marker not in seen:
        line = p.stderr.readline()
        if not line:
            break
        seen += line
    assert marker in seen, seen
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    return subprocess.CompletedProcess(argv, p.returncode, out, seen + err)


@pytest.mark.serial  # (Ctrl-C is sent at a moment of a start: a loaded machine moves the moment)
@pytest.mark.parametrize("marker", ["creating pool", "warming"])
def test_ctrl_c_during_pool_create_stops_what_it_started(home, pool_name, marker):
    res = interrupt_at(home, marker, [MT, "pool", "create", pool_name, "-cfg", "hosts=2"])
    last = said(res)[-1]
    assert res.returncode == 130 and "Traceback" not in res.stderr, res.stderr
    assert last == f"monarch-torchx: interrupted: pool {pool_name!r} was being created; what it had started is stopped"
    assert not agent_pids(home)
    assert mt(home, "pool", "status", pool_name).returncode == 1  # no pool left warm


@pytest.mark.serial  # (Ctrl-C is sent at a moment of a start: a loaded machine moves the moment)
def test_ctrl_c_during_a_first_run_stops_the_pool_it_was_creating(home, pool_name, tmp_path):
    res = interrupt_at(
        home,
        "creating pool",
        [str(BIN / "torchx"), "run", "-s", "monarch_local", "-cfg", f"pool={pool_name},hosts=2", "utils.echo"],
        cwd=tmp_path,
    )
    assert res.returncode == 130 and "Traceback" not in res.stderr, res.stderr
    assert said(res)[-1].endswith("what it had started is stopped")
    assert not agent_pids(home)


@pytest.mark.serial  # (Ctrl-C is sent at a moment of a start: a loaded machine moves the moment)
def test_ctrl_c_during_run_wait_names_the_command_that_cancels_the_app(home, pool_name, tmp_path):
    res = interrupt_at(
        home,
        "Waiting for the app",
        [
            str(BIN / "torchx"),
            "run",
            "--wait",
            "-s",
            "monarch_local",
            "-cfg",
            f"pool={pool_name},hosts=1,preload=none",
            "utils.sh",
            "sleep",
            "60",
        ],
        cwd=tmp_path,
    )
    assert res.returncode == 130 and "Traceback" not in res.stderr, res.stderr
    handle = (
        res.stdout.strip().splitlines()[-1]
        if res.stdout.strip()
        else re.search(r"monarch_local://\S+", res.stderr).group(0).strip("`")
    )
    assert said(res)[-1] == f"monarch-torchx: app still running: torchx cancel {handle}"
    assert tx(home, "cancel", handle).returncode == 0  # the command it names works


# ------------------------------------------------------------------ output


def test_run_log_prints_the_replicas_last_lines_before_job_finished(home, pool_name, tmp_path):
    res = tx(
        home,
        "run",
        "--wait",
        "--log",
        "-s",
        "monarch_local",
        "-cfg",
        f"pool={pool_name},hosts=1,preload=none",
        "utils.sh",
        "sh",
        "-c",
        "echo first; sleep 0.5; echo last-line",
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    err = res.stderr
    finished = err.lower().index("job finished")
    assert err.index("last-line") < finished, err


def _on_a_terminal(home: Path, argv: list[str], env: dict) -> tuple[int, str, str]:
    """Runs ``argv`` with stderr on a pseudo-terminal: (exit status, stdout, what the terminal got)."""
    import pty

    master, slave = pty.openpty()
    p = subprocess.Popen(argv, env={**cli_env(home), **env}, stdout=subprocess.PIPE, stderr=slave, text=True)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the last writer closed it
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    out = p.stdout.read()
    return p.wait(timeout=60), out, b"".join(chunks).decode(errors="replace")


def test_long_work_shows_live_progress_on_a_terminal_and_sync_says_when_it_copies(home, pool_name, tmp_path):
    no_fuse = {"MONARCH_TORCHX_SYNC_FUSE": "0"}  # the agents serve targets as copies, as without pyfuse3
    rc, out, term = _on_a_terminal(home, [MT, "pool", "create", pool_name, "-cfg", "hosts=1,preload=none"], no_fuse)
    assert rc == 0 and "ready" in out
    assert "0:00:0" in term and "creating pool" in term  # rich's live line: the time so far
    src = tmp_path / "tree"
    src.mkdir()
    for i in range(20):
        (src / f"f{i}.txt").write_text(f"file {i}\n" * 100)
    rc, out, term = _on_a_terminal(home, [MT, "sync", str(src), "--pool", pool_name, "--to", "work"], no_fuse)
    assert rc == 0 and "0:00:0" in term, term
    assert "copied, not mounted (disabled by MONARCH_TORCHX_SYNC_FUSE=0)" in out and "2x" in out, out
    res = mt(home, "sync", str(src), "--pool", pool_name, "--to", "work")  # not a terminal: no live line
    assert res.returncode == 0 and res.stderr == "" and "copied, not mounted" in res.stdout
