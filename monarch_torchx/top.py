"""``monarch-torchx top --pool P``: the pool's hosts and replicas in the terminal, redrawn every
few seconds, for those who would rather not open the dashboard (what it shows comes from the same
place: ``dashboard.DashboardData``, the agents' answers and the telemetry tables).

On a terminal it redraws in place until Ctrl-C; with ``--once``, or when the output is not a
terminal (a pipe, a file), it prints one snapshot and exits, so scripts and tests read it.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from .dashboard import DashboardData

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen
REPLICA_ROWS = 30  # the newest replicas shown (the running ones first)
LIVE = ("RUNNING", "PENDING")


@dataclass
class TopView:
    """One snapshot of a pool, as ``top`` draws it."""

    pool: dict[str, Any]
    replicas: list[dict[str, Any]] = field(default_factory=list)
    load1: dict[int, float] = field(default_factory=dict)  # host -> its latest 1-minute load

    @classmethod
    def read(cls, name: str) -> TopView:
        data = DashboardData(name)
        (pool,) = data.pools()
        if pool.get("stopped"):
            return cls(pool)
        load1: dict[int, float] = {}
        for row in data.load(name):  # newest first
            load1.setdefault(int(row["host"]), float(row["value"]))
        rows = data.replicas(name)
        rows.sort(key=lambda r: str(r["started"] or ""), reverse=True)  # (newest first: ISO times)
        rows.sort(key=lambda r: r["state"] not in LIVE)  # then the live ones first (a stable sort)
        return cls(pool, rows[:REPLICA_ROWS], load1)

    def render(self, now: float | None = None) -> str:
        p = self.pool
        stamp = time.strftime("%H:%M:%S", time.localtime(now or time.time()))
        if p.get("stopped"):
            return f"pool {p['name']}: stopped (start it again with `monarch-torchx pool create`)  {stamp}\n"
        lines = [
            f"pool {p['name']} ({p['scheduler']}, {p['state']}): {len(p['hosts'])} host(s), "
            f"{p['apps']} app(s)  {stamp}",
            "",
            _table(
                ["HOST", "STATE", "HOSTNAME", "LOAD1", "CPUS USED", "MEM MB USED", "GPUS HELD", "RUNNING", "NOTE"],
                [self._host_row(h) for h in p["hosts"]],
            ),
            "",
        ]
        if self.replicas:
            lines.append(
                _table(
                    ["APP", "ROLE/RANK", "HOST", "PID", "STATE", "ATTEMPTS", "CPU S", "RSS MB", "EXIT"],
                    [_replica_row(r) for r in self.replicas],
                )
            )
        else:
            lines.append("no replicas yet")
        return "\n".join(lines) + "\n"

    def _host_row(self, h: dict[str, Any]) -> list[str]:
        cap = h.get("capacity") or {}
        total, used = cap.get("total") or {}, cap.get("used") or {}
        gpus = cap.get("gpus") or []
        load = self.load1.get(h["index"])
        return [
            str(h["index"]),
            h["state"],
            h.get("hostname") or "-",
            "-" if load is None else f"{load:.2f}",
            f"{used.get('cpus', 0):g}/{total['cpus']:g}" if total else "-",
            f"{used.get('mem_mb', 0)}/{total['mem_mb']}" if total else "-",
            f"{sum(1 for g in gpus if g['held_by'])}/{len(gpus)}" if gpus else "-",
            "-" if h.get("running") is None else str(h["running"]),
            h.get("error") or h.get("warning") or "",
        ]


def _replica_row(r: dict[str, Any]) -> list[str]:
    rss = r.get("rss_bytes")
    return [
        r["app_id"],
        f"{r['role']}/{r['replica']}",
        str(r["host"]),
        str(r.get("pid") or "-"),
        r["state"],
        str(r.get("attempts") or 1),
        "-" if r.get("cpu_s") is None else f"{r['cpu_s']:.1f}",
        "-" if rss is None else f"{rss / 2**20:.0f}",
        "" if r.get("exit_code") is None else str(r["exit_code"]),
    ]


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max([len(header[i])] + [len(row[i]) for row in rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows])


def run(pool: str, interval: float, once: bool, out: TextIO = sys.stdout) -> None:
    """Draws the pool until Ctrl-C (or once; see the module's docstring)."""
    once = once or not out.isatty()
    while True:
        text = TopView.read(pool).render()
        out.write(text if once else CLEAR + text)
        out.flush()
        if once:
            return
        try:
            time.sleep(interval)
        except KeyboardInterrupt:
            out.write("\n")
            return
