"""TorchX components that target warm pools (``torchx run monarch.hostinfo``).

No ``from __future__ import annotations`` here: TorchX reads parameter types at run time.
"""

import torchx.specs as specs


def hostinfo(replicas: int = 1) -> specs.AppDef:
    """Prints, from every replica, where it runs: pool, host index, hostname, pid, rank0 host.

    A smoke test for a pool: ``torchx run -s monarch_local monarch.hostinfo --replicas 2``.

    Args:
        replicas: number of replicas (one per host)
    """
    code = (
        "import os, socket; e = os.environ.get; "
        "print(f\"pool={e('MONARCH_TORCHX_POOL')} host={e('MONARCH_TORCHX_HOST_INDEX')} "
        "hostname={socket.gethostname()} pid={os.getpid()} rank0={e('TORCHX_RANK0_HOST')}\")"
    )
    return specs.AppDef(
        name="hostinfo",
        roles=[specs.Role(name="hostinfo", image=".", entrypoint="python", args=["-c", code], num_replicas=replicas)],
    )
