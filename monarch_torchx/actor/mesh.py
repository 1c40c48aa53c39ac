"""Host, proc and actor meshes, and the adverbs that call endpoints on them.

``attach(pool)`` gives a HostMesh of a warm pool (any scheduler); ``spawn_procs`` asks each
host's agent to start procs from its warm fork server; ``spawn`` creates an actor in every
proc; ``mesh.endpoint.call(...)`` sends straight to the procs. A mesh is a view (a Shape) over
a list of procs, so slicing never talks to anything, and a mesh pickles as a reference that
works in any process of the same pool (actors can hold and call other meshes).
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import random
import sys
import threading
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Generic, Iterator, Sequence, TypeVar

from .. import net
from ..agent_client import AgentClient
from ..errors import MonarchError
from ..net.fanout import Target, ask_tree, tree_min_hosts
from ..registry import HostAddr, Registry
from . import messages, placement, session
from .actor import Actor, context, current_context, endpoint, endpoints_of
from .errors import MeshFailure, ProcStopped, SupervisionError, point_text
from .future import Future
from .host import app_id
from .hub import Hub, ProcAddr, encode, pack
from .shape import Extent, Point, Shape, ValueMesh

log = logging.getLogger("monarch_torchx.actor")

T = TypeVar("T")
TREE_MIN = int(os.environ.get("MONARCH_TORCHX_CAST_TREE_MIN", "32"))  # meshes this large multicast via a tree
FANOUT = max(2, int(os.environ.get("MONARCH_TORCHX_CAST_FANOUT", "8")))
LOCAL_POOL = "local"
LOCAL_POOL_ENV = "MONARCH_TORCHX_LOCAL_POOL"  # the pool this_host() uses in a controller (set: silently)
EXIT_WAIT_S = 5.0  # ProcMesh.stop() waits this long for the agents to see its procs exit


@dataclass(frozen=True)
class ProcRef:
    """Where one proc listens, and how to ask its host why it is gone."""

    addr: ProcAddr
    mesh_id: str
    rank: int
    host_index: int
    hostname: str
    agent: ProcAddr | None  # None: the controller's own proc (no agent started it)


class _MeshTrait:
    """Named-dim views shared by every mesh: slicing never contacts anything."""

    _shape: Shape

    def _with_shape(self: Any, shape: Shape) -> Any:
        raise NotImplementedError

    def slice(self: Any, **dims: Any) -> Any:
        return self._with_shape(self._shape.slice(**dims))

    def flatten(self: Any, name: str) -> Any:
        return self._with_shape(self._shape.flatten(name))

    def rename(self: Any, **names: str) -> Any:
        return self._with_shape(self._shape.rename(**names))

    @property
    def extent(self) -> Extent:
        return self._shape.extent

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self._shape.extent)

    def size(self, dim: str | None = None) -> int:
        if dim is None:
            return len(self._shape)
        return self._shape.extent[self._shape.labels[self._shape._dim(dim)]]

    def __len__(self) -> int:
        return len(self._shape)


# ---------------------------------------------------------------- hosts


PYTHON_ENV = "MONARCH_TORCHX_PROC_PYTHON"  # a proc's with_python_executable(), for this_host() in it


ACTOR_PROC_ARGS = ("-m", "monarch_torchx.actor")  # what starts an actor proc (python -m ...)


@dataclass
class BootstrapCommand:
    """How a proc is started, as Monarch's ``BootstrapCommand``: a Python ``program``, its ``args``
    (here always the actor proc's, ``-m monarch_torchx.actor``) and ``env``, added to the proc's
    environment. This interpreter starts warm procs (forked from the agents' warm fork servers);
    another ``program`` is exec'd, as ``HostMesh.with_python_executable`` does."""

    program: str
    arg0: str | None = None
    args: list[str] = field(default_factory=lambda: list(ACTOR_PROC_ARGS))
    env: dict[str, str] = field(default_factory=dict)

    def with_env(self, env: dict[str, str]) -> BootstrapCommand:
        """A copy with ``env`` added over this one's."""
        return replace(self, env={**self.env, **env}, args=list(self.args))

    def check(self) -> BootstrapCommand:
        if not isinstance(self.program, str) or not self.program:
            raise ValueError(f"BootstrapCommand program must be a Python executable's path, not {self.program!r}")
        if list(self.args) != list(ACTOR_PROC_ARGS) or self.arg0 not in (None, self.program):
            raise ValueError(
                f"BootstrapCommand args {self.args!r}: procs here run {' '.join(ACTOR_PROC_ARGS)}; "
                "change the program (a wrapper script, another venv's python) or env, not the arguments"
            )
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()):
            raise ValueError("BootstrapCommand env must map strings to strings")
        return self


def default_bootstrap_cmd() -> BootstrapCommand:
    """As Monarch's: the command that starts a proc by default (this interpreter, the actor proc's
    module, no extra environment); ``.with_env({...})`` adds to a proc's environment."""
    return BootstrapCommand(sys.executable, None, list(ACTOR_PROC_ARGS), {})


class HostMesh(_MeshTrait):
    """The hosts of a warm pool. Spawning procs on it is cheap: the hosts stay up."""

    def __init__(
        self, pool: str, hosts: Sequence[HostAddr], shape: Shape | None = None, adopting: Future[Any] | None = None
    ):
        self.pool = pool
        self._known = list(hosts)
        # attach_to_workers: the workers' adoption, still under way (its HostMesh, or why it failed)
        self._adopting = adopting
        self._shape = shape or Shape.dense(("hosts",), (len(self._known),))
        self._shut_down = False
        self._received = False  # unpickled: a reference, which cannot end the hosts
        self._spawned: list[ProcMesh] = []  # what stop() ends
        self._python: str | None = None  # with_python_executable(): procs exec it, not a warm fork
        self._env: dict[str, str] = {}  # added to every proc's environment (ProcessJob(env=...))

    @classmethod
    def pending(cls, pool: str, count: int, adopting: Future[Any]) -> HostMesh:
        """The mesh of ``count`` hosts that ``adopting`` brings up (attach_to_workers returns it at once)."""
        return cls(pool, [], Shape.dense(("hosts",), (count,)), adopting)

    @property
    def _hosts(self) -> list[HostAddr]:
        """The hosts; a mesh still being attached waits for them here, and raises why they failed."""
        if self._adopting is not None:
            self._known = self._adopting.get()._known
            self._adopting = None
        return self._known

    def _with_shape(self, shape: Shape) -> HostMesh:
        mesh = HostMesh(self.pool, self._known, shape, self._adopting)
        mesh._received = self._received  # a slice of a reference is a reference
        mesh._python = self._python
        mesh._env = dict(self._env)
        return mesh

    def _with_env(self, env: dict[str, str]) -> HostMesh:
        mesh = self._with_shape(self._shape)
        mesh._env = {**self._env, **env}
        return mesh

    def with_python_executable(self, python_executable: str) -> HostMesh:
        """As Monarch's: this mesh, whose procs run under ``python_executable`` (a path on the
        hosts, such as a wrapper script or another venv's interpreter), and so do the procs their
        actors spawn with ``this_host()``. Such procs are started by exec, so they are not warm:
        they import what they need themselves."""
        if not isinstance(python_executable, str) or not python_executable:
            raise ValueError(
                f"with_python_executable() needs the path of a Python executable, not {python_executable!r}"
            )
        mesh = self._with_shape(self._shape)
        mesh._python = python_executable
        return mesh

    def __repr__(self) -> str:
        return f"HostMesh(pool={self.pool!r}, {self.extent!r})"

    @property
    def initialized(self) -> Future[bool]:
        """As Monarch's: completes (True) once the hosts are up, or fails with why; a pool's
        agents are up already, and attach_to_workers' are once adopted."""
        if self._adopting is None:
            return Future.resolved(True)
        return Future.gather(None, [self._adopting], lambda _: True)

    @property
    def stream_logs(self) -> bool:
        """As Monarch's: whether procs' output streams to this process by default. Not here:
        ``procs.logging_option(stream_to_client=True)`` asks for it per ProcMesh."""
        return False

    @property
    def is_fake_in_process(self) -> bool:
        """As Monarch's: False, always: every host is a real agent that starts real processes."""
        return False

    def __reduce__(self) -> Any:  # a HostMesh sent to an actor (or pickled) is a reference: it cannot end the hosts
        return _received_host_mesh, (self.pool, self._hosts, self._shape, self._python, self._env)

    def _check_live(self) -> None:
        if self._shut_down:
            raise RuntimeError(f"HostMesh has already been shut down (pool {self.pool!r} was stopped through it)")

    def stop(self) -> Future[None]:
        """Stops the procs spawned through this HostMesh object, and no others, as Monarch's
        ``HostMesh.stop()``; the hosts stay up (the pool warm)."""
        spawned, self._spawned = self._spawned, []
        if not spawned:
            return Future.resolved(None)
        return Future.gather(session.hub_for(self.pool), [pm.stop() for pm in spawned], lambda _v: None)

    def __enter__(self) -> HostMesh:
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._shut_down:
            self.shutdown().get()

    async def __aenter__(self) -> HostMesh:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if not self._shut_down:
            await self.shutdown()

    def shutdown(self) -> Future[None]:
        """Ends the hosts, as Monarch's ``HostMesh.shutdown()``: here, stops the warm pool (its
        agents, procs and allocation). The Future completes once it is stopped; a second
        shutdown, or a spawn_procs after it, raises RuntimeError."""
        from ..pool import stop_pool

        self._check_live()
        if self._received:
            raise RuntimeError(
                f"this HostMesh of pool {self.pool!r} was received (unpickled), not created here: only "
                "the process that holds the original can shut the hosts down"
            )
        self._shut_down = True
        done: Future[None] = Future()
        adopting = self._adopting

        def stop() -> None:
            if adopting is not None and adopting.exception() is not None and Registry().get(self.pool) is None:
                done.set_result(None)  # attach_to_workers failed and left no pool to stop
                return
            try:
                stop_pool(self.pool)
            except Exception as e:  # a pool already gone, or an engine error: reported to the caller
                done.set_exception(e)
            else:
                done.set_result(None)

        threading.Thread(target=stop, name="monarch-torchx-shutdown", daemon=True).start()
        return done

    def spawn_procs(
        self,
        per_host: dict[str, int] | None = None,
        *,
        env: dict[str, str] | None = None,
        name: str = "procs",
        bootstrap: Callable[[], Any] | None = None,
        proc_bind: list[dict[str, str]] | None = None,
        bootstrap_command: BootstrapCommand | Callable[[Point], BootstrapCommand] | None = None,
    ) -> ProcMesh:
        """Starts ``per_host`` procs on every host of this mesh (from the agents' warm fork servers).
        ``bootstrap`` (Monarch's): a function every proc runs before it makes any other actor
        (picklable by value, like an actor's arguments); spawn_procs returns at once, and if it
        raises, ``procs.initialized`` does and the procs stop. ``proc_bind`` (Monarch's): one dict
        per proc of a host, of ``cpus``/``physcpubind`` (CPU lists), ``cpunodebind`` and
        ``membind`` (NUMA nodes), as numactl and taskset take them (see ``placement``).
        ``bootstrap_command`` (Monarch's): a ``BootstrapCommand`` for every proc, or a function of
        each proc's point giving its own (``default_bootstrap_cmd().with_env({...})``): its env is
        added to the proc's, and a program other than this interpreter is exec'd."""
        self._check_live()
        if bootstrap is not None:  # as Monarch's: returns at once; a failing bootstrap fails `initialized`
            spawned = self.spawn_procs(
                per_host, env=env, name=name, proc_bind=proc_bind, bootstrap_command=bootstrap_command
            )
            booted = spawned.spawn("bootstrap", _Bootstrap, bootstrap).initialized
            ready: Future[bool] = Future(session.hub_for(self.pool))

            def settle(f: Future[Any]) -> None:
                if f._exc is None:
                    ready.set_result(True)
                    return
                ready.set_exception(f._exc)
                threading.Thread(
                    target=lambda: spawned.stop().get(), daemon=True, name="monarch-torchx-bootstrap"
                ).start()

            booted.add_done_callback(settle)
            spawned._initialized = ready
            return spawned
        per_host = dict(per_host if per_host is not None else {"procs": 1})
        for dim, n in per_host.items():
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"per_host[{dim!r}] must be a positive int, not {n!r}")
            if dim in self._shape.labels:
                raise ValueError(f"per_host dim {dim!r} clashes with the host mesh's dims {self._shape.labels}")
        local = 1
        for n in per_host.values():
            local *= n
        binds = placement.check(proc_bind, local)
        # Monarch's convention: a per-host dim named "gpus" is one proc per GPU; each holds its own
        # (CUDA_VISIBLE_DEVICES), counted by the host with every app's, never shared by mistake
        gpus_per_proc = 1 if "gpus" in per_host else 0
        hosts = [self._hosts[r] for r in self._shape.ranks]  # (first: an attach still under way ends here)
        hub = session.hub_for(self.pool)
        mesh_id = uuid.uuid4().hex[:12]
        proc_shape = Shape.dense(self._shape.labels + tuple(per_host), self._shape.sizes + tuple(per_host.values()))
        commands = _proc_commands(bootstrap_command, proc_shape, self._python)
        proc_env = {
            "MONARCH_TORCHX_PROC_PATH": os.pathsep.join(_controller_paths()),
            "MONARCH_TORCHX_PROC_CWD": _controller_cwd(),
            **self._env,
            **(env or {}),
        }
        if self._python is not None:  # and this_host() in its actors keeps it
            proc_env[PYTHON_ENV] = self._python
        from .controllers import ENV as CONTROLLERS

        me = session.this_proc()
        if me is None or me.in_client:  # actors it starts can ask for its get_or_spawn_controller actors
            proc_env[CONTROLLERS] = session.controllers(self.pool).port_env(hosts[0].host)
        elif os.environ.get(CONTROLLERS):  # and so can the procs those actors start
            proc_env[CONTROLLERS] = os.environ[CONTROLLERS]

        def host_calls(h: int) -> list[dict[str, Any]]:
            """Host ``h``'s mesh.spawn calls: one per distinct command among its procs (one, mostly)."""
            groups: dict[tuple[str | None, tuple[tuple[str, str], ...]], list[int]] = {}
            for r in range(h * local, (h + 1) * local):
                groups.setdefault(commands[r], []).append(r)
            return [
                _spawn_args(
                    mesh_id,
                    ranks,
                    {**proc_env, **dict(extra)},
                    [binds[r - h * local] for r in ranks] if binds is not None else None,
                    python,
                    gpus_per_proc,
                )
                for (python, extra), ranks in groups.items()
            ]

        def start(h: int) -> list[dict[str, Any]]:
            out: list[dict[str, Any]] = []
            for args in host_calls(h):  # one after another: a host's rendezvous is per mesh
                out += _agent_call(hub, hosts[h], "mesh.spawn", timeout=180.0, **args)
            return out

        results: list[list[dict[str, Any]] | None] = [None] * len(hosts)
        errors: list[str] = []
        if len(hosts) >= tree_min_hosts():  # through the agents' relay tree: a few connections, not N
            calls = {host.index: host_calls(h) for h, host in enumerate(hosts)}
            outcomes = ask_tree(
                [Target(host.index, host.host, host.port, host.identity(self.pool).decode()) for host in hosts],
                hub.creds,
                "mesh.spawn",
                calls=calls,
                timeout=180.0,
            )
            for h, host in enumerate(hosts):
                o = outcomes.get(host.index) or {"ok": False, "error": "no answer"}
                if o["ok"]:
                    results[h] = [info for value in o["value"] for info in value]
                else:
                    errors.append(f"host {host.index}: {o['error']}")
        else:
            with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as ex:
                for h, fut in enumerate([ex.submit(start, h) for h in range(len(hosts))]):
                    try:
                        results[h] = fut.result()
                    except Exception as e:
                        errors.append(str(e))
        if errors:
            for h, host in enumerate(hosts):
                if results[h] is not None:
                    try:
                        _agent_call(hub, host, "kill", timeout=10.0, app_id=app_id(mesh_id), grace=1.0)
                    except Exception:
                        pass
            raise MonarchError(f"spawn_procs on pool {self.pool!r} failed: {errors[0]}")
        procs = []
        for h, host in enumerate(hosts):
            agent = ProcAddr(host.host, host.port, host.identity(self.pool).decode())
            for info in sorted(results[h] or [], key=lambda info: info["rank"]):
                procs.append(
                    ProcRef(
                        ProcAddr(info["host"], info["port"], f"{self.pool}/proc/{mesh_id}/{info['rank']}"),
                        mesh_id,
                        info["rank"],
                        host.index,
                        info["hostname"],
                        agent,
                    )
                )
        mesh = ProcMesh(
            self.pool,
            procs,
            Shape.dense(self._shape.labels + tuple(per_host), self._shape.sizes + tuple(per_host.values())),
            mesh_id,
        )
        try:
            mesh._own(hub)
        except Exception as e:
            for ref in procs:  # their ends are this failure's, not supervision events
                hub.closing[ref.addr] = ProcStopped(f"proc {ref.rank} of mesh {mesh_id}: spawn_procs failed")
            hub.unwatch_all([ref.addr for ref in procs])
            for host in hosts:  # nothing half-owned stays behind
                try:
                    _agent_call(hub, host, "kill", timeout=10.0, app_id=app_id(mesh_id), grace=1.0)
                except Exception:
                    pass
            raise MonarchError(
                f"spawn_procs on pool {self.pool!r} failed: could not connect to the procs: {e}"
            ) from None
        self._spawned.append(mesh)
        me = session.this_proc()
        if me is not None:  # an actor's procs: stopped with it, as in Monarch
            me.record_owned(context().actor_instance.actor_id, mesh)
        return mesh


