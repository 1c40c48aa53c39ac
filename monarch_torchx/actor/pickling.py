"""How actor messages are pickled: cloudpickle, protocol 5, tensors out of band.

Classes and functions defined in ``__main__`` (a notebook, a script) travel by value through
cloudpickle. A CPU tensor travels as its raw bytes in an out-of-band buffer: the sender writes
it from the tensor's own memory, the receiver gets it in the bytearray the socket was read
into, and ``torch.frombuffer`` wraps that without another copy. torch's own pickling would
copy it through ``torch.save`` into a bytes object instead.
"""

from __future__ import annotations

import io
import pickle
import sys
from typing import Any, List, Tuple

import cloudpickle


def _rebuild_tensor(buf: Any, dtype: str, shape: Tuple[int, ...], requires_grad: bool) -> Any:
    import torch

    dt = getattr(torch, dtype)
    view = memoryview(buf)
    if view.nbytes == 0:
        t = torch.empty(shape, dtype=dt)
    else:
        t = torch.frombuffer(view, dtype=torch.uint8).view(dt).reshape(shape)
    if requires_grad:
        t.requires_grad_(True)
    return t


class _Pickler(cloudpickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) is torch.Tensor and obj.device.type == "cpu" \
                and obj.layout == torch.strided and not obj.is_quantized:
            t = obj.detach().resolve_conj().resolve_neg()
            if not t.is_contiguous():
                t = t.contiguous()  # documented: a non-contiguous tensor is sent as a contiguous copy
            raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
            return _rebuild_tensor, (pickle.PickleBuffer(raw), str(t.dtype).rpartition(".")[2], tuple(t.shape),
                                     obj.requires_grad)
        return super().reducer_override(obj)


def dumps(obj: Any) -> Tuple[bytes, List[pickle.PickleBuffer]]:
    """Pickles ``obj``; returns the body and its out-of-band buffers (not copied)."""
    bufs: List[pickle.PickleBuffer] = []
    f = io.BytesIO()
    _Pickler(f, protocol=5, buffer_callback=bufs.append).dump(obj)
    return f.getvalue(), bufs


def loads(body: Any, bufs: List[bytearray]) -> Any:
    return pickle.loads(body, buffers=bufs)
