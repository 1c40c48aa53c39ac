"""What a controller does with a supervision event nobody handled: ``unhandled_fault_hook``.

As in Monarch: an actor of a mesh the controller spawned failed, or one of its procs died, and
no owner's ``__supervise__`` took it. The default logs the report and ends the controller with
exit code 1; assign ``monarch_torchx.actor.unhandled_fault_hook`` to do something else (it is
looked up there each time). The hook runs on the thread that read the event: one waiting on a
Future (what the hook raises comes out of that ``get()``), or, while no call waits, the hub's
idle reader or its supervision thread (a proc's death); there what it raises ends the program as Monarch's
does, with a KeyboardInterrupt in the main thread (so atexit handlers still run there).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from .errors import MeshFailure


def unhandled_fault_hook(failure: MeshFailure) -> None:
    print(f"monarch-torchx: unhandled supervision event: {failure.report()}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def dispatch(failure: MeshFailure) -> None:
    """Calls the hook the user installed (or the default)."""
    pkg = sys.modules.get("monarch_torchx.actor")
    hook = getattr(pkg, "unhandled_fault_hook", unhandled_fault_hook) if pkg is not None else unhandled_fault_hook
    hook(failure)


def unhandled_off_caller(exc: BaseException) -> None:
    """The hook raised on a thread no call waits on (the idle reader, the supervision thread): the main
    thread is interrupted. Where SIGINT does not reach Python (a controller started in the
    background by a non-interactive shell, or under nohup, inherits it ignored), the process
    ends at once with the hook's exit code instead: what raised must still end the program."""
    print(
        f"monarch-torchx: the unhandled fault hook raised {exc!r}; interrupting the main thread",
        file=sys.stderr,
        flush=True,
    )
    main = threading.main_thread()
    if not main.is_alive() or main.ident is None:
        return
    if not callable(signal.getsignal(signal.SIGINT)):  # SIG_IGN or SIG_DFL: no KeyboardInterrupt would come
        code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    signal.pthread_kill(main.ident, signal.SIGINT)