def _proc_commands(
    command: BootstrapCommand | Callable[[Point], BootstrapCommand] | None, shape: Shape, python: str | None
) -> list[tuple[str | None, tuple[tuple[str, str], ...]]]:
    """Each proc's (python to exec, or None: a warm fork; env it adds), by rank."""
    out: list[tuple[str | None, tuple[tuple[str, str], ...]]] = []
    for point in shape.points():
        if command is None:
            out.append((python, ()))
            continue
        cmd = command(point) if callable(command) and not isinstance(command, BootstrapCommand) else command
        if not isinstance(cmd, BootstrapCommand):
            raise TypeError(f"bootstrap_command gave {type(cmd).__name__}, not a BootstrapCommand, for {point!r}")
        cmd.check()
        exe = None if cmd.program == sys.executable else cmd.program
        out.append((exe, tuple(sorted(cmd.env.items()))))
    return out


def _spawn_args(
    mesh_id: str,
    ranks: list[int],
    env: dict[str, str],
    binds: list[dict[str, str]] | None,
    python: str | None,
    gpus: int = 0,
) -> dict[str, Any]:
    """The agent's ``mesh.spawn`` arguments for one host."""
    return {
        "mesh_id": mesh_id,
        "ranks": ranks,
        "env": env,
        **({"gpus": gpus} if gpus else {}),
        **({"binds": binds} if binds is not None else {}),
        **({"python": python} if python is not None else {}),
    }


