"""The agent's process launcher: a fork server that may hold pre-imported modules (torch).

Every process a host runs is started from here. When the entrypoint is this very interpreter,
the program runs in a forked child itself, so that a role starting ``python train.py`` does not
pay for ``import torch`` again. Any other entrypoint is exec'd with ``posix_spawn``: it needs
nothing of this interpreter, and a fork would first copy the page tables of a server that may
hold torch, then have the child fault in pages only to exec. Either child looks as if exec'd:
its own session and process group, fresh stdio on the given fds, the requested env, cwd, argv
(and sys.path), default signal handlers, Python's exit-code rules.

Runs as ``python -m monarch_torchx.agent.forkserver CTL_FD EVT_FD [preload ...]``; it talks to
its agent over two inherited socketpairs (nothing listens), framed by ``wire``:
    ctl (agent -> here):  1 byte carrying stdout/stderr fds (SCM_RIGHTS), then a ``Start``
    evt (here -> agent):  ``Ready``, ``Started`` | ``StartFailed`` (by token), ``Exited``
(named types, ``forkserver_messages``)
A ``StartServer`` (its fds: a new server's ctl and evt) forks another fork server from
this one, which then imports its own preloads: it starts without an interpreter's start-up, and
shares this one's pages until it writes to them. Its exit is not reported as a program's.
"""

from __future__ import annotations

import atexit
import bdb
import ctypes
import gc
import os
import runpy
import select
import shutil
import signal
import socket
import sys
import sysconfig
import threading
import time
import traceback
import types
import weakref
import zipfile
from dataclasses import dataclass
from typing import Iterable, NoReturn, Sequence

from .forkserver_messages import Exited, Ready, Start, Started, StartFailed, StartMode, StartServer

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15

# env vars read while an interpreter initializes: a child asking for different values than
# the fork server started with cannot be served from it, so it is exec'd instead.
INIT_ENV = (
    "PYTHONHOME",
    "PYTHONHASHSEED",
    "PYTHONMALLOC",
    "PYTHONDEVMODE",
    "PYTHONOPTIMIZE",
    "PYTHONWARNINGS",
    "PYTHONIOENCODING",
    "PYTHONUTF8",
    "PYTHONSAFEPATH",
    "PYTHONNOUSERSITE",
    "PYTHONPLATLIBDIR",
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
)


@dataclass
class PyInvocation:
    """What ``python [-u] [-B] (-c CODE | -m MOD | SCRIPT) ARGS`` asks for."""

    kind: str  # "c" | "m" | "script"
    target: str
    args: list[str]
    unbuffered: bool = False
    no_bytecode: bool = False


def parse_python_argv(args: Sequence[str]) -> PyInvocation | None:
    """Parses interpreter flags we can honour in a forked child; None means "exec it"."""
    unbuffered = no_bytecode = False
    i = 0
    while i < len(args):
        a = args[i]
        if a == "-u":
            unbuffered = True
        elif a == "-B":
            no_bytecode = True
        elif a in ("-c", "-m"):
            if i + 1 >= len(args):
                return None
            return PyInvocation(a[1], args[i + 1], list(args[i + 2 :]), unbuffered, no_bytecode)
        elif a.startswith("-"):
            return None  # -i, -E, -X ..., combined flags, stdin: let the real interpreter do it
        else:
            return PyInvocation("script", a, list(args[i + 1 :]), unbuffered, no_bytecode)
        i += 1
    return None


