"""TorchX workspaces on a warm pool: synced to every host by syncfs, not copied or rebuilt.

TorchX hands a ``WorkspaceMixin`` scheduler the workspace (``--workspace``, default the current
directory) before the app is planned; ours marks role 0 with it when ``-cfg workspace_mount=PATH``
is set, and after the pool is up the workspace is synced to ``PATH`` on the hosts that run role 0,
which then runs there. A resync of an unchanged workspace sends and commits nothing, so every run
pays a fraction of a second, and an edit costs only its changed chunks.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List
from urllib.parse import urlparse

from ..errors import MonarchError

IMAGE_PREFIX = "syncfs:"  # role 0's image once a workspace is attached: "syncfs:/abs/workspace"
MOUNT_TOKEN = "@workspace_mount@"  # in a planned launch: where the workspace is on its host
SILENT_S = 3.0  # a sync that takes longer shows its progress, a line this often


@dataclass
class Workspace:
    src: str  # the local directory
    mount: str  # the --to of the sync: relative = in the pool's sync area, absolute = an allowed root


def local_dir(workspace: str) -> str:
    """The directory a TorchX workspace names (``file://PATH`` or a plain path)."""
    u = urlparse(workspace)
    if u.scheme not in ("", "file"):
        raise MonarchError(f"workspace {workspace!r}: monarch schedulers sync local directories (file://PATH); "
                           "pass --workspace PATH, or drop -cfg workspace_mount")
    path = os.path.abspath(u.path if u.scheme else workspace)
    if not os.path.isdir(path):
        raise MonarchError(f"workspace {path} is not a directory; pass --workspace DIR")
    return path


def attached(image: str, cfg: Dict[str, Any]) -> Workspace | None:
    """The workspace ``build_workspace_and_update_role`` attached to a role, if any."""
    mount = cfg.get("workspace_mount")
    if not mount or not image.startswith(IMAGE_PREFIX):
        return None
    return Workspace(image[len(IMAGE_PREFIX):], str(mount))


def sync_to_hosts(pool: Any, ws: Workspace, hosts: List[int], say: Callable[[str], None]) -> Dict[int, str]:
    """Syncs the workspace to ``hosts``; returns each host's path to it. Any host that did not
    get it stops the run before anything starts (its previous generation stays served)."""
    t0, last = time.time(), [0.0]

    def progress(msg: str) -> None:  # a line every few seconds, once the sync is a long one
        now = time.time()
        if now - t0 > SILENT_S and now - last[0] >= SILENT_S:
            last[0] = now
            say(msg)

    report = pool.sync(ws.src, ws.mount, hosts=hosts, progress=progress)
    failed = [h for h in report.hosts if not h.ok]
    if failed:
        why = "; ".join(h.error for h in failed)  # each names its host
        raise MonarchError(f"workspace {ws.src} could not be synced to {ws.mount} ({why}); nothing was started")
    say(f"workspace {ws.src} -> {ws.mount} on {len(report.hosts)} host(s): generation {report.generation}, "
        f"{report.files} file(s), {report.bytes_sent / 1e6:.1f} MB sent in {report.seconds:.2f} s")
    return {h.index: h.path for h in report.hosts}


def workdirs(pool: Any, ws: Workspace, hosts: List[int]) -> Dict[int, str]:
    """Each host's writable working directory over its synced copy (outputs persist there)."""
    res = pool.ask("syncfs.workdir", hosts, timeout=120.0, target=ws.mount)
    failed = [(i, e) for i, _, e in res if e]
    if failed:
        why = "; ".join(f"host {i}: {e}" for i, e in failed)
        raise MonarchError(f"no writable working directory for workspace {ws.mount} ({why}); nothing was started")
    return {i: out["path"] for i, out, _ in res}


def place(spec: Any, path: str) -> None:
    """Puts a planned launch in its host's copy of the workspace."""
    spec.argv = [a.replace(MOUNT_TOKEN, path) for a in spec.argv]
    spec.env = {k: v.replace(MOUNT_TOKEN, path) for k, v in spec.env.items()}
    spec.cwd = path if spec.cwd is None else spec.cwd.replace(MOUNT_TOKEN, path)
