"""Monarch's ``monarch.actor.config`` and ``monarch.config``: process-wide settings.

``prefix_python_logs_with_actor`` is a switch a user sets by assignment, and ours honours it.

``configure(**knobs)`` / ``configured(**knobs)`` accept the knobs of Monarch's ``monarch.config``
by name, so a program (or one of Monarch's tests) that tunes one runs unchanged; an unknown name
is a ``TypeError``, as a misspelt keyword should be. One means something here and is honoured:
``mesh_attach_config_timeout``, how long ``attach_to_workers`` waits for a worker. The others
change nothing: they tune Monarch's own Rust runtime (its transports, message acknowledgements,
frame sizes and its timeouts), which this package does not have. ``get_runtime_config()`` says
what was set.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator

__all__ = [
    "clear_runtime_config",
    "configure",
    "configured",
    "get_global_config",
    "get_runtime_config",
    "prefix_python_logs_with_actor",
]

# Log records say which actor emitted them ("[actor=<root>.<module.Class name{point}>] ..."),
# as Monarch's do; False leaves messages as the code wrote them.
prefix_python_logs_with_actor = True

# the names Monarch's configure() takes (its ConfigureArgs), as of meta-pytorch/monarch 3fc0a66
MONARCH_KNOBS = frozenset(
    """default_transport enable_log_forwarding enable_file_capture tail_log_lines codec_max_frame_length
    message_delivery_timeout host_spawn_ready_timeout mesh_proc_spawn_max_idle process_exit_timeout
    message_ack_time_interval message_ack_every_n_messages message_ttl_default split_max_buffer_size
    split_max_buffer_age stop_actor_timeout cleanup_timeout default_encoding
    channel_net_rx_buffer_full_check_interval channel_tcp_congestion message_latency_sampling_rate
    enable_dest_actor_reordering_buffer mesh_bootstrap_enable_pdeathsig mesh_terminate_concurrency
    mesh_terminate_timeout small_write_threshold max_cast_dimension_size remote_alloc_bind_to_inaddr_any
    remote_alloc_bootstrap_addr remote_alloc_allowed_port_range read_log_buffer force_file_log
    prefix_with_rank actor_spawn_max_idle get_actor_state_max_idle supervision_watchdog_timeout
    proc_stop_max_idle get_proc_state_max_idle mesh_admin_addr mesh_attach_config_timeout
    mesh_orphan_timeout rdma_allow_tcp_fallback rdma_disable_ibverbs rdma_max_chunk_size_mb
    rdma_ibverbs_target rdma_peer_device_affinity rdma_runtime_worker_threads""".split()
)

_runtime: dict[str, Any] = {}  # what configure() set in this process (Monarch's "runtime" layer)


def configure(**knobs: Any) -> None:
    """Accepts Monarch's runtime knobs (see the module's docstring: none changes anything here)."""
    unknown = sorted(set(knobs) - MONARCH_KNOBS)
    if unknown:
        raise TypeError(f"configure() got unknown config key(s) {unknown}; Monarch's are: {sorted(MONARCH_KNOBS)}")
    _runtime.update(knobs)


@contextlib.contextmanager
def configured(**knobs: Any) -> Iterator[dict[str, Any]]:
    """``configure(**knobs)`` for the block, then what was set before; yields the settings."""
    before = dict(_runtime)
    configure(**knobs)
    try:
        yield get_runtime_config()
    finally:
        _runtime.clear()
        _runtime.update(before)


_UNITS = {"ms": 0.001, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def duration_s(value: Any) -> float:
    """Seconds, from a number or one of Monarch's duration strings (``"500ms"``, ``"10s"``, ``"2m"``)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|sec|s|min|m|h)?\s*", str(value))
    if m is None:
        raise ValueError(f"not a duration: {value!r} (a number of seconds, or e.g. '500ms', '10s', '2m')")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def get_runtime_config() -> dict[str, Any]:
    return dict(_runtime)


def get_global_config() -> dict[str, Any]:
    return dict(_runtime)


def clear_runtime_config() -> None:
    _runtime.clear()
