"""Agent side of the fork servers: start them, ask them to spawn, hear about exits.

Two fork servers run per agent: a *plain* one (no preloads, ready in milliseconds) and a *warm*
one that imports the pool's preloads (default ``torch``). Python entrypoints go to the warm one
once it is ready; everything else, and Python while it is still importing, goes to the plain one.
The warm server also holds the actor runtime. A pool without preloads gets a third, *actors*
server at its first actor proc, forked from the plain one (no interpreter start-up of its own,
and the plain one's pages shared until written). It imports the runtime once per host, not once
per proc, serves every later ``spawn_procs`` until it has been idle for ACTORS_IDLE_S, and then
ends (the plain one stays a clean interpreter for roles); one that dies is started again at the
next actor proc.
"""

from __future__ import annotations

import array
import asyncio
import itertools
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
from typing import Callable, Iterable

from .. import net
from ..interpreter import module_argv
from ..net import aio
from ..torchrun import NODE_MODULE, THREAD_ENV
from .forkserver import INIT_ENV, parse_python_argv
from .forkserver_messages import Exited, Ready, Start, Started, StartFailed, StartMode, StartServer

log = logging.getLogger(__name__)

ExitCallback = Callable[[int, int], None]
DeathCallback = Callable[[str, list[int], bool], None]  # reason, pids it took down, fatal to the agent

ACTOR_MODULE = "monarch_torchx.actor"  # an actor proc's entrypoint: python -m ACTOR_MODULE
ACTOR_RUNTIME = "monarch_torchx.actor.proc"
ACTORS_START_TIMEOUT_S = 60.0
# the actors server ends this long after its last proc did (its memory goes back), and the next
# spawn_procs starts a new one: warm while a user iterates, not for the pool's whole life
ACTORS_IDLE_S = float(os.environ.get("MONARCH_TORCHX_ACTORS_IDLE_S", "300"))


def last_line(text: str, limit: int = 200) -> str:
    """An exception's text as one bounded line: ``Type: message`` keeps the type and the
    message's last non-empty line (where a long import error says what went wrong)."""
    kind, sep, message = text.partition(": ")
    lines = [ln.strip() for ln in (message if sep else text).splitlines() if ln.strip()]
    line = lines[-1] if lines else ""
    line = f"{kind}: {line}" if sep else line
    return line if len(line) <= limit else line[: limit - 3] + "..."


class SpawnError(OSError):
    """The program could not be started (not found, not executable, bad cwd)."""


def end_process_groups(pids: Iterable[int]) -> None:
    """Kills what a dead fork server started. Its forked children die with it (their parent-death
    signal), but the programs it exec'd with ``posix_spawn`` have none; each leads its own group."""
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:  # gone already
            pass


