"""TorchX scheduler plugins and the pool provisioners behind them.

``monarch_local`` is the embedded default; later engines (``monarch_slurm``,
``monarch_kubernetes``) register their provisioner in ``pool.PROVISIONERS`` and reuse everything else.
"""

from __future__ import annotations

from ..pool import ENGINES, PROVISIONERS
from ..pool import get_provisioner as provisioner_for

__all__ = ["ENGINES", "PROVISIONERS", "provisioner_for"]
