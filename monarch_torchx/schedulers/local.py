"""``monarch_local``: a pool of N local "hosts", each a detached agent process on loopback.

The embedded default: nothing to install, the same agent, protocol and TorchX contract as on
a cluster, so what works here works on ``monarch_slurm``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

from .. import procfs
from ..agent import agent_argv
from ..pool import wait_for_hosts
from ..registry import HostAddr, PoolRecord, Registry
from ..submission import Submission
from .base import MonarchScheduler


def _tail(path: Path, n: int = 5) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(lines[-n:])


def _is_our_agent(pid: int, state_dir: str) -> bool:
    """Whether ``pid`` is still the agent we started there: ours, with the pool's command line."""
    argv = procfs.cmdline(pid) or []
    return b"monarch_torchx.agent" in argv and state_dir.encode() in argv and procfs.owned(pid)


def _alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (reaping it if it is our own child)."""
    if procfs.alive(pid):
        return True
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    return False


# More local "hosts" than this is refused: each is an agent process and a fork server (30 MiB
# idle), and 512 is the most measured to fit on one machine here (docs/scale.md); a typo such as
# `--num_replicas 100000` would otherwise start that many processes without a word.
MAX_HOSTS_ENV = "MONARCH_TORCHX_MAX_LOCAL_HOSTS"
MAX_HOSTS_DEFAULT = 512


def check_local_hosts(n: int) -> None:
    """Refuses, in one line naming the override, a new local pool of more hosts than the limit."""
    from ..errors import MonarchError

    raw = os.environ.get(MAX_HOSTS_ENV, "")
    limit = int(raw) if raw.isdigit() else MAX_HOSTS_DEFAULT
    if n > limit:
        raise MonarchError(
            f"monarch_local would start {n} agent processes on this machine (one per host; "
            f"the limit is {limit}, docs/scale.md): use fewer replicas or hosts, or "
            f"set {MAX_HOSTS_ENV}={n} to allow it"
        )


class LocalProvisioner:
    scheduler = "monarch_local"
    hosts_option = "hosts"
    client_cwd_on_hosts = True  # replicas start in the client's cwd (else the agent's)
    fingerprint = ("hosts", "preload", "tls")
    tls_default = False  # one machine: nothing leaves loopback

    def add_run_opts(self, opts: Any) -> None:
        pass

    def pool_spec(self, cfg: dict[str, Any], spec: dict[str, Any], options: dict[str, Any]) -> None:
        pass

    def create(self, rec: PoolRecord) -> None:
        check_local_hosts(rec.num_hosts)
        self._start(rec, list(range(rec.num_hosts)))

    def submission(self, rec: PoolRecord) -> Submission:
        check_local_hosts(rec.num_hosts)  # (a dry run, and every run's plan for a pool it would create)
        return Submission(
            "processes",
            commands=[self._argv(rec, i) for i in range(rec.num_hosts)],
            notes=[f"one agent per host on this machine; logs in {rec.state_dir}/logs"],
        )

    @staticmethod
    def _argv(rec: PoolRecord, index: int) -> list[str]:
        return agent_argv(rec, index, "127.0.0.1")

    def repair(self, rec: PoolRecord, indices: list[int]) -> list[int]:
        for i in indices:
            pid = rec.allocation.get("pids", {}).get(str(i))
            if pid and _is_our_agent(pid, rec.state_dir):
                # only a lost host is repaired: its heartbeat is stale and a patient probe failed (hung)
                os.kill(pid, signal.SIGKILL)
        self._start(rec, indices)
        return indices

    def loss_reason(self, rec: PoolRecord) -> str | None:
        return None

    def host_gone(self, rec: PoolRecord, addr: HostAddr) -> str | None:
        """The engine's evidence for one host: its agent process is not running any more."""
        pid = rec.allocation.get("pids", {}).get(str(addr.index)) or addr.pid
        if pid and not _is_our_agent(pid, rec.state_dir):
            return f"agent {addr.index} (pid {pid}) is not running"
        return None

    def describe(self, rec: PoolRecord) -> dict[str, Any]:
        return {"agents": rec.allocation.get("pids", {})}

    def _start(self, rec: PoolRecord, indices: list[int]) -> None:
        pids: dict[str, Any] = rec.allocation.setdefault("pids", {})
        for i in indices:
            Registry.clear_host(rec, i)
            log_path = Path(rec.state_dir) / "logs" / f"agent{i}.log"
            with os.fdopen(os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab") as logf:
                # in the pool's own (private) directory, not the client's cwd (see interpreter.py)
                proc = subprocess.Popen(
                    self._argv(rec, i),
                    stdin=subprocess.DEVNULL,
                    stdout=logf,
                    cwd=rec.state_dir,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    close_fds=True,
                )
            pids[str(i)] = proc.pid

    def wait_ready(
        self, rec: PoolRecord, indices: list[int], old: dict[int, str], timeout: float, progress: Callable[[str], None]
    ) -> None:
        def check(i: int) -> str | None:
            pid = rec.allocation.get("pids", {}).get(str(i))
            if pid and not _alive(pid):
                log = Path(rec.state_dir) / "logs" / f"agent{i}.log"
                return f"agent {i} exited ({_tail(log) or 'no output'}); log: {log}"
            return None

        wait_for_hosts(rec, indices, old, timeout, check)

    def release(self, rec: PoolRecord) -> None:
        """Agents exit on `shutdown`; kill any that did not (hung, or unreachable), and end what
        those leave behind."""
        killed = []
        for index, pid in rec.allocation.get("pids", {}).items():
            if _is_our_agent(pid, rec.state_dir):
                # (up to 5 s: an agent gives its replicas 3 s after SIGTERM, then cleans up what
                # they left, e.g. their temp dirs, which it can do only once they are dead)
                for _ in range(100):
                    if not _is_our_agent(pid, rec.state_dir):
                        break
                    time.sleep(0.05)
                else:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(int(index))
        if killed:
            self.end_leftovers(rec, killed)

    def end_leftovers(self, rec: PoolRecord, lost: list[int]) -> list[str]:
        """The hosts are this machine: their leftovers are ended here, in this process."""
        from ..agent.leftovers import end_host
        from ..syncfs.host import pool_id

        return [f"host {i}: {what}" for i in lost for what in end_host(rec.name, pool_id(rec.key), i)]


def create_scheduler(session_name: str, **kwargs: Any) -> MonarchScheduler:
    return MonarchScheduler(session_name, "monarch_local")