class _Server:
    """One fork server: started as a process of its own, or forked from ``parent`` (another fork
    server, so that it skips an interpreter's start-up)."""

    def __init__(
        self,
        name: str,
        preloads: list[str],
        on_exit: ExitCallback,
        on_death: DeathCallback,
        parent: _Server | None = None,
        warm_imports: list[str] | None = None,
    ):
        self.name = name
        self.parent = parent
        self.warm_imports = warm_imports if warm_imports is not None else []  # (the launcher's list, shared)
        self.pid: int | None = None
        self._pidfd = -1  # a forked server's: it names that process even once its parent reaped it
        self._server_tokens: set = set()  # requests of this one that start servers, not programs
        self.preloads = preloads
        self._on_exit = on_exit
        self._on_death = on_death
        self._pending: dict[int, asyncio.Future] = {}
        self._tokens = itertools.count(1)
        self.ready = asyncio.Event()
        self.dead = asyncio.Event()
        self.closing = False
        self.info: Ready | None = None
        self.death_reason = ""  # why it died, once it has (the warm one's is shown in `pool status`)
        self.proc: subprocess.Popen | None = None
        self.pids: set = set()
        self.spawned = 0  # processes it was asked to start, ever

    async def start(self) -> None:
        ctl_parent, ctl_child = socket.socketpair()
        evt_parent, evt_child = socket.socketpair()
        try:
            if self.parent is not None:
                self.pid = await self.parent.start_server(
                    self.name, self.preloads, [ctl_child.fileno(), evt_child.fileno()], self.warm_imports
                )
                try:
                    self._pidfd = os.pidfd_open(self.pid)
                except OSError:  # gone already (its evt socket tells), or a kernel without pidfds
                    pass
            else:
                self.proc = subprocess.Popen(
                    module_argv(
                        "monarch_torchx.agent.forkserver",
                        str(ctl_child.fileno()),
                        str(evt_child.fileno()),
                        *self.preloads,
                        *(["--", *self.warm_imports] if self.warm_imports else []),
                    ),
                    pass_fds=(ctl_child.fileno(), evt_child.fileno()),
                    env=dict(os.environ),
                    stdin=subprocess.DEVNULL,
                )
                self.pid = self.proc.pid
        except BaseException:
            for sock in (ctl_parent, evt_parent):
                sock.close()
            raise
        finally:
            ctl_child.close()
            evt_child.close()
        ctl_parent.setblocking(False)
        self._ctl = ctl_parent
        self._send_lock = asyncio.Lock()
        self._reader, self._writer = await asyncio.open_unix_connection(sock=evt_parent, limit=1 << 20)
        self._task = asyncio.create_task(self._events())

    async def _events(self) -> None:
        frames = net.FrameParser()
        try:
            while True:
                msg = await aio.read_frame(self._reader, frames)
                if isinstance(msg, Exited):
                    self.pids.discard(msg.pid)
                    self._on_exit(msg.pid, msg.code)
                elif isinstance(msg, (Started, StartFailed)):
                    fut = self._pending.pop(msg.token, None)
                    if fut and not fut.done():
                        if isinstance(msg, StartFailed):
                            fut.set_exception(SpawnError(msg.error))
                        else:
                            if msg.token not in self._server_tokens:  # (a server is no program to end)
                                self.pids.add(msg.pid)
                            fut.set_result(msg.pid)
                    self._server_tokens.discard(msg.token)
                elif isinstance(msg, Ready):
                    self.info = msg
                    if msg.failed:
                        log.warning("fork server %s could not preload: %s", self.name, msg.failed)
                    self.ready.set()
                else:
                    log.error("fork server %s sent %r: not one of its messages", self.name, type(msg).__name__)
        except (asyncio.IncompleteReadError, ConnectionError, net.WireError):
            pass
        reason = f"fork server '{self.name}' exited unexpectedly"
        if self.proc is not None:
            try:
                code = self.proc.wait(timeout=1)
                reason += f" ({'signal ' + str(-code) if code < 0 else 'exit code ' + str(code)})"
            except subprocess.TimeoutExpired:
                pass
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(SpawnError(reason))
        self.death_reason = reason
        self.dead.set()
        if not self.closing:
            end_process_groups(self.pids)
            self._on_death(reason, sorted(self.pids), self.name == "plain")

    async def spawn(
        self, mode: StartMode, argv: list[str], env: dict[str, str], cwd: str | None, fds: list[int]
    ) -> int:
        return await self._request(lambda token: Start(token, mode, argv, env, cwd), fds)

    async def start_server(self, name: str, preloads: list[str], fds: list[int], warm_imports: list[str]) -> int:
        """Forks a fork server from this one (``fds``: its ctl and evt); returns its pid. Its exit
        is not reported as a program's: its own evt socket closing tells."""
        return await self._request(lambda token: StartServer(token, name, preloads, warm_imports), fds, server=True)

    async def _request(self, make: Callable[[int], Start | StartServer], fds: list[int], server: bool = False) -> int:
        """Sends one start request (a program, or another fork server), made with its token; returns the pid."""
        if self.dead.is_set():
            raise SpawnError(f"fork server '{self.name}' is not running")
        token = next(self._tokens)
        if server:
            self._server_tokens.add(token)
        else:
            self.spawned += 1
        fut = asyncio.get_running_loop().create_future()
        self._pending[token] = fut
        frame = b"".join(bytes(p) for p in net.encode(make(token)))
        await self._send(b"F" + frame, fds)  # the fds ride on the marker byte the fork server reads first
        return await fut

    async def _send(self, payload: bytes, fds: list[int]) -> None:
        """Never blocks the agent's loop on a busy fork server; one request at a time on the socket."""
        loop = asyncio.get_running_loop()
        async with self._send_lock:
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
            while True:
                try:
                    sent = self._ctl.sendmsg([payload], ancillary)
                    break
                except BlockingIOError:
                    writable: asyncio.Future[None] = loop.create_future()

                    def wake(w: asyncio.Future[None] = writable) -> None:
                        if not w.done():
                            w.set_result(None)

                    loop.add_writer(self._ctl.fileno(), wake)
                    try:
                        await writable
                    finally:
                        loop.remove_writer(self._ctl.fileno())
            if sent < len(payload):
                await loop.sock_sendall(self._ctl, payload[sent:])

    def close(self) -> None:
        self.closing = True
        try:
            self._ctl.close()  # the fork server kills its children and exits when this closes
        except OSError:
            pass
        if self.proc and self.proc.poll() is None:
            try:
                self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                end_process_groups(self.pids)  # it was killed before it could end what it exec'd
        elif self._pidfd >= 0:
            # a forked server: its parent reaps it, so only its pidfd names it safely (its pid may
            # be another process's by now); readable once it has exited
            try:  # (dead: its evt socket closed as it exited, and what it started was ended then)
                if not self.dead.is_set() and not select.select([self._pidfd], [], [], 2.0)[0]:
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
                    end_process_groups(self.pids)  # it was killed before it could end what it started
            except OSError:  # gone
                pass
            finally:
                os.close(self._pidfd)
                self._pidfd = -1


