"""Local memory as RDMA sees it: a flat byte view, its address, and what keeps it alive."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any


class RDMAError(RuntimeError):
    """A buffer or transfer cannot be served; the message says why and what to do."""


@dataclass
class LocalMemory:
    view: memoryview  # 1-D, unsigned bytes
    address: int
    readonly: bool
    keepalive: Any  # the tensor/array/buffer whose memory this is

    @property
    def nbytes(self) -> int:
        return self.view.nbytes


def local_memory(obj: Any, what: str = "buffer") -> LocalMemory:
    """A torch CPU tensor, memoryview, bytearray or numpy array as contiguous bytes (never a copy)."""
    import numpy as np

    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            raise RDMAError(f"{what}: a {obj.device.type} tensor needs the ibverbs backend with dma-buf, which "
                            f"this build does not support yet: use a CPU tensor")
        if not obj.is_contiguous():
            raise RDMAError(f"{what}: the tensor is not contiguous (strides {tuple(obj.stride())}); "
                            f"pass t.contiguous() and keep that copy alive")
        flat = obj.detach().reshape(-1).view(torch.uint8)
        arr = flat.numpy() if flat.numel() else np.empty(0, dtype=np.uint8)
        return LocalMemory(memoryview(arr), int(obj.data_ptr()), False, obj)
    if isinstance(obj, (bytearray, bytes, memoryview)) or hasattr(obj, "__array_interface__"):
        mv = memoryview(obj)
        if not mv.c_contiguous:
            raise RDMAError(f"{what}: the memory is not contiguous; pass a contiguous copy")
        arr = np.frombuffer(mv, dtype=np.uint8) if mv.nbytes else np.empty(0, dtype=np.uint8)
        return LocalMemory(mv.cast("B") if mv.nbytes else memoryview(b""), int(arr.ctypes.data),
                           mv.readonly, obj)
    raise RDMAError(f"{what}: expected a torch tensor, memoryview, bytearray or numpy array, "
                    f"not {type(obj).__name__}")