def _received_host_mesh(
    pool: str, hosts: Sequence[HostAddr], shape: Shape, python: str | None = None, env: dict[str, str] | None = None
) -> HostMesh:
    mesh = HostMesh(pool, hosts, shape)
    mesh._received = True
    mesh._python = python
    mesh._env = dict(env or {})
    return mesh


class _LogLevel(Actor):
    """Sets a proc's root logger level (ProcMesh.logging_option); its constructor is the work."""

    def __init__(self, level: int):
        logging.getLogger().setLevel(level)

    @endpoint
    async def noop(self) -> None:  # an async endpoint: constructed on the loop, at once
        return None


def _stream_output(hub: Hub, ref: ProcRef) -> None:
    """Prints one proc's output here as its agent sees it, until the proc ends."""
    agent = ref.agent
    assert agent is not None  # not called for the controller's own proc (its output is already here)
    try:
        with net.Client(agent.host, agent.port, hub.creds, timeout=10.0, identity=agent.identity.encode()) as c:
            c.settimeout(None)
            for batch in c.stream(
                "logs", app_id=app_id(ref.mesh_id), role="proc", replica_id=ref.rank, streams="combined", follow=True
            ):
                sys.stdout.write("".join(f"[{ref.rank}] {line}" for line in batch))
                sys.stdout.flush()
    except (net.WireError, OSError) as e:  # the proc or its host is gone: nothing more to show
        log.debug("output of proc %d of mesh %s: %s", ref.rank, ref.mesh_id, e)