def set_pdeathsig(sig: int) -> None:
    """Ask the kernel to signal us when our parent dies (so nothing outlives a SIGKILLed agent)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def set_process_name(name: str) -> None:
    """The name ``ps -o comm`` and ``top`` show (at most 15 bytes): a fork server forked from
    another one has the same command line, and an operator should still tell them apart."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _own_name() -> str:
    try:
        with open("/proc/self/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


# the interpreter's name, read at import (in the first server): a forked server renames itself,
# and the programs it forks take this one back, as an exec would have given them
INTERPRETER_NAME = _own_name()


# the server's dispositions are not the program's (Python ignores SIGPIPE and SIGXFSZ, and an agent
# started with a signal ignored passes that on): an exec'd program starts with every one default
EXEC_DEFAULT_SIGNALS = frozenset(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP}


# ---------------------------------------------------------------- in the child


def _flush_c_stdio() -> None:
    """What exit() would do for C extensions' buffered stdio (os._exit skips it)."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


def _std_streams(unbuffered: bool) -> None:
    import io

    def writer(fd: int, line: bool) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        buf = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(
            buf,
            encoding="utf-8",
            errors="backslashreplace" if fd == 2 else "strict",
            line_buffering=line,
            write_through=unbuffered,
        )

    # sys.__stdin__ and the others are Final in typeshed: set in sys's dict (which is what assigning them does)
    std = vars(sys)
    sys.stdin = std["__stdin__"] = io.TextIOWrapper(
        io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8"
    )
    sys.stdout = std["__stdout__"] = writer(1, False)
    sys.stderr = std["__stderr__"] = writer(2, True)


def _sys_path(inv: PyInvocation, base: list[str], env: dict[str, str]) -> list[str]:
    if inv.kind == "script":
        first = os.path.dirname(os.path.realpath(inv.target))
    elif inv.kind == "m":
        first = os.getcwd()
    else:
        first = ""
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [first, *extra, *base]


def _user_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback from the user's first frame on, as a real interpreter prints it (not ours)."""
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return tb


def run_python(inv: PyInvocation, env: dict[str, str], base_path: list[str]) -> int:
    """Runs the invocation as ``__main__`` in this (forked) process; returns the exit code."""
    os.environ.clear()
    os.environ.update(env)
    _std_streams(inv.unbuffered or bool(env.get("PYTHONUNBUFFERED")))
    sys.dont_write_bytecode = inv.no_bytecode or bool(env.get("PYTHONDONTWRITEBYTECODE"))
    sys.path[:] = _sys_path(inv, base_path, env)
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    inherited = set(sys.modules) - {"__main__"}  # the fork server's: not the program's to finalize
    _inherited_finalizers_stay()
    code = 0
    try:
        if inv.kind == "c":
            sys.argv = ["-c", *inv.args]
            exec(compile(inv.target, "<string>", "exec"), main.__dict__)
        elif inv.kind == "m":
            sys.argv = ["-m", *inv.args]
            runpy._run_module_as_main(inv.target, alter_argv=True)  # type: ignore[attr-defined]
        else:
            if not os.path.exists(inv.target):  # as CPython says it, with its exit code
                print(
                    f"{sys.executable}: can't open file {os.path.abspath(inv.target)!r}: "
                    "[Errno 2] No such file or directory",
                    file=sys.stderr,
                )
                return 2
            sys.argv = [inv.target, *inv.args]
            if os.path.isfile(inv.target) and not zipfile.is_zipfile(inv.target):
                # as CPython runs a script: in the real __main__ (which atexit handlers and threads
                # still see afterwards), with an absolute __file__
                path = os.path.abspath(inv.target)
                vars(main).update(__file__=path, __cached__=None, __spec__=None)  # (no __cached__ on ModuleType's stub)
                with open(path, "rb") as f:
                    source = f.read()
                exec(compile(source, path, "exec"), main.__dict__)
            else:  # a directory or zip with __main__.py
                runpy.run_path(inv.target, run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt as e:
        e = e.with_traceback(_user_frames(e.__traceback__))
        traceback.print_exception(type(e), e, e.__traceback__)
        code = -signal.SIGINT
    except BaseException as e:
        e = e.with_traceback(_user_frames(e.__traceback__))
        sys.excepthook(type(e), e, e.__traceback__)
        code = 1
        from .. import debugger

        # (a `q` at a breakpoint ends in BdbQuit: the user let it go, it is not paused again)
        if e.__traceback__ is not None and not isinstance(e, bdb.BdbQuit) and debugger.post_mortem_wanted():
            try:
                debugger.post_mortem(e.__traceback__)
            except BaseException as pm:  # noqa: BLE001 - the program's own error and exit code stand
                print(f"monarch-torchx: post-mortem pause failed ({type(pm).__name__}: {pm})", file=sys.stderr)
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # join non-daemon threads, as at exit
    except Exception:
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):  # as Py_FinalizeEx: what was written goes out first
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - judged below, after finalization
            pass
    try:
        finalize_program_modules(inherited)
    except BaseException as e:  # noqa: BLE001 - the program ended already: its exit code stands
        print(f"finalizing the program's modules failed: {type(e).__name__}: {e}", file=sys.__stderr__)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = code or 120
    return code


def _inherited_finalizers_stay() -> None:
    """``weakref.finalize`` objects made before the fork (by the preloads: torch makes one per op
    library it registers) do not run at this program's exit; those the program makes still do.
    They clean up the fork server's objects, as its modules are the fork server's, not the
    program's to finalize (``finalize_program_modules``); run in every child they cost a program
    that merely imports torch 25 ms of CPU at its exit. Other ``atexit`` handlers are kept:
    ``logging`` and ``multiprocessing`` flush and reap what the program made through them."""
    registry = getattr(weakref.finalize, "_registry", None)  # (CPython's, since 3.4)
    for info in list(registry.values()) if isinstance(registry, dict) else []:
        if hasattr(info, "atexit"):
            info.atexit = False


def finalize_program_modules(inherited: Iterable[str]) -> None:
    """What ``Py_FinalizeEx`` does before the process ends, for the program's own code: the
    globals of ``__main__`` and of the modules it imported from outside the standard library and
    site-packages are dropped, newest module first, so an object held in a module global has its
    ``__del__`` run, as under a real interpreter (``os._exit`` skips it). What only a reference
    cycle holds is not collected: a full collection costs tens of ms in a process that imported
    torch, at every exit. The fork server's modules (its shared, warm state) and libraries are
    left alone: clearing them would make their own finalizers fail loudly at every exit. Daemon
    threads still running meet a torn-down module as they would at a real exit, silently."""
    keep = set(inherited)
    threading.excepthook = lambda _args: None
    for name in reversed(list(sys.modules)):
        module = sys.modules.get(name)
        if name != "__main__" and (name in keep or not _is_program_code(module)):
            continue
        names = getattr(module, "__dict__", None)
        if not isinstance(names, dict):
            continue
        for key in [k for k in names if not (k.startswith("__") and k.endswith("__"))]:
            names[key] = None  # a __del__ that raises is reported and ignored, as by CPython


def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths.get(k, "") for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs.update(p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages"))
    return tuple(os.path.realpath(d) + os.sep for d in dirs if d)


LIBRARY_DIRS = _library_dirs()  # once, in the fork server: every fork inherits it


def _is_program_code(module: object) -> bool:
    path = getattr(module, "__file__", None)
    if not isinstance(path, str) or not path.endswith(".py"):  # built-in, frozen, namespace, extension
        return False
    return not os.path.realpath(path).startswith(LIBRARY_DIRS) and not getattr(module, "__name__", "").startswith(
        "monarch_torchx"
    )


def detach_child(stdout_fd: int, stderr_fd: int, close: Iterable[int], stdin_fd: int | None = None) -> None:
    """In a fresh fork: its own session, killed with its parent, stdin from /dev/null (or
    ``stdin_fd``), the given stdout and stderr, no other inherited descriptor in ``close``,
    default signal handlers."""
    os.setsid()
    set_pdeathsig(signal.SIGKILL)
    if INTERPRETER_NAME and _own_name() != INTERPRETER_NAME:  # forked from a renamed server
        set_process_name(INTERPRETER_NAME)
    devnull = os.open(os.devnull, os.O_RDONLY) if stdin_fd is None else stdin_fd
    os.dup2(devnull, 0)
    os.dup2(stdout_fd, 1)
    os.dup2(stderr_fd, 2)
    for fd in {devnull, stdout_fd, stderr_fd, *close}:
        if fd > 2:
            try:
                os.close(fd)
            except OSError:
                pass
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)


def exit_as_python(inv: PyInvocation, env: dict[str, str], base_path: list[str]) -> NoReturn:
    """Runs the invocation in this detached fork and exits the way the interpreter would have."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    code = run_python(inv, env, base_path)
    _flush_c_stdio()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


def _child(req: Start, fds: list[int], errw: int, keep_closed: list[int], base_path: list[str]) -> None:
    try:
        detach_child(fds[0], fds[1], keep_closed, fds[2] if len(fds) > 2 else None)
        if req.cwd:
            os.chdir(req.cwd)
        if req.mode == StartMode.EXEC:  # (only where this Python cannot posix_spawn: see spawn_exec)
            for sig in (signal.SIGPIPE, signal.SIGINT, signal.SIGXFSZ):  # Python's own dispositions
                signal.signal(sig, signal.SIG_DFL)
            os.execve(req.exe, req.argv, req.env)
        os.close(errw)
        errw = -1
        inv = parse_python_argv(req.argv[1:])
        assert inv is not None
        exit_as_python(inv, req.env, base_path)
    except BaseException as e:
        if errw >= 0:
            os.write(errw, start_error(e).encode())
        os._exit(127)


def _close_all(fds: list[int]) -> None:
    """Closes the fds and empties the list, so that nothing closes them twice."""
    while fds:
        try:
            os.close(fds.pop())
        except OSError:
            pass


def start_error(e: BaseException) -> str:
    """Why a program did not start, as the OS says it ("No such file or directory: '/bin/x'")."""
    msg = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    target = getattr(e, "filename", None)
    return f"{msg}: {target!r}" if target else f"{type(e).__name__}: {msg}"


# ---------------------------------------------------------------- the server loop


class ForkServer:
    def __init__(self, ctl: socket.socket, evt: socket.socket, base_path: list[str]):
        self.ctl = ctl
        self.evt = evt
        self.base_path = base_path
        self.children: dict[int, float] = {}
        self.servers: set = set()  # fork servers forked from this one: their exits are no program's
        for sock in (ctl, evt):  # inherited from the agent, and no program's business
            os.set_inheritable(sock.fileno(), False)
        # the server's own cwd, gone back to after an exec start that moved it (O_PATH: a cwd it
        # may search but not read will do)
        self.home = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self.posix_spawn = True  # False once this Python turned out to lack posix_spawn's setsid
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)

    def send(self, msg: Ready | Started | StartFailed | Exited) -> None:
        from monarch_torchx.net.blocking import send_msg

        send_msg(self.evt, msg)

    def spawn(self, req: Start | StartServer, fds: list[int]) -> None:
        token = req.token
        if isinstance(req, StartServer):
            self.send(self.spawn_server(token, req, fds))
            return
        if req.mode == StartMode.EXEC:
            prog = req.argv[0]
            exe = prog if "/" in prog else shutil.which(prog, path=req.env.get("PATH", os.defpath))
            if exe is None:
                _close_all(fds)
                self.send(StartFailed(token, f"No such file or directory: {prog!r} (not found on PATH)"))
                return
            req.exe = exe
            answer = self.spawn_exec(token, req, fds) if self.posix_spawn else None
            if answer is not None:
                self.send(answer)
                return
        errr, errw = os.pipe2(os.O_CLOEXEC)
        for s in (sys.stdout, sys.stderr):
            s.flush()
        pid = os.fork()
        if pid == 0:
            os.close(errr)
            _child(
                req,
                fds,
                errw,
                [self.ctl.fileno(), self.evt.fileno(), self.wake_r, self.wake_w, self.home],
                self.base_path,
            )
        os.close(errw)
        _close_all(fds)
        err = b""
        while True:
            chunk = os.read(errr, 4096)
            if not chunk:
                break
            err += chunk
        os.close(errr)
        if err:
            os.waitpid(pid, 0)
            self.send(StartFailed(token, err.decode(errors="replace")))
        else:
            self.children[pid] = time.time()
            self.send(Started(token, pid))

    def spawn_exec(self, token: int, req: Start, fds: list[int]) -> Started | StartFailed | None:
        """Starts a program that is not this interpreter; returns the answer for the agent, or
        None (the fds untouched) where this Python's ``posix_spawn`` cannot start a session,
        which then forks as before. Unlike a fork, ``posix_spawn`` cannot set a parent-death
        signal: the agent ends these children's process groups itself when this server dies
        (``launcher._Server``). The server is single-threaded, so its own cwd can be the child's
        for the length of the call. SIGTERM (``kill_all``) waits until the child is on record."""
        for fd in fds:  # received without close-on-exec: the child keeps only its 1 and 2
            os.set_inheritable(fd, False)
        actions = [
            (os.POSIX_SPAWN_DUP2, fds[2], 0) if len(fds) > 2 else (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_DUP2, fds[0], 1),
            (os.POSIX_SPAWN_DUP2, fds[1], 2),
        ]
        cwd = req.cwd
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            if cwd:
                os.chdir(cwd)
            pid = os.posix_spawn(
                req.exe,
                req.argv,
                req.env,
                file_actions=actions,
                setsid=True,
                setsigmask=(),
                setsigdef=EXEC_DEFAULT_SIGNALS,
            )
        except NotImplementedError:  # built against a C library without POSIX_SPAWN_SETSID
            self.posix_spawn = False
            return None
        except OSError as e:
            _close_all(fds)
            return StartFailed(token, start_error(e))
        else:
            self.children[pid] = time.time()
            _close_all(fds)
            return Started(token, pid)
        finally:
            if cwd:
                self.go_home()
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})

    def spawn_server(self, token: int, req: StartServer, fds: list[int]) -> Started | StartFailed:
        """Forks a fork server of its own (``fds``: its ctl and evt) that imports ``preloads``.
        It stays in this server's session, and ends when this one does (its parent-death signal)."""
        if len(fds) != 2:
            _close_all(fds)
            return StartFailed(token, f"a server start carries its ctl and evt sockets, not {len(fds)} fds")
        for s in (sys.stdout, sys.stderr):
            s.flush()
        # a SIGTERM (kill_all) waits until the new server is on record to be ended with the rest
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            pid = os.fork()
            if pid == 0:
                self._become_server(req, fds)
            self.servers.add(pid)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            _close_all(fds)
        return Started(token, pid)

    def _become_server(self, req: StartServer, fds: list[int]) -> NoReturn:
        """In the forked child: drop this server's descriptors and handlers, then serve as a new one."""
        try:
            # this server's handler would end this server's children: not the new one's business
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            signal.set_wakeup_fd(-1)
            for fd in (self.ctl.detach(), self.evt.detach(), self.wake_r, self.wake_w, self.home):
                os.close(fd)  # (detached: no socket object closes that number again once reused)
            set_process_name(f"fs-{req.name}")
            main([str(fds[0]), str(fds[1]), *req.preloads, "--", *req.warm_imports])
        except BaseException:  # noqa: BLE001 - its agent hears of it when the evt socket closes
            try:
                traceback.print_exc()
            except BaseException:  # noqa: BLE001 - (stderr gone): exit all the same
                pass
        finally:
            os._exit(1)

    def go_home(self) -> None:
        try:
            os.fchdir(self.home)
        except OSError:  # every later start would run in a role's directory: end, and the agent says so
            self.kill_all()

    def reap(self) -> None:
        while self.children or self.servers:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.servers:
                self.servers.discard(pid)
                continue
            self.children.pop(pid, None)
            self.send(Exited(pid, os.waitstatus_to_exitcode(status)))

    def kill_all(self, *_: object) -> None:
        for pid in list(self.children):
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        for pid in self.servers:  # each ends what it started (as at its parent-death signal)
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass
        os._exit(0)

    def serve(self) -> None:
        from monarch_torchx.net import FrameReader, WireError

        requests = FrameReader(self.ctl, exact=True)

        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        while True:
            watched: list[socket.socket | int] = [self.ctl, self.wake_r]
            ready, _, _ = select.select(watched, [], [])
            if self.wake_r in ready:
                try:
                    os.read(self.wake_r, 4096)
                except BlockingIOError:
                    pass
                self.reap()
            if self.ctl in ready:
                try:
                    _, fds, _, _ = socket.recv_fds(self.ctl, 1, 4)
                    if not fds:
                        self.kill_all()  # agent closed the channel: take everything down with us
                    req = requests.recv()
                except (OSError, WireError, EOFError):
                    self.kill_all()
                fds = list(fds)  # (emptied by whoever closes them)
                if not isinstance(req, (Start, StartServer)):
                    _close_all(fds)
                    self.kill_all()  # not our launcher's: out of step, end as if it closed the channel
                try:
                    self.spawn(req, fds)
                except Exception as e:  # fork/pipe failing (ENOMEM, EAGAIN, EMFILE) fails this start only
                    _close_all(fds)
                    self.send(StartFailed(req.token, f"could not start: {type(e).__name__}: {e}"))


def _warm_submitit() -> None:
    """Imports submitit's task entry point and reads its plugins' entry points once (a scan of
    every installed distribution), so each task forked from here skips both."""
    try:
        __import__("submitit.core.submission")
        from submitit.core import plugins

        plugins.get_job_environments()
    except Exception as e:  # noqa: BLE001 - a task started cold is slower, not wrong
        print(f"fork server: warming submitit failed ({type(e).__name__}: {e})", file=sys.stderr)


def main(argv: list[str]) -> None:
    ctl = socket.socket(fileno=int(argv[0]))
    evt = socket.socket(fileno=int(argv[1]))
    rest = argv[2:]
    cut = rest.index("--") if "--" in rest else len(rest)
    preloads = [m for m in rest[:cut] if m]
    warm_imports = [m for m in rest[cut + 1 :] if m]  # the agent's modules' (seam.AgentModule.warm_imports)
    set_pdeathsig(signal.SIGTERM)
    # PYTHONPATH is recomputed per child, and so is a child's first entry (its script's directory,
    # or its cwd for -m), which this server's own sys.path never had (interpreter.module_argv)
    extra = {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    base_path = [p for p in sys.path if p not in extra]
    server = ForkServer(ctl, evt, base_path)
    signal.signal(signal.SIGTERM, server.kill_all)
    failed = {}
    t0 = time.time()
    for mod in preloads:
        try:
            __import__(mod)
        except Exception as e:  # a missing preload costs warmth, not correctness
            failed[mod] = f"{type(e).__name__}: {e}"
    if preloads:  # a warm server also starts the modules' processes (actor procs): imported once, here
        for spec in warm_imports:
            mod, _, fn = spec.partition(":")
            try:
                __import__(mod)
                if fn:
                    getattr(sys.modules[mod], fn)()
            except Exception as e:  # noqa: BLE001 - a module's warm import costs warmth, not correctness
                print(f"fork server: warm import {spec} failed ({type(e).__name__}: {e})", file=sys.stderr)
    if "submitit" in sys.modules:  # a submitit task starts here: what its `_submit` would load first
        _warm_submitit()
    if "torch" in sys.modules:  # a torchrun role's node process starts here: its part of torch too
        from ..torchrun import TORCH_MODULES

        for mod in TORCH_MODULES:
            try:
                __import__(mod)
            except Exception:
                pass
    # what the server imported stays out of every child's collections: a child's full collection
    # would otherwise write to (and so copy) every page of the server's objects. No collection
    # first: the holes it would free are where a child's new objects would go, copying those pages.
    gc.freeze()
    server.send(Ready([m for m in preloads if m not in failed], failed, round(time.time() - t0, 3)))
    server.serve()


if __name__ == "__main__":
    main(sys.argv[1:])
