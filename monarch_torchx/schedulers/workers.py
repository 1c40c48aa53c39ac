"""The engine of pools made by ``attach_to_workers``: hosts someone else started.

Its workers (``run_worker_loop_forever``) were launched by the user's own launcher, so there is
nothing to create, repair or release here; a pool of them only ends its agents (``shutdown``,
as every pool's stop does), and each worker returns.
"""

from __future__ import annotations

from typing import Any, Callable

from ..errors import MonarchError
from ..registry import PoolRecord


class WorkersProvisioner:
    scheduler = "monarch_workers"
    hosts_option = "hosts"
    client_cwd_on_hosts = False
    fingerprint = ("hosts", "workers", "tls")
    tls_default = False

    def add_run_opts(self, opts: Any) -> None:
        pass

    def pool_spec(self, cfg: dict[str, Any], spec: dict[str, Any], options: dict[str, Any]) -> None:
        pass

    def create(self, rec: PoolRecord) -> None:
        raise MonarchError(
            f"pool {rec.name!r} is made of attached workers: attach_to_workers() makes it, "
            "from workers that run run_worker_loop_forever"
        )

    def submission(self, rec: PoolRecord) -> Any:
        self.create(rec)  # nothing is ever submitted for attached workers: says so

    def repair(self, rec: PoolRecord, indices: list[int]) -> list[int]:
        workers = [rec.spec["workers"][i] for i in indices if i < len(rec.spec.get("workers", []))]
        raise MonarchError(
            f"worker(s) {', '.join(workers)} of pool {rec.name!r} are lost: start "
            "run_worker_loop_forever there again, then attach_to_workers()"
        )

    def release(self, rec: PoolRecord) -> None:
        pass  # the workers are the user's processes: each returns when its agent stops

    def end_leftovers(self, rec: PoolRecord, lost: list[int]) -> list[str]:
        return []  # their machines are not ours to reach but through the worker itself

    def wait_ready(
        self, rec: PoolRecord, indices: list[int], old: dict[int, str], timeout: float, progress: Callable[[str], None]
    ) -> None:
        self.repair(rec, indices)

    def loss_reason(self, rec: PoolRecord) -> str | None:
        return None

    def describe(self, rec: PoolRecord) -> dict[str, Any]:
        return {"workers": rec.spec.get("workers", [])}
