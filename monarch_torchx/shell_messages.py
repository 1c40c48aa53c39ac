"""What crosses the wire in an interactive shell on a host (``monarch-torchx shell``): the items
of the agent's ``shell.open`` stream, in order: ``ShellOpened``, ``ShellOutput``s, ``ShellExited``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ShellOpened:
    """The shell runs: its session (what ``shell.input``/``shell.resize`` name) and its pid."""

    session: str
    pid: int
    hostname: str


@dataclass
class ShellOutput:
    """Bytes the terminal showed, as the program wrote them (escape sequences and all)."""

    data: bytes


@dataclass
class ShellExited:
    """The shell ended: its exit code (128 + N for signal N, as a shell reports it)."""

    exit_code: int
