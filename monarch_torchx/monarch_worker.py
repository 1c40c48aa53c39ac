"""One host of a real Monarch job on a warm pool: Monarch's own worker loop, over mutual TLS.

``WarmPoolJob`` (``monarch_backend.py``) launches this on every host of its pool, as an app of
the pool, so the worker stays warm between client runs as long as the pool does:

    MONARCH_TORCHX_MONARCH_ADDRESS=service<...>@tls://10.0.0.5:40123 python -m monarch_torchx.monarch_worker

(the address names the worker's service proc: it travels in the environment, which only its
owner can read, not on the command line). The job's TLS files (CA, certificate, key:
``MONARCH_TORCHX_MONARCH_TLS``, one PEM text) are written to a private directory of this user's
node temp root before Monarch starts, and Monarch reads them from ``HYPERACTOR_TLS_*``. Monarch's
plain ``tcp`` transport accepts any peer, and a worker evaluates what its peers send it, so the
worker's network port speaks only ``tls``: a peer without a certificate of this job's CA is
refused. Monarch also serves each host on an abstract Unix socket that nothing authenticates,
which is why ``WarmPoolJob`` needs ``trust_local_users`` (``monarch_shared.py``). Monarch's own
log goes to ``/tmp/<user name>``, made ours and 0700 before Monarch is imported.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
from pathlib import Path

TLS_ENV = "MONARCH_TORCHX_MONARCH_TLS"
ADDRESS_ENV = "MONARCH_TORCHX_MONARCH_ADDRESS"  # this worker's address, when --address is not given
_BLOCKS = ("ca", "cert", "key")


def split_bundle(text: str) -> dict[str, str]:
    """The bundle's three PEM blocks, in order: the CA certificate, our certificate, its key."""
    blocks, current = [], []
    for line in text.strip().splitlines():
        current.append(line)
        if line.startswith("-----END "):
            blocks.append("\n".join(current) + "\n")
            current = []
    if len(blocks) != 3 or "PRIVATE KEY" not in blocks[2]:
        raise ValueError("the job's TLS bundle must hold a CA certificate, a certificate and its key")
    return dict(zip(_BLOCKS, blocks))


def tls_env(directory: Path) -> dict[str, str]:
    """The HYPERACTOR_TLS_* env that points Monarch at the job's files in ``directory``."""
    return {f"HYPERACTOR_TLS_{name.upper()}": str(directory / f"{name}.pem") for name in _BLOCKS}


def install_tls(bundle: str, directory: Path) -> dict[str, str]:
    """Writes the bundle's files (0600) into ``directory`` and returns the HYPERACTOR_TLS_* env."""
    from .private import write_private_bytes

    for name, block in split_bundle(bundle).items():
        write_private_bytes(directory / f"{name}.pem", block.encode())
    return tls_env(directory)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--address",
        default=os.environ.pop(ADDRESS_ENV, None),
        help=f"this worker's Monarch address (a tls:// proc address; default: ${ADDRESS_ENV})",
    )
    a = p.parse_args()
    if not a.address:
        sys.exit(f"monarch_worker: no address: pass --address or set {ADDRESS_ENV}")
    if "tls://" not in a.address:
        sys.exit(f"monarch_worker: {a.address!r} is not a tls:// address; workers here listen only on TLS")
    bundle = os.environ.pop(TLS_ENV, "")
    if not bundle:
        sys.exit(f"monarch_worker: {TLS_ENV} is not set (the job passes its TLS files there)")

    from .private import agent_temp_dir

    workdir = agent_temp_dir(
        "monarch", os.environ.get("MONARCH_TORCHX_POOL", "pool"), int(os.environ.get("MONARCH_TORCHX_HOST_INDEX", "0"))
    )
    os.environ.update(install_tls(bundle, workdir))
    os.environ["TMPDIR"] = str(workdir)  # the runtime's own sockets and files (its log does not move)
    import tempfile

    tempfile.tempdir = None  # gettempdir() cached the old TMPDIR above
    from .errors import MonarchError
    from .monarch_shared import private_monarch_log_dir

    try:
        private_monarch_log_dir()  # before Monarch is imported: the import starts its log
    except MonarchError as e:
        sys.exit(f"monarch_worker: {e}")

    def _end(signum: int, _frame: object) -> None:
        shutil.rmtree(workdir, ignore_errors=True)
        os._exit(128 + signum)  # Monarch's runtime threads do not unwind: leave at once

    signal.signal(signal.SIGTERM, _end)
    signal.signal(signal.SIGINT, _end)

    from monarch.actor import enable_transport, run_worker_loop_forever

    enable_transport(a.address.rsplit("@", 1)[-1].rsplit(":", 1)[0] + ":0")
    print(f"monarch worker serving at {a.address}", flush=True)
    try:
        run_worker_loop_forever(address=a.address, ca="trust_all_connections")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
