"""Futures with Monarch's blocking and async faces: ``get(timeout)``, ``result()``, ``await``.

A future is completed by whoever reads the answer off the socket. There is no background
reader thread: the thread that waits becomes the reader (see ``hub.Hub.wait``), which saves a
thread hand-off on every round trip. A future completed from an asyncio loop instead (a port
inside an actor) has no hub and is waited on with an event.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Generator, Generic, Sequence, TypeVar

if TYPE_CHECKING:
    from .hub import Hub

T = TypeVar("T")
_UNSET = object()
log = logging.getLogger("monarch_torchx.actor")
_executor: list[Any] = []
_executor_lock = threading.Lock()


def _waiters() -> Any:
    """Threads that wait on behalf of ``await`` (more than asyncio's default 6 on 2 cores)."""
    with _executor_lock:
        if not _executor:
            from concurrent.futures import ThreadPoolExecutor

            _executor.append(ThreadPoolExecutor(max_workers=64, thread_name_prefix="monarch-torchx-await"))
        return _executor[0]


class Future(Generic[T]):
    def __init__(self, hub: Hub | None = None):
        self._hub = hub
        self._value: Any = _UNSET
        self._exc: BaseException | None = None
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[Future[T]], None]] = []
        self._event: threading.Event | None = None
        self.loop_thread: int | None = None  # set when only that thread's asyncio loop can complete it
        self._loop_parts: list[Future[Any]] | None = None  # for a gather: the parts only that loop completes
        # an error's words for the caller, applied when it fails (an actor call's SupervisionError
        # says which endpoint and actor, as Monarch's does)
        self.translate: Callable[[BaseException], BaseException] | None = None

    # ------------------------------------------------------------ completing

    def set_result(self, value: Any) -> None:
        self._complete(value, None)

    def set_exception(self, exc: BaseException) -> None:
        self._complete(None, exc)

    def _complete(self, value: Any, exc: BaseException | None) -> None:
        if exc is not None and self.translate is not None:
            exc = self.translate(exc)
        with self._lock:
            if self._value is not _UNSET or self._exc is not None:
                return
            self._exc = exc
            self._value = value if exc is None else None
            callbacks, self._callbacks = self._callbacks, []
            event = self._event
        if event is not None:
            event.set()
        for cb in callbacks:
            try:
                cb(self)
            except Exception:  # on the reader thread: one bad callback must not drop other answers
                log.exception("a future's done-callback raised")

    def add_done_callback(self, fn: Callable[[Future[T]], None]) -> None:
        with self._lock:
            if not self.done():
                self._callbacks.append(fn)
                return
        fn(self)

    # ------------------------------------------------------------ waiting

    def done(self) -> bool:
        return self._value is not _UNSET or self._exc is not None

    def _wait(self, timeout: float | None) -> bool:
        if self.done():
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.loop_thread == threading.get_ident() and (
            self._loop_parts is None or any(not p.done() for p in self._loop_parts)
        ):
            raise RuntimeError(
                "this future is answered by this proc's own event loop (a port here, or an actor "
                "of this same proc): use `await` in an async endpoint instead of .get()"
            )
        if self._hub is not None:
            return self._hub.wait(self.done, deadline)
        with self._lock:
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        if self.done():
            return True
        return event.wait(timeout)

    def get(self, timeout: float | None = None) -> T:
        """Blocks for the value; a timeout raises TimeoutError and leaves the future pending."""
        if not self._wait(timeout):
            raise TimeoutError(f"no answer within {timeout} s (still pending: get() again to keep waiting)")
        if self._exc is not None:
            raise self._exc
        return self._value

    def result(self, timeout: float | None = None) -> T:
        return self.get(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._wait(timeout):
            raise TimeoutError(f"no answer within {timeout} s")
        return self._exc

    def __await__(self) -> Generator[Any, None, T]:
        import asyncio

        if not self.done():
            loop = asyncio.get_running_loop()
            # someone must read the sockets: a worker thread, unless a proc's loop is the hub's reader
            if self._hub is not None and not self._hub.read_by_a_loop():
                stop = threading.Event()

                def wait() -> None:
                    while not stop.is_set() and not self._wait(0.5):
                        pass

                try:
                    yield from loop.run_in_executor(_waiters(), wait).__await__()
                finally:
                    stop.set()  # a cancelled await frees its thread within half a second
            else:
                waiter = loop.create_future()
                on_loop = threading.get_ident()

                def settle() -> None:
                    if not waiter.done():
                        waiter.set_result(None)

                def wake(_f: Future[T]) -> None:
                    if threading.get_ident() == on_loop:  # completed by the loop's own reading
                        settle()
                    else:
                        loop.call_soon_threadsafe(settle)

                self.add_done_callback(wake)
                yield from waiter.__await__()
        return self.get()

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._exc else "done")
        return f"<Future {state}>"

    # ------------------------------------------------------------ combining

    @staticmethod
    def resolved(value: Any) -> Future[Any]:
        """A future that already holds ``value`` (what Monarch returns as a Future is often ready here)."""
        fut: Future[Any] = Future()
        fut.set_result(value)
        return fut

    @staticmethod
    def gather(hub: Hub | None, parts: Sequence[Future[Any]], combine: Callable[[list[Any]], Any]) -> Future[Any]:
        """A future for all ``parts``: their values combined, or the first failure in order."""
        out: Future[Any] = Future(hub)
        out.loop_thread = next((p.loop_thread for p in parts if p.loop_thread is not None), None)
        out._loop_parts = [p for p in parts if p.loop_thread is not None]
        remaining = [len(parts)]
        lock = threading.Lock()

        def one(_f: Future[Any]) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                for p in parts:
                    if p._exc is not None:
                        out.set_exception(p._exc)
                        return
                try:
                    out.set_result(combine([p._value for p in parts]))
                except Exception as e:
                    out.set_exception(e)

        if not parts:
            out.set_result(combine([]))
        for p in parts:
            p.add_done_callback(one)
        return out