class Launcher:
    """Starts processes for the agent; one interface whatever the entrypoint."""

    def __init__(self, preloads: list[str], on_exit: ExitCallback, on_death: DeathCallback):
        # what the agent's modules import in every warm server after the preloads (``add_warm_imports``)
        self._warm_imports: list[str] = []
        self._plain = _Server("plain", [], on_exit, on_death)
        self._warm = _Server("warm", preloads, on_exit, on_death, warm_imports=self._warm_imports) if preloads else None
        self._on_exit, self._on_death = on_exit, on_death
        self._actors: asyncio.Future[_Server | None] | None = None
        self._init_env = {k: os.environ.get(k) for k in INIT_ENV}
        self._preloads = [m.split(".")[0] for m in preloads]
        self._python_dir = os.path.dirname(os.path.abspath(sys.executable))
        self._python_real = os.path.realpath(sys.executable)

    def add_warm_imports(self, specs: list[str]) -> None:
        """Modules a warm fork server imports after its preloads ("pkg.mod" or "pkg.mod:function",
        called once imported): an agent module's (``seam.AgentModule.warm_imports``), so the
        processes it starts there begin warm. Before ``start``."""
        self._warm_imports.extend(s for s in specs if s not in self._warm_imports)

    async def start(self) -> None:
        """Returns once the plain fork server serves; the warm one keeps importing meanwhile."""
        await self._plain.start()
        if self._warm:
            await self._warm.start()
        ready = asyncio.ensure_future(self._plain.ready.wait())
        dead = asyncio.ensure_future(self._plain.dead.wait())
        await asyncio.wait([ready, dead], return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        dead.cancel()
        if not self._plain.ready.is_set():
            raise SpawnError("the fork server failed to start (see the agent log)")

    @property
    def warm_info(self) -> dict:
        """The warm server's state for ``info``. ``failed`` (preload -> the exception's last line)
        and ``error`` (one line, "" when all is well) make a preload that failed visible to the
        client (`pool create` fails on it, `pool status` warns), not only in this agent's log."""
        if self._warm is None:
            return {"preloaded": [], "ready": True, "state": "none", "failed": {}, "error": ""}
        ready = self._warm.ready.is_set() and not self._warm.dead.is_set()
        state = "ready" if ready else "dead" if self._warm.dead.is_set() else "importing"
        info = self._warm.info
        failed = {mod: last_line(err) for mod, err in (info.failed if info else {}).items()}
        errors = [f"preload of {mod!r} failed: {err}" for mod, err in failed.items()]
        if state == "dead":
            errors.append(self._warm.death_reason or "the warm fork server died")
        return {
            "preloads": self._warm.preloads,
            "preloaded": info.preloaded if info else [],
            "seconds": info.seconds if info else None,
            "ready": ready,
            "state": state,
            "failed": failed,
            "error": "; ".join(errors),
        }

    def is_our_python(self, argv: list[str], env: dict[str, str]) -> bool:
        """True when the entrypoint is this interpreter and the fork can honour its flags and env."""
        if not argv or parse_python_argv(argv[1:]) is None:
            return False
        prog = argv[0]
        found = prog if "/" in prog else shutil.which(prog, path=env.get("PATH", os.defpath))
        if not found or os.path.dirname(os.path.abspath(found)) != self._python_dir:
            return False
        if os.path.realpath(found) != self._python_real:
            return False
        # a torchrun node applies the thread counts to its forked workers itself (torch.set_num_threads)
        exempt = THREAD_ENV if list(argv[1:3]) == ["-m", NODE_MODULE] else ()
        return all(env.get(k) == v for k, v in self._init_env.items() if k not in exempt)

    def _shadows_preload(self, env: dict[str, str]) -> bool:
        """True when the role's PYTHONPATH has its own copy of a preloaded module (a dev build of torch):
        the warm server's already-imported one would win, so the role starts from the plain server."""
        for d in (p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p):
            for name in self._preloads:
                if os.path.exists(os.path.join(d, name)) or os.path.exists(os.path.join(d, name + ".py")):
                    return True
        return False

    async def spawn(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: str | None,
        stdout_fd: int,
        stderr_fd: int,
        stdin_fd: int | None = None,
    ) -> int:
        """Returns the pid (also the process group id). Raises SpawnError with the OS reason.
        ``stdin_fd``: its stdin (else /dev/null)."""
        mode = StartMode.PYTHON if self.is_our_python(argv, env) else StartMode.EXEC
        server = self._plain
        if (
            mode == StartMode.PYTHON
            and self._warm
            and self._warm.ready.is_set()
            and not self._warm.dead.is_set()
            and not self._shadows_preload(env)
        ):
            server = self._warm
        elif mode == StartMode.PYTHON and self._warm is None and list(argv[1:3]) == ["-m", ACTOR_MODULE]:
            server = await self._actor_server() or self._plain
        try:
            fds = [stdout_fd, stderr_fd] + ([] if stdin_fd is None else [stdin_fd])
            return await server.spawn(mode, list(argv), env, cwd, fds)
        except SpawnError:
            if server.name == "actors":  # its idle clock starts at a failed start too
                self._arm_retire(server)
            raise

    async def _actor_server(self) -> _Server | None:
        """The actors server, started by the first actor proc that asks (the others wait for the
        same start). One that served and has died since (killed, out of memory) is replaced by
        the next proc that asks. None when it could not start: procs then start from the plain one."""
        started = self._started_actors()
        if started is not None and started.dead.is_set():
            log.warning("fork server actors has died; the next actor proc starts a new one")
            self._actors = None
            started.close()  # its sockets
        if self._actors is None:
            self._actors = asyncio.ensure_future(self._start_actors())
        server = await asyncio.shield(self._actors)
        return server if server is not None and not server.dead.is_set() else None

    async def _start_actors(self) -> _Server | None:
        server = _Server(
            "actors",
            [ACTOR_RUNTIME],
            lambda pid, code: self._actor_exited(server, pid, code),
            self._on_death,
            parent=self._plain,
            warm_imports=self._warm_imports,
        )
        try:
            await server.start()
        except OSError as e:
            log.warning("fork server actors could not start: %s; actor procs start from the plain one", e)
            return None
        ready = asyncio.ensure_future(server.ready.wait())
        dead = asyncio.ensure_future(server.dead.wait())
        try:
            await asyncio.wait([ready, dead], timeout=ACTORS_START_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the agent is stopping
            server.close()
            raise
        finally:
            ready.cancel()
            dead.cancel()
        if not server.ready.is_set() or server.dead.is_set():
            log.warning(
                "fork server actors was not ready within %.0f s; actor procs start from the plain one",
                ACTORS_START_TIMEOUT_S,
            )
            server.close()
            return None
        return server

    def _started_actors(self) -> _Server | None:
        """The actors server once its start has finished well; None before, or after a failed one."""
        f = self._actors
        if f is None or not f.done() or f.cancelled() or f.exception() is not None:
            return None
        return f.result()

    def _actor_exited(self, server: _Server, pid: int, code: int) -> None:
        self._on_exit(pid, code)
        self._arm_retire(server)

    def _arm_retire(self, server: _Server) -> None:
        if not server.pids:
            asyncio.get_running_loop().call_later(ACTORS_IDLE_S, self._retire_if_idle, server, server.spawned)

    def _retire_if_idle(self, server: _Server, spawned: int) -> None:
        """Ends the actors server if it started no proc since it became idle and none runs."""
        if self._started_actors() is not server or server.pids or server.spawned != spawned or server._pending:
            return
        log.info("fork server actors idle for %.0f s: ending it (the next actor proc starts a new one)", ACTORS_IDLE_S)
        self._actors = None
        asyncio.get_running_loop().run_in_executor(None, server.close)

    def close(self) -> None:
        if self._actors is not None and not self._actors.done():
            self._actors.cancel()
        for s in (self._warm, self._started_actors(), self._plain):
            if s:
                s.close()
