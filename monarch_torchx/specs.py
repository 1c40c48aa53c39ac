"""Typed requests that cross the wire between a scheduler and an agent."""

from __future__ import annotations

from dataclasses import dataclass, field

# Replica states, spelled as TorchX's AppState names so they map one to one.
PENDING, RUNNING, SUCCEEDED, FAILED, CANCELLED = "PENDING", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"
UNKNOWN = "UNKNOWN"  # its host did not answer in time: maybe busy, maybe gone; asked again later
TERMINAL = (SUCCEEDED, FAILED, CANCELLED)


@dataclass
class LaunchSpec:
    """One process to run on one host: a TorchX role replica, a submitit task, an actor proc."""

    app_id: str
    role: str
    replica_id: int
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    # the submitting shell's environment, under ``env`` (as TorchX's local_cwd and slurm pass it);
    # its PATH goes after the agent's interpreter dir, so `python` stays the pool's (see procs.py)
    inherited_env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    max_retries: int = 0
    # optional: also append the raw output to these files (submitit's %j_%t_log.out/err)
    stdout_path: str | None = None
    stderr_path: str | None = None
    # optional: SIGUSR2 at timeout_s - signal_delay_s (checkpoint), then killed at timeout_s
    timeout_s: float | None = None
    signal_delay_s: float = 30.0
    # optional: an exit with this code means "run me again" (a requeue), not a failure
    requeue_code: int | None = None

    def __post_init__(self) -> None:
        for what, name in (("app id", self.app_id), ("role", self.role)):  # (they name directories on the host)
            if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\0" in name:
                raise ValueError(f"{what} {name!r} cannot name a directory: no '/', not '.' or '..'")
        if not self.argv or not all(isinstance(a, str) for a in self.argv):
            raise ValueError("argv must be a non-empty list of strings")
        for env in (self.env, self.inherited_env):
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
                raise ValueError("env must map strings to strings")
