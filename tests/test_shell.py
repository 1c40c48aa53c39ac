"""Issue 41: `monarch-torchx shell`: an interactive shell on one host of a warm pool, on a real
terminal there, driven here through a real pseudo-terminal as a person's terminal would."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import termios
import time
from pathlib import Path

import pytest

from .conftest import BIN, cli_env, pids_running, process_alive, wait_for

pytestmark = pytest.mark.integration

MT = str(BIN / "monarch-torchx")


class Terminal:
    """The real CLI on a pseudo-terminal of this test's own: keys in, screen out."""

    def __init__(self, home: Path, *args: str, cols: int = 80, rows: int = 24):
        env = cli_env(home)
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # (the child: the CLI, on the terminal)
            os.execve(MT, [MT, *args], env)
        self.resize(cols, rows)
        self.screen = b""

    def resize(self, cols: int, rows: int) -> None:
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def type(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def expect(self, pattern: bytes, timeout: float = 30.0) -> bytes:
        """Reads until ``pattern`` (a regex) shows; returns the screen so far."""
        end = time.time() + timeout
        while not re.search(pattern, self.screen):
            if time.time() > end:
                raise AssertionError(f"{pattern!r} not seen in {self.screen[-2000:]!r}")
            ready, _, _ = select.select([self.fd], [], [], 0.1)
            if ready:
                try:
                    self.screen += os.read(self.fd, 65536)
                except OSError:  # the CLI ended
                    if not re.search(pattern, self.screen):
                        raise AssertionError(f"ended before {pattern!r}: {self.screen[-2000:]!r}") from None
        return self.screen

    def exit_code(self, timeout: float = 30.0) -> int:
        end = time.time() + timeout
        while time.time() < end:
            with_output = select.select([self.fd], [], [], 0.1)[0]
            if with_output:
                try:
                    self.screen += os.read(self.fd, 65536)
                except OSError:
                    pass
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError(f"the CLI did not end: {self.screen[-2000:]!r}")


@pytest.fixture
def pool(home, pool_name):
    res = subprocess.run(
        [MT, "pool", "create", pool_name, "-cfg", "hosts=2,preload=none"], env=cli_env(home), capture_output=True
    )
    assert res.returncode == 0, res.stderr
    return pool_name


FIRST_PROMPT = rb"bash-[\d.]+[#$] "
PROMPT = rb"shell-ready\$ "
BASH = ["--", "bash", "--norc", "--noprofile", "-i"]


def test_a_shell_on_a_host_is_a_real_terminal(home, pool):
    t = Terminal(home, "shell", "--pool", pool, "--host", "1", *BASH, cols=91, rows=33)
    t.expect(FIRST_PROMPT)  # (keys typed before bash reads its terminal may be dropped by it)
    t.type(b"PS1='shell''-ready$ '\r")
    t.expect(PROMPT)
    t.type(b"echo host=$MONARCH_TORCHX_HOST_INDEX tty=$(tty) size=$(stty size)\r")
    t.expect(rb"host=1 tty=/dev/pts/\d+ size=33 91")
    t.resize(120, 40)  # the window changes here: the remote terminal follows
    time.sleep(0.5)
    t.type(b"echo size=$(stty size)\r")
    t.expect(rb"size=40 120")
    t.type(b"sleep 300\r")
    time.sleep(0.5)
    t.type(b"\x03")  # Ctrl-C reaches the remote foreground program, not the CLI here
    t.expect(rb"\^C\r\n.*" + PROMPT)
    t.type(b"exit 7\r")
    assert t.exit_code() == 7


def test_a_shell_without_a_terminal_reads_its_input_and_exits_with_its_code(home, pool):
    res = subprocess.run(
        [MT, "shell", "--pool", pool, "--", "sh"],
        input="echo from-a-pipe $MONARCH_TORCHX_HOST_INDEX\nexit 3\n",
        env=cli_env(home),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 3, res.stderr
    assert "from-a-pipe 0" in res.stdout


def test_a_shell_whose_host_dies_ends_with_one_line_and_leaves_nothing(home, pool, tmp_path):
    marker = tmp_path / "shell.pid"
    t = Terminal(home, "shell", "--pool", pool, "--host", "1", *BASH)
    t.expect(FIRST_PROMPT)
    t.type(f"PS1='shell''-ready$ '; echo $$ > {marker}\r".encode())
    t.expect(PROMPT)
    shell_pid = int(marker.read_text())
    agent = next(p for p in pids_running("monarch_torchx.agent", home) if b"--index\x001" in _cmdline(p))
    os.kill(agent, signal.SIGKILL)
    assert t.exit_code() == 1
    last = t.screen.decode(errors="replace").strip().splitlines()[-1]
    assert re.fullmatch(
        rf"error: lost the connection to host 1 of pool '{pool}' \(.*\); its shell is ended", last.strip()
    ), last
    wait_for(lambda: not process_alive(shell_pid), timeout=15, what="the remote shell ended with its agent")


def test_a_host_the_pool_lacks_is_one_line(home, pool):
    res = subprocess.run(
        [MT, "shell", "--pool", pool, "--host", "5"], env=cli_env(home), capture_output=True, text=True
    )
    assert res.returncode == 2 and res.stderr.strip() == f"error: pool {pool!r} has hosts 0..1; no host 5"


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