class _Bootstrap(Actor):
    """Runs a spawn_procs(bootstrap=...) function in a proc (its constructor is the run). Its
    failure is the ProcMesh's ``initialized`` error, not a supervision event."""

    _constructor_failure_is_a_fault = False
    _gates_the_proc = True  # the proc makes no other actor until it ran

    def __init__(self, fn: Callable[[], Any]):
        fn()


def _controller_cwd() -> str:
    """The directory a new mesh's procs work in where it exists on their host: the controller's
    cwd (passed on by an actor that spawns a mesh), as a replica's is the caller's."""
    if "MONARCH_TORCHX_PROC_RANK" in os.environ and "MONARCH_TORCHX_PROC_CWD" in os.environ:
        return os.environ["MONARCH_TORCHX_PROC_CWD"]
    return os.getcwd()


def _controller_paths() -> list[str]:
    """Where the procs of a new mesh look for the controller's code: its script's directory and
    its cwd. An actor that spawns a mesh of its own passes on the paths its proc was given (a
    proc's cwd is its agent's directory, which holds no code of the user's)."""
    if "MONARCH_TORCHX_PROC_RANK" in os.environ and "MONARCH_TORCHX_PROC_PATH" in os.environ:
        return [p for p in os.environ["MONARCH_TORCHX_PROC_PATH"].split(os.pathsep) if p]
    paths = []
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)
    if main_file:
        paths.append(os.path.dirname(os.path.abspath(main_file)))
    paths.append(os.getcwd())
    return paths


def _agent_call(hub: Hub, host: HostAddr, op: str, timeout: float, **args: Any) -> Any:
    where = f"host {host.index} of pool {hub.pool!r}"
    try:
        with AgentClient(host.host, host.port, hub.creds, timeout=10.0, identity=host.identity(hub.pool)) as c:
            c.settimeout(timeout)
            return c.call(op, **args)
    except net.RemoteError as e:
        raise MonarchError(f"{where}: {e}") from None
    except net.WireError as e:
        raise MonarchError(
            f"{where} is not reachable ({e}); is the pool still running? (`monarch-torchx pool status {hub.pool}`)"
        ) from None


def attach(pool: str) -> HostMesh:
    """The HostMesh of warm pool ``pool`` (created earlier by torchx run / pool create)."""
    from ..pool import Pool

    registry = Registry()
    rec = registry.require(pool)
    hosts = Pool(rec, registry).hosts
    for i, h in enumerate(hosts):
        if h is None:
            raise MonarchError(f"host {i} of pool {pool!r} has not started (see `monarch-torchx pool status {pool}`)")
        if h.exited:
            raise MonarchError(
                f"host {i} of pool {pool!r} is stopped ({h.exit_reason}); "
                f"a torchx run or `monarch-torchx pool create` brings it back"
            )
        if h.via:
            raise MonarchError(
                f"pool {pool!r} is reached through a tunnel ({h.via.split(':')[0]}), but actors talk to "
                f"procs directly: run the controller where pod IPs are reachable (in the cluster, "
                f"access=pod_ip)"
            )
    session.hub_for(pool, rec.credentials)
    session.set_current_pool(pool)
    return HostMesh(pool, [h for h in hosts if h is not None])


_said_implicit_pool = False


def _say_implicit_pool(name: str, existed: bool, idle_timeout_s: float) -> None:
    """Says once per process, in one line, which pool ``this_host()`` picked when none was named.
    In Monarch its procs end with the script; here they live in a warm pool that outlives it, so
    the user learns that it exists, how long it stays, how to end it and how to pick another."""
    global _said_implicit_pool
    if _said_implicit_pool:
        return
    _said_implicit_pool = True
    stays = f"stays up until idle for {_duration(idle_timeout_s)}" if idle_timeout_s > 0 else "stays up until stopped"
    log.warning(
        "this_host(): actors run on the warm monarch_local pool %r (%s; it %s: `monarch-torchx pool stop "
        "%s` ends it); set %s=NAME to pick another pool and silence this line",
        name,
        "reused" if existed else "created now",
        stays,
        name,
        LOCAL_POOL_ENV,
    )


def _duration(seconds: float) -> str:
    """90 -> "90s", 1800 -> "30m", 7200 -> "2h": as -cfg idle_timeout is written."""
    s = int(seconds)
    return f"{s // 3600}h" if s % 3600 == 0 else f"{s // 60}m" if s % 60 == 0 else f"{s}s"


def hosts_from_config(name: str) -> HostMesh:
    """As Monarch's (a stand-in there too, for its getting-started example): a HostMesh of 2 hosts
    on this machine, here the warm ``monarch_local`` pool ``config-NAME`` (made on first use, reused
    after; it idles out after 30 minutes, as ``this_host()``'s pool does)."""
    from ..pool import PoolRequest, ensure_pool, parse_duration
    from ..registry import check_pool_name

    pool_name = "config-" + "".join(c if c.isalnum() or c in "-_" else "-" for c in name.lower()).strip("-_")
    check_pool_name(pool_name)
    pool = ensure_pool(
        PoolRequest("monarch_local", pool_name, {"hosts": 2}, options={"idle_timeout": parse_duration("30m")}),
        defaults={"hosts": 2, "preload": "torch"},
    )
    session.hub_for(pool_name, pool.record.credentials)
    session.set_current_pool(pool_name)
    return HostMesh(pool_name, [h for h in pool.hosts if h is not None])


def this_host() -> HostMesh:
    """This machine, as a HostMesh with no dims (as Monarch's): in an actor, its own host;
    elsewhere, the warm ``monarch_local`` pool ``local``. ``spawn_procs(per_host={...})`` on it
    gives exactly the per-host dims."""
    me = session.this_proc()
    if me is not None and not me.in_client:
        state_dir = os.environ.get("MONARCH_TORCHX_STATE_DIR", "")
        h = Registry.read_host(state_dir, me.host_index) if state_dir else None
        if h is None:
            raise MonarchError("this proc's host agent address is unknown")
        mesh = HostMesh(me.pool, [h]).slice(hosts=0)
        mesh._python = os.environ.get(PYTHON_ENV) or None  # with_python_executable() of the mesh it came from
        return mesh
    from ..pool import PoolRequest, ensure_pool, parse_duration

    name = os.environ.get(LOCAL_POOL_ENV, LOCAL_POOL)
    existed = Registry().get(name) is not None
    # idles out as a pool `torchx run` creates does (its default): made on the side, not kept forever
    pool = ensure_pool(
        PoolRequest(
            "monarch_local", name, {"hosts": 1, "preload": None}, options={"idle_timeout": parse_duration("30m")}
        ),
        defaults={"hosts": 1, "preload": "torch"},
    )
    if LOCAL_POOL_ENV not in os.environ:
        _say_implicit_pool(name, existed, float(pool.record.options.get("idle_timeout") or 0))
    session.hub_for(name, pool.record.credentials)
    session.set_current_pool(name)
    return HostMesh(name, [h for h in pool.hosts if h is not None]).slice(hosts=0)


