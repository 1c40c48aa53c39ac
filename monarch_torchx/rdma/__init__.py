"""RDMA buffers for actor meshes: ibverbs (pyverbs), tcp and same-host (cma) behind one API.

from monarch_torchx.rdma import RDMABuffer, RDMAAction, get_rdma_backend
"""

from .buffer import RDMAAction, RDMABuffer, get_rdma_backend, is_ibverbs_available, is_rdma_available
from .memory import RDMAError

__all__ = ["RDMAAction", "RDMABuffer", "RDMAError", "get_rdma_backend", "is_ibverbs_available", "is_rdma_available"]
