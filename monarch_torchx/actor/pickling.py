"""How actor messages are pickled: cloudpickle, protocol 5, tensors out of band.

Classes and functions defined in ``__main__`` (a notebook, a script) travel by value through
cloudpickle; their code keeps its file name and ships the source lines it spans, so a remote
traceback names the user's file and line and shows the line (cloudpickle alone names every such
frame ``<dynamic-code>``), even on a host without that file.

A CPU tensor travels as its raw bytes in an out-of-band buffer: the sender writes it from the
tensor's own memory, the receiver gets it in the bytearray the socket was read into, and
``torch.frombuffer`` wraps that without another copy. torch's own pickling would copy it
through ``torch.save`` into a bytes object instead.
"""

from __future__ import annotations

import io
import linecache
import pickle
import sys
import threading
import types
from typing import Any, Callable

import cloudpickle


def _rebuild_tensor(buf: Any, dtype: str, shape: tuple[int, ...], requires_grad: bool) -> Any:
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


_source_lock = threading.Lock()  # actors' threads unpickle at once: one merge of a file's lines at a time


def _named_code(
    make: Callable[..., types.CodeType], args: tuple, filename: str, first: int, lines: list[str]
) -> types.CodeType:
    """Rebuilds a by-value code object with its original file name, and registers the source
    lines it spans with ``linecache`` so that tracebacks show them here too."""
    if lines:
        _remember_source(filename, first, lines)
    return make(*args).replace(co_filename=filename)


def _remember_source(filename: str, first: int, lines: list[str]) -> None:
    """Puts ``lines`` (from line ``first``) into linecache's entry for ``filename``: the source of
    the code that runs here, which a file of that name on this host (or none) may not match. The
    entry has no mtime, so ``linecache.checkcache`` keeps it (as for a module's loader source)."""
    with _source_lock:
        entry = linecache.cache.get(filename)
        known = list(entry[2]) if entry is not None and len(entry) == 4 and entry[1] is None else []
        end = first - 1 + len(lines)
        known += ["\n"] * (end - len(known))
        known[first - 1 : end] = lines
        linecache.cache[filename] = (sum(map(len, known)), None, known, filename)


def _source_span(code: types.CodeType) -> tuple[int, list[str]]:
    """(first line, the source lines) of ``code`` as the sender's linecache has them; none when
    it has no source (code made by exec of a string)."""
    numbers = [n for _, _, n in code.co_lines() if n is not None]
    first = code.co_firstlineno
    lines = linecache.getlines(code.co_filename)
    if not lines or not numbers:
        return first, []
    return first, lines[first - 1 : max(numbers)]


class _Pickler(cloudpickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is types.CodeType:  # only code travelling by value gets here (in a function's state)
            reduce = self.dispatch_table.get(types.CodeType)
            if reduce is not None:
                make, args = reduce(obj)  # cloudpickle's own, which names the file "<dynamic-code>"
                return (_named_code, (make, args, obj.co_filename, *_source_span(obj)))
        torch = sys.modules.get("torch")
        if (
            torch is not None
            and type(obj) is torch.Tensor
            and obj.device.type == "cpu"
            and obj.layout == torch.strided
            and not obj.is_quantized
        ):
            t = obj.detach().resolve_conj().resolve_neg()
            if not t.is_contiguous():
                t = t.contiguous()  # documented: a non-contiguous tensor is sent as a contiguous copy
            raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
            return _rebuild_tensor, (
                pickle.PickleBuffer(raw),
                str(t.dtype).rpartition(".")[2],
                tuple(t.shape),
                obj.requires_grad,
            )
        return super().reducer_override(obj)


def dumps(obj: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Pickles ``obj``; returns the body and its out-of-band buffers (not copied)."""
    bufs: list[pickle.PickleBuffer] = []
    f = io.BytesIO()
    _Pickler(f, protocol=5, buffer_callback=bufs.append).dump(obj)
    return f.getvalue(), bufs


def loads(body: Any, bufs: list[bytearray]) -> Any:
    return pickle.loads(body, buffers=bufs)
