"""TorchX workspaces on a warm pool: synced to every host by syncfs, not copied or rebuilt.

TorchX hands a ``WorkspaceMixin`` scheduler the workspace (``--workspace``, default the current
directory) before the app is planned; ours marks role 0 with it when ``-cfg workspace_mount=PATH``
is set, and after the pool is up the workspace is synced to ``PATH`` on the hosts that run role 0,
which then runs there. A resync of an unchanged workspace sends and commits nothing, so every run
pays a fraction of a second, and an edit costs only its changed chunks.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

from ..errors import MonarchError

IMAGE_PREFIX = "syncfs:"  # role 0's image once a workspace is attached: "syncfs:/abs/workspace"
MOUNT_TOKEN = "@workspace_mount@"  # in a planned launch: where the workspace is on its host
SILENT_S = 3.0  # a sync that takes longer shows its progress, a line this often
PER_HOST_DOC = "docs/syncfs.md, 'Shared writes'"


@dataclass
class Workspace:
    src: str  # the local directory
    mount: str  # the --to of the sync: relative = in the pool's sync area, absolute = an allowed root


def _say(msg: str) -> None:
    print(f"monarch-torchx: {msg}", file=sys.stderr, flush=True)


def local_dir(workspace: str) -> str:
    """The directory a TorchX workspace names (``file://PATH`` or a plain path)."""
    u = urlparse(workspace)
    if u.scheme not in ("", "file"):
        raise MonarchError(
            f"workspace {workspace!r}: monarch schedulers sync local directories (file://PATH); "
            "pass --workspace PATH, or drop -cfg workspace_mount"
        )
    path = os.path.abspath(u.path if u.scheme else workspace)
    if not os.path.isdir(path):
        raise MonarchError(f"workspace {path} is not a directory; pass --workspace DIR")
    return path


def attached(image: str, cfg: dict[str, Any]) -> Workspace | None:
    """The workspace ``build_workspace_and_update_role`` attached to a role, if any."""
    mount = cfg.get("workspace_mount")
    if not mount or not image.startswith(IMAGE_PREFIX):
        return None
    return Workspace(image[len(IMAGE_PREFIX) :], str(mount))


def sync_to_hosts(pool: Any, ws: Workspace, hosts: list[int], say: Callable[[str], None]) -> dict[int, str]:
    """Syncs the workspace to ``hosts``; returns each host's path to it. Any host that did not
    get it stops the run before anything starts (its previous generation stays served)."""
    t0, last = time.time(), [0.0]

    def progress(msg: str) -> None:  # a line every few seconds, once the sync is a long one
        now = time.time()
        if now - t0 > SILENT_S and now - last[0] >= SILENT_S:
            last[0] = now
            say(msg)

    from ..syncfs import sync

    report = sync(pool, ws.src, ws.mount, hosts=hosts, progress=progress)
    failed = [h for h in report.hosts if not h.ok]
    if failed:
        why = "; ".join(h.error for h in failed)  # each names its host
        raise MonarchError(f"workspace {ws.src} could not be synced to {ws.mount} ({why}); nothing was started")
    say(
        f"workspace {ws.src} -> {ws.mount} on {len(report.hosts)} host(s): generation {report.generation}, "
        f"{report.files} file(s), {report.bytes_sent / 1e6:.1f} MB sent in {report.seconds:.2f} s"
    )
    return {h.index: h.path for h in report.hosts}


def workdirs(pool: Any, ws: Workspace, hosts: list[int], say: Callable[[str], None] = _say) -> dict[int, str]:
    """Each host's writable working directory over its synced copy (outputs persist there): one
    directory for all of them where they share a file system, as ranks expect of their cwd (the
    DDP tutorial's rank 0 saves the snapshot every rank resumes from); else one per host, said."""
    from ..pool import get_provisioner

    if not get_provisioner(pool.record.scheduler).client_cwd_on_hosts:
        _say_per_host_once(pool, ws, "the hosts share no file system", say)
        return _own_workdirs(pool, ws, hosts)
    shared, why = _shared_workdir(pool, ws, hosts)
    if shared is None:
        _say_per_host_once(pool, ws, why, say)
        return _own_workdirs(pool, ws, hosts)
    return {i: shared for i in hosts}


def _failed(res: list[Any], what: str, ws: Workspace) -> None:
    """Stops the run, naming each host that could not make its working directory."""
    failed = [(i, e) for i, _, e in res if e]
    if failed:
        why = "; ".join(f"host {i}: {e}" for i, e in failed)
        raise MonarchError(f"no {what} for workspace {ws.mount} ({why}); nothing was started")


def _own_workdirs(pool: Any, ws: Workspace, hosts: list[int]) -> dict[int, str]:
    """A working directory per host, each over its own copy (``HOME/workspaces/POOL/MOUNT/hostN``)."""
    res = pool.ask("syncfs.workdir", hosts, timeout=120.0, target=ws.mount)
    _failed(res, "writable working directory", ws)
    return {i: out["path"] for i, out, _ in res}


def _shared_workdir(pool: Any, ws: Workspace, hosts: list[int]) -> tuple[str | None, str]:
    """The pool's shared working directory for ``ws`` (``HOME/workspaces/POOL/MOUNT/shared``), or
    None and why the hosts cannot share one. Each host points the pool's view of the mount at its
    own copy, the first refreshes the directory, and every host then proves it sees that very
    directory (a fresh nonce beside it) and, through the view, its own copy."""
    res = pool.ask("syncfs.view", hosts, timeout=120.0, target=ws.mount)
    _failed(res, "view of the synced copy", ws)
    views = {out["view"] for _, out, _ in res}
    if len(views) != 1:
        return None, f"the hosts keep their synced copies under different paths ({', '.join(sorted(views))})"
    view, nonce = views.pop(), secrets.token_hex(16)
    res = pool.ask("syncfs.shared_workdir", hosts[:1], timeout=120.0, target=ws.mount, view=view, nonce=nonce)
    _failed(res, "shared working directory", ws)
    path = res[0][1]["path"]
    res = pool.ask("syncfs.check_shared", hosts, timeout=120.0, target=ws.mount, view=view, nonce=nonce)
    _failed(res, "shared working directory", ws)
    whys = [out["why"] for _, out, _ in res if out["why"]]
    if whys:
        return None, f"{whys[0]}{f' (and {len(whys) - 1} more host(s))' if len(whys) > 1 else ''}"
    return path, ""


def _say_per_host_once(pool: Any, ws: Workspace, why: str, say: Callable[[str], None]) -> None:
    """Says once per pool and mount that each host writes its own working directory, why, and what
    to do instead, so a resume that sees another rank's files missing is not a mystery."""
    marker = Path(pool.record.state_dir) / "hosts" / "workspace-per-host-said"
    with contextlib.suppress(OSError):
        if ws.mount in marker.read_text().splitlines():
            return
    say(
        f"warning: workspace {ws.mount}: each host runs in a working directory of its own ({why}), so what "
        f"one host's ranks write there (a snapshot) is not seen by the others; write what ranks share to a "
        f"file system every host mounts, or give workspace_mount an absolute path under an allowed root "
        f"(the same path on every node) ({PER_HOST_DOC})"
    )
    with contextlib.suppress(OSError):
        from ..registry import write_private

        said = marker.read_text().splitlines() if marker.exists() else []
        write_private(marker, "\n".join([*said, ws.mount]) + "\n")


def place(spec: Any, path: str) -> None:
    """Puts a planned launch in its host's copy of the workspace."""
    spec.argv = [a.replace(MOUNT_TOKEN, path) for a in spec.argv]
    spec.env = {k: v.replace(MOUNT_TOKEN, path) for k, v in spec.env.items()}
    spec.cwd = path if spec.cwd is None else spec.cwd.replace(MOUNT_TOKEN, path)