def shutdown_context() -> Future[None]:
    """As Monarch's: releases what this process started in the actor world. Every proc it owns
    stops (each actor's ``__cleanup__`` runs), as when it exits; the pools stay warm. Idempotent."""
    session.end_all()
    return Future.resolved(None)


def this_proc() -> ProcMesh:
    """A proc to spawn actors on here, with no dims (as Monarch's ``this_proc()``). In an actor:
    the actor's own proc. In a controller (and in the actors running in it): the controller's
    own proc, as in Monarch: the actors spawned on it run in the controller's process."""
    me = session.this_proc()
    if me is not None and not me.in_client:
        state_dir = os.environ.get("MONARCH_TORCHX_STATE_DIR", "")
        h = Registry.read_host(state_dir, me.host_index) if state_dir else None
        if h is None or me.addr is None:
            raise MonarchError("this proc's host agent address is unknown")
        import socket

        agent = ProcAddr(h.host, h.port, h.identity(me.pool).decode())
        ref = ProcRef(me.addr, me.mesh_id, me.rank, me.host_index, socket.gethostname(), agent)
        return ProcMesh(me.pool, [ref], Shape((), (), (0,)), me.mesh_id)
    pool = me.pool if me is not None else session.current_pool()
    if pool is None:
        this_host()  # the local pool, as the controller's this_host() is
        pool = session.current_pool()
    assert pool is not None
    return session.client_proc(pool).mesh()


# ---------------------------------------------------------------- procs


class ProcMesh(_MeshTrait):
    """Processes on the pool's hosts, each able to host many actors."""

    def __init__(self, pool: str, procs: Sequence[ProcRef], shape: Shape, mesh_id: str):
        self.pool = pool
        self._procs = list(procs)
        self._shape = shape
        self.mesh_id = mesh_id
        self._initialized: Future[bool] | None = None  # a bootstrap's outcome, where there is one

    def _with_shape(self, shape: Shape) -> ProcMesh:
        return ProcMesh(self.pool, self._procs, shape, self.mesh_id)

    def __repr__(self) -> str:
        return f"ProcMesh(pool={self.pool!r}, {self.extent!r})"

    @property
    def initialized(self) -> Future[bool]:
        """As Monarch's: completes (True) once the procs are up and their ``bootstrap`` ran; raises
        the bootstrap's ActorError if it failed (the procs are then stopped)."""
        return self._initialized if self._initialized is not None else Future.resolved(True)

    def __reduce__(self) -> Any:
        return ProcMesh, (self.pool, self._procs, self._shape, self.mesh_id)

    def __enter__(self) -> ProcMesh:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop().get()

    async def __aenter__(self) -> ProcMesh:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    def _own(self, hub: Hub) -> None:
        """Connects to each proc and becomes its owner (it stops when this process goes)."""
        me = session.this_proc()
        owner_actor = context().actor_instance.actor_id if me is not None else None

        def own(ref: ProcRef) -> None:
            hub.explain[ref.addr] = lambda: _explain(hub, ref)[0]
            hub.watch(ref.addr, functools.partial(_on_proc_lost, hub, ref, owner_actor))

        if len(self._procs) <= 2:
            for ref in self._procs:
                own(ref)
            return
        with ThreadPoolExecutor(max_workers=min(32, len(self._procs))) as ex:  # a handshake per proc
            list(ex.map(own, self._procs))

    def spawn(self, name: str, actor_class: type, *args: Any, **kwargs: Any) -> ActorMesh[Any]:
        """Creates one ``actor_class(*args, **kwargs)`` per proc and returns at once, as Monarch's
        spawn: calls sent now run after the constructors. A constructor that raises makes every
        call to that actor fail with SupervisionError saying why; ``mesh.initialized`` (a Future)
        completes when all constructors ran, or raises the first one's ActorError."""
        if not isinstance(actor_class, type) or not issubclass(actor_class, Actor):
            raise TypeError(f"spawn() needs an Actor subclass, not {actor_class!r}")
        hub = session.hub_for(self.pool)
        if any(
            self._procs[b].addr in hub.closing or isinstance(hub.dead.get(self._procs[b].addr), ProcStopped)
            for b in self._shape.ranks
        ):
            raise RuntimeError(f"`ProcMesh` has already been stopped (mesh {self.mesh_id}): spawn_procs() a new one")
        try:
            packed = pack((actor_class, args, kwargs))
        except Exception as e:
            raise TypeError(f"cannot send {actor_class.__name__} or its arguments to the procs: {e}") from None
        actor_id = f"{name}-{uuid.uuid4().hex[:8]}"
        spawner = current_context.get().actor_instance
        owner = spawner.actor_id if session.this_proc() is not None else ""  # who supervises it
        creator = spawner.as_creator()
        rid = hub.next_id()
        futs = []
        refs_blob: bytes | None = None  # the mesh's procs, pickled once for every proc that needs them
        in_order = [self._procs[b] for b in self._shape.ranks]
        links = _links(_tree(in_order)) if len(in_order) >= TREE_MIN else {}
        for point, base in zip(self._shape.points(), self._shape.ranks):
            ref = self._procs[base]
            fut: Future[Any] = Future(hub)
            # the mesh it is spawned on (actor_instance.proc_mesh): its procs go to each proc once,
            # in the first frame the proc runs (the sequence number and the check are one step)
            with hub.refs_lock:
                seq = hub.next_seq(ref.addr)
                key = (ref.addr, self.mesh_id, len(self._procs))
                first = key not in hub.mesh_refs_sent
                hub.mesh_refs_sent.add(key)
            if first and refs_blob is None:  # N procs each get all N addresses, which repeat: compressed
                refs_blob = zlib.compress(pickle.dumps(self._procs, protocol=5), 1)
            header = messages.Spawn(
                rid,
                hub.sender,
                seq,
                actor_id,
                name,
                point.coords,
                self._shape.labels,
                self._shape.sizes,
                owner,
                creator,
                (self.mesh_id, self._shape, len(self._procs), refs_blob if first else None),
                links.get(ref.rank, ()) if first else (),
            )
            _send(hub, ref.addr, encode(header, packed=packed), rid, fut)
            futs.append(fut)
            hub.actors_on.setdefault(ref.addr, []).append(f"{name}{point_text(point)}")
        mesh: ActorMesh[Any] = ActorMesh(
            self.pool,
            self._procs,
            self._shape,
            actor_id,
            name,
            actor_class.__name__,
            tuple(endpoints_of(actor_class)),
            f"{actor_class.__module__}.{actor_class.__qualname__}",
        )
        mesh._initialized = Future.gather(hub, futs, lambda _v: None)
        if owner:  # an actor's: stopped with it, as in Monarch
            session.this_proc().record_owned(owner, mesh)  # type: ignore[union-attr]
        return mesh

    async def logging_option(
        self, stream_to_client: bool = False, aggregate_window_sec: int | None = None, level: int = logging.INFO
    ) -> None:
        """As Monarch's, a coroutine (``await procs.logging_option(...)``, or ``asyncio.run(...)``
        from sync code): sets the procs' root logger ``level``; ``stream_to_client`` prints each
        proc's output (stdout and stderr) on this process's stdout as it comes, each line led by
        ``[rank]``. ``aggregate_window_sec`` is accepted (it needs ``stream_to_client``) but lines
        are not aggregated here: each is printed."""
        if aggregate_window_sec is not None and not stream_to_client:
            raise ValueError("aggregate_window_sec needs stream_to_client=True")
        done = self.spawn(f"logging-{uuid.uuid4().hex[:6]}", _LogLevel, level).initialized
        if stream_to_client:
            hub = session.hub_for(self.pool)
            for b in self._shape.ranks:
                if self._procs[b].agent is None:  # the controller's own proc: its output is already here
                    continue
                threading.Thread(
                    target=_stream_output, args=(hub, self._procs[b]), daemon=True, name="monarch-torchx-proc-output"
                ).start()
        await done

    def stop(self, timeout: float = 30.0) -> Future[None]:
        """Stops every proc of this mesh (``__cleanup__`` runs in each actor first), as Monarch's
        ``ProcMesh.stop()``: the procs are told at once, and the returned Future completes once
        each has stopped (or ``timeout`` passed): ``pm.stop().get()`` or ``await pm.stop()``."""
        hub = session.hub_for(self.pool)
        refs = [self._procs[b] for b in self._shape.ranks]
        for ref in refs:  # what the connections' ends will report (not as failures)
            hub.closing[ref.addr] = ProcStopped(f"proc {ref.rank} of mesh {ref.mesh_id} was stopped")
        rid = hub.next_id()
        futs: list[Future[Any]] = []
        for ref in refs:
            fut: Future[Any] = Future(hub)
            _send(hub, ref.addr, encode(messages.Stop(rid)), rid, fut)
            futs.append(fut)
        done: Future[None] = Future(hub)
        left = [len(futs)]
        lock = threading.Lock()

        def finish() -> None:
            hub.unwatch_all([r.addr for r in refs])
            for ref in refs:
                hub.actors_on.pop(ref.addr, None)
                hub.explain.pop(ref.addr, None)  # (a long-lived controller spawns and stops many meshes)
                hub.mesh_refs_sent.discard((ref.addr, self.mesh_id, len(self._procs)))
                err = hub.closing.get(ref.addr)
                if err is not None:  # dead before no longer closing: its supervision report may be on its way now
                    hub.mark_dead(ref.addr, err)
                hub.closing.pop(ref.addr, None)

            # the procs answered; done once their agents saw them exit (Monarch's stop() means gone)
            def exited() -> None:
                _await_exits(hub, refs, EXIT_WAIT_S)
                done.set_result(None)
                hub.wake()  # completed off the reader's thread: whoever waits in the hub must look

            threading.Thread(target=exited, name="monarch-torchx-stop", daemon=True).start()

        def one(_f: Future[Any]) -> None:  # an answer, the proc's end (SupervisionError), or the deadline
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                finish()

        def expire() -> None:
            for f in futs:
                f.set_exception(TimeoutError("stop"))

        timer = threading.Timer(timeout, expire)
        timer.daemon = True
        timer.start()
        done.add_done_callback(lambda _f: timer.cancel())
        if not futs:
            finish()
        for f in futs:
            f.add_done_callback(one)
        return done


