"""TorchX scheduler plugins and the pool provisioners behind them.

``monarch_local`` is the embedded default; later engines (``monarch_slurm``,
``monarch_kubernetes``) register their provisioner here and reuse everything else.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ..errors import MonarchError

if TYPE_CHECKING:
    from ..pool import Provisioner

# scheduler name -> "module:class" of its provisioner (imported only when used)
PROVISIONERS = {
    "monarch_local": "monarch_torchx.schedulers.local:LocalProvisioner",
    "monarch_slurm": "monarch_torchx.schedulers.slurm:SlurmProvisioner",
    "monarch_kubernetes": "monarch_torchx.schedulers.kubernetes:KubernetesProvisioner",
}
# engines with no TorchX scheduler of their own (pools made from Python, not by `torchx run`)
ENGINES = {
    "monarch_workers": "monarch_torchx.schedulers.workers:WorkersProvisioner",  # attach_to_workers
}


def provisioner_for(scheduler: str) -> Provisioner:
    target = PROVISIONERS.get(scheduler) or ENGINES.get(scheduler)
    if target is None:
        raise MonarchError(f"unknown scheduler {scheduler!r}: use one of {', '.join(PROVISIONERS)}")
    mod, _, cls = target.partition(":")
    return getattr(importlib.import_module(mod), cls)()
