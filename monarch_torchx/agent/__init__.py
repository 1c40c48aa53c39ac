"""The host agent (``python -m monarch_torchx.agent``) and its process launcher.

Light on purpose: clients import ``agent_argv`` without loading the agent itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional  # noqa: F401

from ..interpreter import module_argv

if TYPE_CHECKING:
    from ..registry import PoolRecord


def agent_argv(rec: PoolRecord, index: int | None, bind: str, index_base: int = 0) -> list[str]:
    """The agent command line every provisioner starts (the token is read from the state dir).

    ``index=None`` lets the agent take its index from the environment (SLURM_NODEID), counted
    from ``index_base``: a further allocation of a grown pool numbers its hosts after the others.
    """
    argv = module_argv(
        "monarch_torchx.agent",
        "--state-dir",
        rec.state_dir,
        "--pool",
        rec.name,
        "--bind",
        bind,
        "--idle-timeout",
        str(rec.options.get("idle_timeout", 1800)),
        "--preload",
        rec.spec.get("preload") or "",
    )
    if index is not None:
        argv += ["--index", str(index)]
    elif index_base:
        argv += ["--index-base", str(index_base)]
    from .logstore import POOL_MAX_MB, REPLICA_MAX_MB  # (standard library only: still light)

    # replica logs: a limit per replica, and each host's share of the pool's limit
    argv += [
        "--log-max-mb",
        str(rec.options.get("log_max_mb", REPLICA_MAX_MB)),
        "--log-host-max-mb",
        str(rec.options.get("log_pool_max_mb", POOL_MAX_MB) / max(1, rec.num_hosts)),
    ]
    declared = declared_capacity(rec.spec)
    if declared:
        argv += ["--declare", declared]
    return argv


def declared_capacity(options: dict) -> str:
    """The agent's ``--declare`` from the pool's spec (``cpus_per_host``, ``mem_per_host_mb``,
    ``gpus_per_host``); empty when none is declared."""
    parts = [
        f"{key}={options[opt]:g}"
        for key, opt in (("cpus", "cpus_per_host"), ("mem_mb", "mem_per_host_mb"), ("gpus", "gpus_per_host"))
        if options.get(opt) is not None
    ]
    return ",".join(parts)