def _await_exits(hub: Hub, refs: Sequence[ProcRef], within: float) -> None:
    """Waits (at most ``within`` s) until each proc's agent reports it ended."""
    by_agent: dict[tuple[str, int], list[ProcRef]] = {}
    for ref in refs:
        if ref.agent is not None:  # the controller's own proc has ended once it answered
            by_agent.setdefault((ref.agent.host, ref.agent.port), []).append(ref)
    deadline = time.monotonic() + within
    for group in by_agent.values():
        agent, want = group[0].agent, {r.rank for r in group}
        assert agent is not None  # grouped by agent: only refs that have one
        try:
            with AgentClient(agent.host, agent.port, hub.creds, timeout=5.0, identity=agent.identity.encode()) as c:
                while time.monotonic() < deadline:
                    reps = c.describe(app_id(group[0].mesh_id))
                    if all(r.state.terminal for r in reps if r.replica_id in want):
                        break
                    time.sleep(0.01)
        except (net.WireError, OSError, LookupError) as e:  # the host is gone: so are its procs
            log.debug("waiting for procs of mesh %s to exit: %s", group[0].mesh_id, e)


def _send(hub: Hub, addr: ProcAddr, parts: list[Any], rid: int, fut: Future[Any] | None) -> None:
    """Sends one frame; a failure goes to ``fut``, or (fire and forget) is logged, never raised."""
    try:
        hub.conn(addr).send(parts, rid, fut)
    except (SupervisionError, OSError, TimeoutError) as e:
        if fut is None:
            log.warning("broadcast did not reach %s: %s", addr.identity, e)
        else:
            fut.set_exception(e)


def _explain(hub: Hub, ref: ProcRef) -> tuple[str, int | None]:
    """Asks the proc's agent how it ended (waits briefly for the agent to reap it): why, and its
    exit code (negative: the signal) when it has one."""
    who = f"proc {ref.rank} of mesh {ref.mesh_id} on host {ref.host_index} ({ref.hostname})"
    deadline = time.monotonic() + 3.0
    agent = ref.agent
    assert agent is not None  # asked only of procs a mesh spawned (through their agents)
    while True:
        with AgentClient(agent.host, agent.port, hub.creds, timeout=3.0, identity=agent.identity.encode()) as c:
            reps = c.describe(app_id(ref.mesh_id))
        st = next((r for r in reps if r.replica_id == ref.rank), None)
        if st is None:
            return f"{who} is gone (its host no longer knows it)", None
        if st.state.terminal:
            return f"{who} {st.msg or st.state.value.lower()}", st.exit_code
        if time.monotonic() > deadline:
            return f"{who} stopped answering (its host says it is still running: hung, or the network is cut)", None
        time.sleep(0.05)


def _on_proc_lost(hub: Hub, ref: ProcRef, owner_actor: str | None, addr: ProcAddr) -> None:
    """A proc this process spawned died: calls to it fail from now on, and (as in Monarch) its
    owner gets a supervision event: the spawning actor's ``__supervise__``, or in a controller
    ``unhandled_fault_hook``."""
    if addr in hub.closing or isinstance(hub.dead.get(addr), ProcStopped):  # stopped on purpose
        return
    code: int | None = None
    try:
        reason, code = _explain(hub, ref)
    except Exception as e:
        reason = f"proc {ref.rank} of mesh {ref.mesh_id} on host {ref.host_index} is lost (host unreachable: {e})"
    hub.mark_dead(addr, SupervisionError(reason))
    failure = MeshFailure(
        ref.mesh_id,
        ref.rank,
        ref.host_index,
        ref.hostname,
        reason.split(f"({ref.hostname}) ", 1)[-1],
        exit_code=code,
        actors_on_proc=tuple(hub.actors_on.get(addr, ())),
    )
    me = session.proc_hosting(owner_actor) if owner_actor is not None else None
    if me is not None and me.on_child_lost is not None:
        me.on_child_lost(owner_actor, failure)
    else:
        log.warning("supervision: %s", reason)
        from . import supervision

        try:
            supervision.dispatch(failure)
        except BaseException as e:  # noqa: BLE001 - the hook raised on the supervision thread
            supervision.unhandled_off_caller(e)


