"""``monarch-torchx shell``: an interactive shell on one host of a pool, on a real terminal there.

Two connections to the host's agent, both authenticated with the pool's secret: one carries the
``shell.open`` stream (the terminal's output, then the exit code), the other the keys typed here
(``shell.input``) and window size changes (``shell.resize``). On a terminal, this side is put in
raw mode, so every key (Ctrl-C, Ctrl-Z, arrows) goes to the remote program as typed and the
remote terminal does the echoing and the signals; the mode is restored however the shell ends.
Without a terminal here (a pipe), what is read is written as is, and its end ends the input
(an end-of-file key on the remote terminal).
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import sys
import termios
import threading
import tty
from typing import Any, BinaryIO

from .errors import MonarchError
from .net import WireError
from .pool import Pool
from .shell_messages import ShellExited, ShellOpened, ShellOutput

LOST = 255  # the connection to the host was lost: the shell's own end is not known
EOF_KEY = b"\x04"  # what a terminal in canonical mode reads as the end of input (^D)


class ShellLost(MonarchError):
    """The host's agent went away while the shell ran."""


def _terminal_size(fd: int, is_tty: bool) -> os.terminal_size:
    """The terminal's own size where there is one (not $COLUMNS/$LINES, which a shell or a test
    runner may have left stale in the environment), else shutil's answer."""
    if is_tty:
        with contextlib.suppress(OSError):
            size = os.get_terminal_size(fd)
            if size.columns and size.lines:
                return size
    return shutil.get_terminal_size()


def run_shell(pool: Pool, index: int, argv: list[str] | None = None, stdin: Any = None, stdout: Any = None) -> int:
    """Runs a shell (``argv``, default the login shell) on host ``index`` attached to this
    process's terminal (or ``stdin``/``stdout``); returns its exit code. Raises ShellLost when the
    host stops answering meanwhile (after the terminal is restored)."""
    stdin = stdin or sys.stdin
    out: BinaryIO = stdout or sys.stdout.buffer
    fd = stdin.fileno()
    is_tty = os.isatty(fd)
    size = _terminal_size(fd, is_tty)
    streaming = pool.connect(index)
    streaming.settimeout(None)
    items = streaming.stream(
        "shell.open", argv=argv, cols=size.columns, rows=size.lines, term=os.environ.get("TERM", "xterm-256color")
    )
    try:
        opened = next(items)
    except (WireError, OSError) as e:
        streaming.close()
        raise ShellLost(f"host {index} of pool {pool.name!r} did not open a shell: {e}") from None
    if not isinstance(opened, ShellOpened):
        streaming.close()
        raise MonarchError(f"host {index} answered shell.open with {type(opened).__name__}, not ShellOpened")
    keys = pool.connect(index)
    keys.settimeout(30.0)
    lock = threading.Lock()
    resized = threading.Event()
    done = threading.Event()
    saved = termios.tcgetattr(fd) if is_tty else None
    old_winch = None

    def send_keys() -> None:
        """Reads what is typed here and writes it to the remote terminal until the shell ends."""
        try:
            while not done.is_set():
                if resized.is_set():
                    resized.clear()
                    s = _terminal_size(fd, is_tty)
                    with lock:
                        keys.call("shell.resize", session=opened.session, cols=s.columns, rows=s.lines)
                ready, _, _ = select.select([fd], [], [], 0.2)
                if not ready:
                    continue
                data = os.read(fd, 4096)
                with lock:
                    keys.call("shell.input", session=opened.session, data=data or EOF_KEY)
                if not data:
                    return
        except (WireError, OSError, MonarchError):
            return  # (the shell ended, or the host went: the output side says which)

    code = LOST
    last = b""  # the output's last bytes
    lost: BaseException | None = None
    try:
        if is_tty:
            tty.setraw(fd)
            old_winch = signal.signal(signal.SIGWINCH, lambda *_: resized.set())
            if _terminal_size(fd, is_tty) != size:  # (resized before the handler was there: no signal came)
                resized.set()
        threading.Thread(target=send_keys, daemon=True, name="monarch-torchx-shell-keys").start()
        for item in items:
            if isinstance(item, ShellOutput):
                out.write(item.data)
                out.flush()
                last = item.data or last
            elif isinstance(item, ShellExited):
                code = item.exit_code
    except (WireError, OSError) as e:
        lost = e
    finally:
        done.set()
        if saved is not None:
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)
        if old_winch is not None:
            signal.signal(signal.SIGWINCH, old_winch)
        streaming.close()
        with lock:
            keys.close()
    if lost is not None:
        if last[-1:] not in (b"", b"\n"):  # (the error's line starts on a line of its own)
            out.write(b"\n")
            out.flush()
        raise ShellLost(f"lost the connection to host {index} of pool {pool.name!r} ({lost}); its shell is ended")
    return code
