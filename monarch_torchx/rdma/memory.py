"""Local memory as RDMA sees it: a flat byte view, its address, and what keeps it alive."""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from typing_extensions import Buffer

HUGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25


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
            raise RDMAError(
                f"{what}: a {obj.device.type} tensor needs the ibverbs backend with dma-buf, which "
                f"this build does not support yet: use a CPU tensor"
            )
        if not obj.is_contiguous():
            raise RDMAError(
                f"{what}: the tensor is not contiguous (strides {tuple(obj.stride())}); "
                f"pass t.contiguous() and keep that copy alive"
            )
        flat = obj.detach().reshape(-1).view(torch.uint8)
        arr = flat.numpy() if flat.numel() else np.empty(0, dtype=np.uint8)
        # an ndarray exports the buffer protocol (numpy's stubs declare it on Python >= 3.12 only)
        return LocalMemory(memoryview(cast("Buffer", arr)), int(obj.data_ptr()), False, obj)
    if isinstance(obj, (bytearray, bytes, memoryview)) or hasattr(obj, "__array_interface__"):
        mv = memoryview(obj)
        if not mv.c_contiguous:
            raise RDMAError(f"{what}: the memory is not contiguous; pass a contiguous copy")
        arr = np.frombuffer(mv, dtype=np.uint8) if mv.nbytes else np.empty(0, dtype=np.uint8)
        return LocalMemory(mv.cast("B") if mv.nbytes else memoryview(b""), int(arr.ctypes.data), mv.readonly, obj)
    raise RDMAError(f"{what}: expected a torch tensor, memoryview, bytearray or numpy array, not {type(obj).__name__}")


def wait_all(futures: Any) -> None:
    """Waits for every future (none may still touch the memory), then raises the first failure."""
    errors = []
    for f in futures:
        try:
            f.result()
        except Exception as e:
            errors.append(e)
    if errors:
        raise errors[0]


def collapse_to_huge_pages(address: int, nbytes: int) -> bool:
    """Best effort: back [address, address+nbytes) with 2 MiB pages (Linux MADV_COLLAPSE, 6.1+).

    A same-host reader's kernel copy pins every source page: with huge pages that is 512x fewer
    pins, and a same-host read runs about twice as fast (benchmarks/RESULTS.md, "numbers behind the
    code"). The content is unchanged; only its backing moves, once. MONARCH_TORCHX_RDMA_HUGEPAGES=0 turns it off.
    """
    if os.environ.get("MONARCH_TORCHX_RDMA_HUGEPAGES", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    start = (address + HUGE - 1) & ~(HUGE - 1)
    end = (address + nbytes) & ~(HUGE - 1)
    if end - start < HUGE:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(start, end - start, MADV_HUGEPAGE)
        return libc.madvise(start, end - start, MADV_COLLAPSE) == 0
    except (OSError, AttributeError):
        return False