# ---------------------------------------------------------------- actors


class ActorMesh(_MeshTrait, Generic[T]):
    """One actor per proc of a ProcMesh. ``mesh.endpoint`` gives the adverbs."""

    def __init__(
        self,
        pool: str,
        procs: Sequence[ProcRef],
        shape: Shape,
        actor_id: str,
        name: str,
        cls_name: str,
        endpoints: tuple[str, ...],
        cls_path: str = "",
        sliced: bool = False,
    ):
        self.pool = pool
        self._procs = list(procs)
        self._shape = shape
        self._sliced = sliced  # a view (slice, rename, flatten) of the mesh as spawned: see message_rank
        self._actor_id = actor_id
        self._name = name
        self._cls_name = cls_name
        self._endpoints = endpoints
        self._cls_path = cls_path or cls_name  # module.Class, as supervision errors name the actor

    _initialized: Future[None] | None = None  # the constructors' answers (in the process that spawned it)

    def _with_shape(self, shape: Shape) -> ActorMesh[T]:
        mesh: ActorMesh[T] = ActorMesh(
            self.pool,
            self._procs,
            shape,
            self._actor_id,
            self._name,
            self._cls_name,
            self._endpoints,
            self._cls_path,
            sliced=True,
        )
        mesh._initialized = self._initialized
        return mesh

    @property
    def initialized(self) -> Future[None]:
        """Completes once every constructor ran (raises the first failure's ActorError), as
        Monarch's. Where the mesh was received rather than spawned, a call shows the same."""
        return self._initialized if self._initialized is not None else Future.resolved(None)

    def __reduce__(self) -> Any:
        return ActorMesh, (
            self.pool,
            self._procs,
            self._shape,
            self._actor_id,
            self._name,
            self._cls_name,
            self._endpoints,
            self._cls_path,
            self._sliced,
        )

    def __repr__(self) -> str:
        return f"ActorMesh({self._name!r}: {self._cls_name}, {self.extent!r})"

    def stop(self) -> Future[None]:
        """Stops these actors, not their procs (as Monarch's ``ActorMesh.stop()``): calls already
        sent run first, then ``__cleanup__``; later calls get SupervisionError. The Future
        completes once every actor is gone."""
        hub = session.hub_for(self.pool)
        rid = hub.next_id()
        futs: list[Future[Any]] = []
        for base in self._shape.ranks:
            ref = self._procs[base]
            fut: Future[Any] = Future(hub)
            _send(
                hub,
                ref.addr,
                encode(messages.StopActor(rid, hub.sender, hub.next_seq(ref.addr), self._actor_id)),
                rid,
                fut,
            )
            futs.append(fut)
        return Future.gather(hub, futs, lambda _v: None)

    def __getattr__(self, name: str) -> EndpointMesh:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._endpoints:
            raise AttributeError(
                f"{self._cls_name} has no endpoint {name!r} "
                f"(endpoints: {', '.join(self._endpoints) or 'none'}; mark methods with @endpoint)"
            )
        return EndpointMesh(self, name)


def _in_monarchs_words(ep: EndpointMesh, position: int, exc: BaseException) -> BaseException:
    """A call's SupervisionError as Monarch words it: which endpoint call failed, and which actor
    ("The actor MODULE.CLASS NAME{point} and all its descendants have failed"), then why. The
    error keeps its type (ProcStopped, ActorAborted)."""
    if not isinstance(exc, SupervisionError):  # a future fails once: this runs once per call
        return exc
    m = ep._mesh
    points = list(m._shape.points())
    point = repr(points[position]) if position < len(points) else ""
    return type(exc)(
        f"Endpoint call {m._name}.{ep._name}() failed, The actor {m._cls_path} {m._name}{point} "
        f"and all its descendants have failed:\n  {exc}"
    )


def _slice_coords(shape: Shape, positions: Sequence[int]) -> list[tuple[int, ...]]:
    """The coordinates, in ``shape``, of its members at ``positions`` (row-major)."""
    out = []
    for p in positions:
        c = []
        for s in reversed(shape.sizes):
            c.append(p % s)
            p //= s
        out.append(tuple(reversed(c)))
    return out


