"""Writes one benchmark's latest output into its own section of benchmarks/RESULTS.md."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def record(name: str, command: str, body: str) -> None:
    begin, end = f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"
    section = (
        f"{begin}\n## {name}\n\nCommand: `{command}`  \n"
        f"Run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {platform.node()} "
        f"({os.cpu_count()} cores, Python {platform.python_version()})\n\n{body.rstrip()}\n{end}"
    )
    text = (
        RESULTS.read_text()
        if RESULTS.exists()
        else "# Benchmark results\n\nLatest output of each benchmark in `benchmarks/`, written by the "
        "benchmark itself.\n"
    )
    if begin in text and end in text:
        head, _, rest = text.partition(begin)
        _, _, tail = rest.partition(end)
        text = f"{head}{section}{tail}"
    else:
        text = f"{text.rstrip()}\n\n{section}\n"
    RESULTS.write_text(text)
