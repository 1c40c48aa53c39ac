"""``monarch-torchx debug``: the pool's processes paused at a ``breakpoint()``, and pdb on them
from here (``debugger.py`` is the paused side, ``agent/debug.py`` the host's).

- ``paused(pool)``: every host's paused processes (app, role, rank, host, file:line);
- ``attach(pool, host, pid)``: an interactive pdb session: lines read here with readline (its
  history and editing), pdb's answers printed as they come; it ends when the process continues
  or ends; an end of input here (Ctrl-D) detaches and leaves it paused;
- ``cast(pool, targets, command)``: one pdb command to several paused processes at once, each
  one's answer (up to its next prompt) returned; ``c`` continues them.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from .debugger import PROMPT, DebugEnded, PausedProcess
from .errors import MonarchError
from .net import RemoteError, WireError
from .pool import Pool
from .shell_messages import ShellOutput


class AttachRefused(MonarchError):
    """The process cannot be attached (another client is, or it is no longer paused)."""


@dataclass
class CastAnswer:
    """One paused process's answer to a cast command."""

    target: PausedProcess
    output: str
    continued: bool = False  # the command let it go on (``c``), or it ended
    error: str = ""


def paused(pool: Pool) -> tuple[list[PausedProcess], dict[int, str]]:
    """Every host's paused processes, and why each host that did not answer did not."""
    found: list[PausedProcess] = []
    errors: dict[int, str] = {}
    for i, res, err in pool.ask("debug.list", range(pool.record.num_hosts), timeout=15.0):
        if err is not None:
            errors[i] = str(err)
        else:
            found.extend(res)
    return sorted(found, key=lambda p: (p.app_id, p.role, p.replica, p.host, p.pid)), errors


class _Attached:
    """One attached session: its stream of pdb's output and a connection for its input."""

    def __init__(self, pool: Pool, host: int, pid: int):
        self.pool, self.host, self.pid = pool, host, pid
        self.out = pool.connect(host)
        self.out.settimeout(None)
        self.items: Iterator[Any] = self.out.stream("debug.attach", pid=pid)
        self.keys = pool.connect(host)
        self.keys.settimeout(30.0)
        self.continued = False
        self.ended = False

    def send(self, line: str) -> None:
        self.keys.call("debug.input", pid=self.pid, line=line if line.endswith("\n") else line + "\n")

    def read(self) -> str | None:
        """The next piece of pdb's output; None when the session ended."""
        for item in self.items:
            if isinstance(item, ShellOutput):
                return item.data.decode(errors="replace")
            if isinstance(item, DebugEnded):
                self.continued = item.continued
        self.ended = True
        return None

    def until_prompt(self) -> tuple[str, bool]:
        """pdb's output up to its next prompt (the prompt left out), and whether that came."""
        text = ""
        while not text.endswith(PROMPT):
            piece = self.read()
            if piece is None:
                return text, False
            text += piece
        return text[: -len(PROMPT)], True

    def close(self) -> None:
        self.out.close()
        self.keys.close()


def _open(pool: Pool, host: int, pid: int) -> _Attached:
    try:
        return _Attached(pool, host, pid)
    except WireError as e:
        raise AttachRefused(str(e)) from None


def _refused(e: BaseException, host: int, pid: int) -> AttachRefused:
    return AttachRefused(f"cannot attach to process {pid} on host {host}: {e}")


def attach(
    pool: Pool, host: int, pid: int, read_line: Callable[[str], str] = input, write: Callable[[str], Any] = print
) -> str:
    """An interactive session (see the module's docstring); returns how it ended, as one line."""
    try:
        s = _open(pool, host, pid)
        first = s.read()
    except (MonarchError, WireError, RemoteError) as e:
        raise _refused(e, host, pid) from None
    if first is None:
        return f"process {pid} on host {host} is no longer paused"
    pending = [first]
    lock = threading.Lock()
    prompt_seen = threading.Event()

    def pump() -> None:
        """Prints pdb's output as it comes (the prompt is printed by the line reader)."""
        while pending or not s.ended:
            text = pending.pop() if pending else s.read()
            if text is None:
                prompt_seen.set()
                return
            with lock:
                shown = text[: -len(PROMPT)] if text.endswith(PROMPT) else text
                if shown:
                    write(shown.rstrip("\n"))
                if shown is not text:
                    prompt_seen.set()

    reader = threading.Thread(target=pump, daemon=True, name="monarch-torchx-debug-out")
    reader.start()
    try:
        while True:
            prompt_seen.wait()
            prompt_seen.clear()
            if s.ended:
                break
            try:
                line = read_line(PROMPT)
            except EOFError:
                return f"detached from process {pid} on host {host}: it stays paused"
            try:
                s.send(line)
            except (WireError, MonarchError, RemoteError):
                break
        reader.join(5.0)
        if s.continued:
            return f"process {pid} on host {host} continued"
        return f"process {pid} on host {host} ended while attached"
    finally:
        s.close()


def cast(pool: Pool, targets: list[PausedProcess], command: str) -> list[CastAnswer]:
    """``command`` to each of ``targets`` at once; each one's answer (see the module's docstring)."""

    def one(t: PausedProcess) -> CastAnswer:
        try:
            s = _open(pool, t.host, t.pid)
            _, ready = s.until_prompt()  # (what it showed before: its location, replayed)
        except (MonarchError, WireError, RemoteError) as e:
            return CastAnswer(t, "", error=str(_refused(e, t.host, t.pid)))
        try:
            if not ready:
                return CastAnswer(t, "", continued=s.continued, error="it is no longer paused")
            s.send(command)
            out, ready = s.until_prompt()
            return CastAnswer(t, out.rstrip("\n"), continued=not ready)
        except (WireError, MonarchError, RemoteError) as e:
            return CastAnswer(t, "", error=str(e))
        finally:
            s.close()

    with ThreadPoolExecutor(max_workers=min(32, max(1, len(targets)))) as ex:
        return list(ex.map(one, targets))
