"""Real Monarch's runtime on a node other users share: what we can close, and what we cannot.

torchmonarch 0.7.0 serves every host it boots (each worker, and the local host every client
boots) on an *abstract* Unix socket (``unix:@<random>``): no file permissions, no
authentication, and its name is listed in ``/proc/net/unix`` for every user of the machine. A
local user who dials it and names the service proc (the client's is fixed: ``service``) runs
code as the owner. Nothing in Monarch's configuration moves that channel (the backend's transport
is fixed to Unix in hyperactor_mesh), and a private network namespace would cut the worker off
from its client. So ``WarmPoolJob`` runs only when its user says that nobody else can log into
the machines it uses (``trust_local_users=True``): see docs/security.md.

What we can close: Monarch writes its own log to ``/tmp/<user name>/monarch_log*.log`` from the
moment ``monarch.actor`` is imported, at a path ``TMPDIR`` does not move, with the process umask
(0755/0644), and it names the worker's service proc there. ``private_monarch_log_dir`` makes that
directory ours and 0700 (or refuses, when another user made it first) before Monarch is imported.
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

from .errors import MonarchError

TRUST_ENV = "MONARCH_TORCHX_TRUST_LOCAL_USERS"  # "1": the same as trust_local_users=True

REFUSAL = (
    "torchmonarch 0.7.0 serves every host and client on an unauthenticated abstract Unix socket "
    "(listed in /proc/net/unix): any other user of these machines could run code as you. Use WarmPoolJob "
    "only where nobody else can log into them, and say so: WarmPoolJob(..., trust_local_users=True) "
    f"or {TRUST_ENV}=1 (docs/security.md)"
)


def monarch_log_dir() -> Path:
    """Where Monarch 0.7.0 writes its log: ``/tmp/<user name>`` (``TMPDIR`` and ``USER`` aside)."""
    return Path("/tmp") / pwd.getpwuid(os.geteuid()).pw_name


def private_monarch_log_dir() -> Path:
    """Monarch's log directory, made or checked before ``monarch`` is imported: a real directory,
    ours, 0700 (one of ours that is open is closed). One another user made first, or a symlink
    there, is refused in one line: they could read the log, or point it at a file of ours."""
    d = monarch_log_dir()
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(d)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise MonarchError(
            f"{d} is not a directory (a symlink or a file is there): Monarch writes its log there; remove it"
        )
    if st.st_uid != os.geteuid():
        raise MonarchError(
            f"{d} belongs to uid {st.st_uid}: Monarch writes its log there and they could read "
            "or redirect it; ask them (or root) to remove it"
        )
    if st.st_mode & 0o077:
        os.chmod(d, 0o700)
    return d