class EndpointMesh:
    """``call`` / ``call_one`` / ``choose`` / ``stream`` / ``broadcast`` of one endpoint of a mesh."""

    def __init__(self, mesh: ActorMesh[Any], name: str):
        self._mesh = mesh
        self._name = name

    def _what(self) -> str:
        return f"{self._mesh._cls_name}.{self._name}"

    def _pack(self, args: tuple, kwargs: dict) -> list[Any]:
        try:
            return pack((args, kwargs))
        except Exception as e:
            raise TypeError(f"cannot send the arguments of {self._what()}: {e}") from None

    def _send(self, positions: Sequence[int], args: tuple, kwargs: dict, reply: bool) -> list[Future[Any]]:
        """Sends to the members at ``positions`` (directly, or via a tree for large meshes)."""
        m = self._mesh
        hub = session.hub_for(m.pool)
        packed = self._pack(args, kwargs)
        refs = [m._procs[m._shape.ranks[p]] for p in positions]
        coords = _slice_coords(m._shape, positions) if m._sliced else None
        if len(refs) >= TREE_MIN:
            return self._cast(hub, refs, packed, reply, positions, coords)
        rid = hub.next_id() if reply else 0
        futs: list[Future[Any]] = []
        frames = []
        dims = (m._shape.labels, m._shape.sizes)
        for i, (p, ref) in enumerate(zip(positions, refs)):  # every frame first: the sends go out back to back
            fut: Future[Any] | None = Future(hub) if reply else None
            point = (*dims, coords[i]) if coords is not None else None
            header = messages.Call(rid, hub.sender, hub.next_seq(ref.addr), m._actor_id, self._name, point)
            frames.append((ref.addr, encode(header, packed=packed), fut))
            if fut is not None:
                fut.translate = functools.partial(_in_monarchs_words, self, p)
                futs.append(fut)
        for addr, parts, fut in frames:
            _send(hub, addr, parts, rid, fut)
        return futs

    def _cast(
        self,
        hub: Hub,
        refs: list[ProcRef],
        packed: list[Any],
        reply: bool,
        positions: Sequence[int] = (),
        coords: list[tuple[int, ...]] | None = None,
    ) -> list[Future[Any]]:
        seqs = {ref.rank: hub.next_seq(ref.addr) for ref in refs}
        per_rank: dict[int, Future[Any]] = {ref.rank: Future(hub) for ref in refs}
        for p, ref in zip(positions, refs):
            per_rank[ref.rank].translate = functools.partial(_in_monarchs_words, self, p)
        rid = hub.next_id() if reply else 0
        for root, sub in _tree(refs):
            ranks = [root.rank] + [r.rank for r in _flatten(sub)]
            fut: Future[Any] = Future(hub)
            points = None
            if coords is not None:
                at = {ref.rank: c for ref, c in zip(refs, coords)}
                points = (self._mesh._shape.labels, self._mesh._shape.sizes, {r: at[r] for r in ranks})
            header = messages.Cast(
                rid, hub.sender, {r: seqs[r] for r in ranks}, self._mesh._actor_id, self._name, _wire_tree(sub), points
            )
            _send(hub, root.addr, encode(header, packed=packed), rid, fut if reply else None)
            if reply:
                fut.add_done_callback(functools.partial(_fan_in, per_rank, ranks))
        return [per_rank[ref.rank] for ref in refs] if reply else []

    def call(self, *args: Any, **kwargs: Any) -> Future[ValueMesh]:
        """Every actor of the mesh; the future holds a ValueMesh (or the first failure)."""
        shape = self._mesh._shape
        futs = self._send(range(len(shape)), args, kwargs, True)
        return Future.gather(session.hub_for(self._mesh.pool), futs, lambda vals: ValueMesh(shape, vals))

    def call_one(self, *args: Any, **kwargs: Any) -> Future[Any]:
        n = len(self._mesh._shape)
        if n != 1:
            raise ValueError(
                f"call_one() needs a mesh of exactly one actor, and {self._what()} is on {n} "
                f"({self._mesh.extent!r}): use call(), choose(), or slice() first"
            )
        return self._send([0], args, kwargs, True)[0]

    def choose(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """One actor of the mesh: the one with the fewest calls of ours in flight."""
        m = self._mesh
        hub = session.hub_for(m.pool)
        loads = [(hub.pending_count(m._procs[b].addr), random.random(), p) for p, b in enumerate(m._shape.ranks)]
        return self._send([min(loads)[2]], args, kwargs, True)[0]

    def stream(self, *args: Any, **kwargs: Any) -> Iterator[Future[Any]]:
        """One future per actor, as Monarch's: the k-th completes with the k-th answer to arrive.
        The iterator never blocks (so ``[await f for f in m.ep.stream()]`` works on an event
        loop); ``.get()`` or ``await`` each future."""
        hub = session.hub_for(self._mesh.pool)
        sent = self._send(range(len(self._mesh._shape)), args, kwargs, True)
        arrivals: list[Future[Any]] = []
        for f in sent:
            out: Future[Any] = Future(hub)
            out.loop_thread = f.loop_thread
            arrivals.append(out)
        order = iter(arrivals)
        lock = threading.Lock()

        def arrived(f: Future[Any]) -> None:
            with lock:
                out = next(order)
            if f._exc is not None:
                out.set_exception(f._exc)
            else:
                out.set_result(f._value)

        for f in sent:
            f.add_done_callback(arrived)
        return iter(arrivals)

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        """Fire and forget to every actor of the mesh (a failure is a supervision event)."""
        self._send(range(len(self._mesh._shape)), args, kwargs, False)

    def _send_to_port(self, positions: Sequence[int], args: tuple, kwargs: dict, port: Any) -> None:
        """Each actor at ``positions`` answers to ``port`` (a value, or its error) instead of to us."""
        m = self._mesh
        hub = session.hub_for(m.pool)
        packed = self._pack(args, kwargs)
        for p in positions:
            ref = m._procs[m._shape.ranks[p]]
            header = messages.CallPort(hub.sender, hub.next_seq(ref.addr), m._actor_id, self._name, port)
            _send(hub, ref.addr, encode(header, packed=packed), 0, None)


def send(
    endpoint: EndpointMesh,
    args: tuple,
    kwargs: dict[str, Any] | None = None,
    port: Any = None,
    selection: str = "all",
) -> None:
    """Monarch's ``send``: calls ``endpoint`` on every actor (``selection="all"``) or on one
    (``"choose"``), answers going to ``port`` (each actor's value, or its error: the receiver's
    ``recv()`` raises it), or nowhere (fire and forget) without one."""
    if selection not in ("all", "choose"):
        raise ValueError(f"selection must be 'all' or 'choose', not {selection!r}")
    m = endpoint._mesh
    positions: Sequence[int] = range(len(m._shape))
    if selection == "choose":
        hub = session.hub_for(m.pool)
        positions = [
            min((hub.pending_count(m._procs[b].addr), random.random(), i) for i, b in enumerate(m._shape.ranks))[2]
        ]
    if port is None:
        endpoint._send(positions, tuple(args), dict(kwargs or {}), False)
    else:
        endpoint._send_to_port(positions, tuple(args), dict(kwargs or {}), port)


def _fan_in(per_rank: dict[int, Future[Any]], ranks: list[int], fut: Future[Any]) -> None:
    from .errors import remote_error

    exc = fut._exc
    if exc is not None:
        for r in ranks:
            per_rank[r].set_exception(exc)
        return
    for rank, ok, value in fut._value:
        if ok:
            per_rank[rank].set_result(value)
        else:
            per_rank[rank].set_exception(remote_error(value))


def _tree(refs: list[ProcRef]) -> list[tuple[ProcRef, list]]:
    """Splits members into FANOUT groups; each group's head forwards to the rest, recursively."""
    if not refs:
        return []
    groups = []
    step = -(-len(refs) // FANOUT)
    for i in range(0, len(refs), step):
        groups.append(refs[i : i + step])
    return [(g[0], _tree(g[1:])) for g in groups]


def _links(tree: list[tuple[ProcRef, list]]) -> dict[int, tuple[tuple[str, int, str], ...]]:
    """For each proc of a multicast tree, the addresses of the procs it forwards to (by rank)."""
    out: dict[int, tuple[tuple[str, int, str], ...]] = {}
    for ref, sub in tree:
        if sub:
            out[ref.rank] = tuple(tuple(child.addr) for child, _ in sub)
            out.update(_links(sub))
    return out


def _flatten(sub: list) -> list[ProcRef]:
    out = []
    for ref, s in sub:
        out.append(ref)
        out += _flatten(s)
    return out


def _wire_tree(sub: list) -> list:
    return [(ref.rank, tuple(ref.addr), _wire_tree(s)) for ref, s in sub]


class Accumulator(Generic[T]):
    """Calls an endpoint on the whole mesh and folds the answers: ``combine(acc, value)``."""

    def __init__(self, endpoint: EndpointMesh, identity: T, combine: Callable[[T, Any], T]):
        self._endpoint = endpoint
        self._identity = identity
        self._combine = combine

    def accumulate(self, *args: Any, **kwargs: Any) -> Future[T]:
        """As Monarch's: the endpoint's answers as they stream in (``endpoint.stream(*args,
        **kwargs)``), folded with ``combine`` from ``identity`` in the order they arrived; the
        first failure fails it; no actor at all gives ``identity``."""
        parts = list(self._endpoint.stream(*args, **kwargs))
        return Future.gather(
            parts[0]._hub if parts else None,
            parts,
            lambda values: functools.reduce(self._combine, values, self._identity),
        )
