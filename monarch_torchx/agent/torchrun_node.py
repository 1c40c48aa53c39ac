"""One node of a warm torchrun: torch's own elastic agent, in a process forked from the warm server.

Stock torchrun on a pool would exec bash, then torchrun (``import torch``), then P workers that
import torch again, and wait up to a second per rendezvous poll. Here the role's replica is
``python -m monarch_torchx.agent.torchrun_node (-c SHELL_CMD | -- TORCHRUN_ARGS)``, which the
agent's launcher forks from the fork server that already imported torch. It parses the command
with torchrun's own parser and runs torchrun's own ``launch_agent`` (so the workers' environment,
restarts, tee/redirects, ``[rank]:`` prefixes and the ChildFailedError summary are torchrun's),
with two seams swapped:

- the rendezvous is ``PoolRendezvous``: the pool already knows the role's hosts, so node rank is
  the replica id and node 0 serves a store on a port the pool reserved (no discovery, no polling
  delay), with heartbeats so a lost host ends the wait;
- each worker is forked from this process (``ForkedWorker``) and runs the script as the
  interpreter would, unless the worker command is not this Python (``--no-python``, numactl),
  which is exec'd as torchrun would.

CUDA is never initialised here (device counts go through NVML), so forking stays safe on GPU hosts.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..private import write_private_bytes
from ..torchrun import PLAN_ENV, THREAD_ENV, shell_words, torchrun_args
from .forkserver import INIT_ENV, detach_child, exit_as_python, parse_python_argv

BACKEND = "monarch-pool"


@dataclass
class NodePlan:
    """Where this node stands in its role, filled in by the scheduler at submit."""

    node_rank: int
    nnodes: int
    store_host: str  # the address of the role's first host, as the pool's hosts reach it
    store_port: int  # reserved on that host by its agent
    # the role's scheduler retries (``--max_retries``): torchrun restarts of every node together,
    # in a fresh rendezvous round; a node retried alone by its agent would meet a store that is gone
    restarts: int = 0

    @classmethod
    def from_env(cls) -> NodePlan:
        raw = os.environ.pop(PLAN_ENV, None)
        if not raw:
            raise SystemExit(f"torchrun_node: {PLAN_ENV} is not set (this module is started by a monarch-torchx pool)")
        return cls(**json.loads(raw))


# ------------------------------------------------------------------ the rendezvous


class PoolRendezvous:
    """A rendezvous among a fixed set of nodes whose ranks and store address are known up front.

    Round r completes when all nodes joined it. A node whose workers fail joins round r+1;
    the others see it waiting (``num_nodes_waiting``) and join too, so all restart together, as
    with torchrun's c10d backend. ``shutdown`` after a final failure closes the rendezvous: the
    other nodes stop their workers and end. Each round's workers get a store server of their own
    (fresh port), so keys of a failed attempt can never be read by the next.
    """

    def __init__(
        self,
        run_id: str,
        node_rank: int,
        nnodes: int,
        host: str,
        port: int,
        join_timeout: float,
        keep_alive_s: float,
        keep_alive_misses: int,
    ):
        self.run_id = run_id
        self.node_rank = node_rank
        self.nnodes = nnodes
        self.host = host
        self.port = port
        self.join_timeout = join_timeout
        self.keep_alive_s = keep_alive_s
        self.keep_alive_misses = keep_alive_misses
        self._round = 0
        self._store: Any = None
        self._worker_store: Any = None  # node 0: the current round's server for the workers
        self._stop = threading.Event()
        self._closed = False

    # the RendezvousHandler interface -------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return os.getenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") != "1"  # as c10d decides

    def get_run_id(self) -> str:
        return self.run_id

    def next_rendezvous(self) -> Any:
        from torch.distributed import DistError, PrefixStore
        from torch.distributed.elastic.rendezvous import (
            RendezvousClosedError,
            RendezvousConnectionError,
            RendezvousInfo,
            RendezvousStoreInfo,
        )

        try:
            store = self._control()
            if self.is_closed():
                raise RendezvousClosedError(f"the rendezvous of {self.run_id!r} is closed (another node ended it)")
            r = self._round
            self._round += 1
            prefix = f"{self.run_id}/r{r}/"
            if self.node_rank == 0:
                self._serve_workers(store, prefix)
            store.set(f"{prefix}joined/{self.node_rank}", "1")
            if store.add(prefix + "joined", 1) == self.nnodes:
                store.set(prefix + "complete", "1")
            self._wait_complete(store, prefix)
            port = int(store.get(prefix + "worker_port").decode())
        except DistError as e:
            raise RendezvousConnectionError(
                f"the role's store at {self.host}:{self.port} (node 0) is unreachable: {e}"
            ) from None
        info = RendezvousStoreInfo(self.host, port)
        return RendezvousInfo(PrefixStore(prefix + "agent/", store), self.node_rank, self.nnodes, info)

    def is_closed(self) -> bool:
        from torch.distributed import DistError

        if self._closed:
            return True
        try:
            self._closed = bool(self._control().check([f"{self.run_id}/closed"]))
        except DistError:  # node 0's store is gone: nothing can rendezvous again
            self._closed = True
        return self._closed

    def set_closed(self) -> None:
        from torch.distributed import DistError

        self._closed = True
        try:
            self._control().set(f"{self.run_id}/closed", "1")
        except DistError:
            pass  # gone already: the others find that out the same way

    def num_nodes_waiting(self) -> int:
        from torch.distributed import DistError

        if self.is_closed():
            return 1  # lets a healthy node stop its workers; its next_rendezvous then ends it
        try:
            return int(self._control().add(f"{self.run_id}/r{self._round}/joined", 0))
        except DistError:
            return 1

    def shutdown(self) -> bool:
        self.set_closed()
        self._stop.set()
        return True

    # internals ----------------------------------------------------------------------

    def _control(self) -> Any:
        from torch.distributed import TCPStore

        if self._store is None:
            timeout = datetime.timedelta(seconds=self.join_timeout)
            if self.node_rank == 0:
                self._store = TCPStore(
                    self.host,
                    self.port,
                    None,
                    True,
                    timeout,
                    wait_for_workers=False,
                    master_listen_fd=_listen(self.host, self.port).detach(),
                )
            else:
                self._await_listener(timeout.total_seconds())
                self._store = TCPStore(self.host, self.port, None, False, timeout)
            threading.Thread(target=self._heartbeat, name="pool-rdzv-heartbeat", daemon=True).start()
        return self._store

    def _await_listener(self, timeout: float) -> None:
        """Waits, polling every few ms, for node 0's store to listen: a TCPStore client that finds
        nothing there backs off for up to a second between attempts."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection((self.host, self.port), timeout=max(0.1, deadline - time.monotonic())).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    return  # the TCPStore client reports it, in torch's words
                time.sleep(0.005)

    def _serve_workers(self, store: Any, prefix: str) -> None:
        from torch.distributed import TCPStore

        self._worker_store = None  # the previous round's server (its workers are stopped by now)
        listen = _listen(self.host, 0)
        port = listen.getsockname()[1]
        self._worker_store = TCPStore(
            self.host,
            port,
            None,
            True,
            datetime.timedelta(seconds=self.join_timeout),
            wait_for_workers=False,
            master_listen_fd=listen.detach(),
        )
        store.set(prefix + "worker_port", str(port))

    def _heartbeat(self) -> None:
        from torch.distributed import DistError, TCPStore

        try:
            client = TCPStore(self.host, self.port, None, False, datetime.timedelta(seconds=self.join_timeout))
            while not self._stop.wait(self.keep_alive_s):
                client.add(f"{self.run_id}/alive/{self.node_rank}", 1)
        except DistError:
            pass  # the store is gone: the main thread finds out on its next call

    def _wait_complete(self, store: Any, prefix: str) -> None:
        from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousTimeoutError

        deadline = time.monotonic() + self.join_timeout
        seen: dict[int, tuple] = {}
        delay = 0.002
        while not store.check([prefix + "complete"]):
            if store.check([f"{self.run_id}/closed"]):
                raise RendezvousClosedError(f"the rendezvous of {self.run_id!r} was closed while joining")
            now = time.monotonic()
            if now > deadline:
                raise RendezvousTimeoutError(f"not all {self.nnodes} nodes joined within {self.join_timeout:.0f} s")
            for k in range(self.nnodes):
                if k == self.node_rank or store.check([f"{prefix}joined/{k}"]):
                    continue
                beat = store.add(f"{self.run_id}/alive/{k}", 0)
                last = seen.get(k)
                if last is None or last[0] != beat:
                    seen[k] = (beat, now)
                elif now - last[1] > self.keep_alive_s * self.keep_alive_misses:
                    raise RendezvousTimeoutError(
                        f"node {k} of the role stopped answering (no heartbeat for {now - last[1]:.0f} s); "
                        "its host may be lost"
                    )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)


def _listen(host: str, port: int) -> socket.socket:
    """The store's socket, bound to the pool's address of this host only (not every interface);
    ``detach()`` it into the TCPStore, which owns (and closes) the descriptor from then on.

    An address given as a host name is bound on every interface, as the agent itself is: the name
    may resolve here to a loopback address that the other hosts cannot reach.
    """
    import ipaddress

    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    family = socket.AF_INET6 if literal is not None and literal.version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if port:  # the agent holds it for us until we listen (op_reserve_port): shared with it, and only with it
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host if literal is not None else "", port))
    sock.listen(1024)
    return sock


def _make_rendezvous(params: Any) -> Any:
    host, _, port = params.endpoint.rpartition(":")
    return PoolRendezvous(
        run_id=params.run_id,
        node_rank=int(params.config["node_rank"]),
        nnodes=params.max_nodes,
        host=host,
        port=int(port),
        join_timeout=float(params.get("join_timeout", 600)),
        keep_alive_s=float(params.get("keep_alive_interval", 5)),
        keep_alive_misses=int(params.get("keep_alive_max_attempt", 3)),
    )


# ------------------------------------------------------------------ forked workers


class ForkedProcess:
    """The part of ``subprocess.Popen`` torch's SubprocessContext uses, for a forked child."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def _worker_handler_class(base_path: list[str]) -> type:
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    class ForkedWorker(SubprocessHandler):
        """A torchrun worker forked from the node process (torch imported), not exec'd."""

        def _popen(self, args: tuple, env: dict[str, str]) -> Any:
            inv = parse_python_argv(list(args[1:])) if _is_this_python(args[0]) else None
            if inv is None or any(env.get(k) != os.environ.get(k) for k in INIT_ENV if k not in THREAD_ENV):
                return super()._popen(args, env)
            for s in (sys.stdout, sys.stderr):
                s.flush()
            pid = os.fork()
            if pid == 0:
                _become_worker(inv, env, self._stdout, self._stderr, base_path)
            return ForkedProcess(pid)

    return ForkedWorker


def _is_this_python(prog: str) -> bool:
    return os.path.realpath(prog) == os.path.realpath(sys.executable)


def _base_path() -> list[str]:
    extra = {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    return [p for p in sys.path[1:] if p not in extra]


def _become_worker(inv: Any, env: dict[str, str], stdout: Any, stderr: Any, base_path: list[str]) -> None:
    """In the forked child: look exec'd (as the fork server's children do), then run the script."""
    try:
        try:
            inherited = [int(f) for f in os.listdir("/proc/self/fd")]
        except OSError:
            inherited = list(range(3, 1024))
        detach_child(
            stdout.fileno() if stdout is not None else 1, stderr.fileno() if stderr is not None else 2, inherited
        )
        threads = next((env[k] for k in THREAD_ENV if env.get(k)), None)
        if threads and threads.isdigit() and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(threads))  # what the variable does at exec time
        exit_as_python(inv, env, base_path)
    except BaseException:
        os._exit(127)


# ------------------------------------------------------------------ main


def _torchrun_argv(argv: list[str]) -> list[str]:
    if argv[:1] == ["-c"] and len(argv) == 2:
        # as bash would expand the words in this host's environment
        return torchrun_args(shell_words(argv[1], dict(os.environ))) or []
    if argv[:1] == ["--"]:
        return argv[1:]
    return argv


def _failure_message(err: Any, max_restarts: int) -> str:
    """torchrun's ChildFailedError summary in one line: every failed rank, first observed first.

    (torchrun's own "root cause" is the earliest failure by a one-second timestamp, often a rank
    that only saw its peer go; listing them all keeps the one that failed first in sight.)
    """
    host = socket.gethostname()
    parts = []
    failures = sorted(err.failures.items(), key=lambda kv: (kv[1].timestamp, kv[0]))
    for rank, failure in failures[:4]:
        if failure.exitcode is not None and failure.exitcode < 0:
            how = f"was killed by signal {failure.signal_name()}"
        else:
            how = f"exited with code {failure.exitcode}"
        part = f"rank {rank} (local_rank {failure.local_rank} on {host}) {how}"
        detail = failure.message if isinstance(failure.message, str) else ""
        if detail and not detail.startswith("To enable traceback"):
            part += f": {detail.strip().splitlines()[-1]}"
        parts.append(part)
    if len(failures) > 4:
        parts.append(f"{len(failures) - 4} more")
    msg = "; ".join(parts)
    if max_restarts:
        msg += f" (after {max_restarts} restart{'s' if max_restarts > 1 else ''})"
    return msg


def _write_error_file(message: str) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}
    try:
        write_private_bytes(Path(path), json.dumps(data).encode())
    except OSError:
        pass


def main(argv: list[str]) -> int:
    plan = NodePlan.from_env()
    base_path = _base_path()
    import torch
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import api as mp_api
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousError
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry
    from torch.distributed.launcher.api import elastic_launch

    args = torchrun.parse_args(_torchrun_argv(argv))
    torch.multiprocessing._set_thread_name("pt_elastic")
    if args.standalone:  # torchrun's own rewrite: one node, a fresh run id
        import uuid

        args.standalone = False
        args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    args.rdzv_backend = "c10d"  # torchrun's checks and messages are those of the c10d path
    args.rdzv_endpoint = f"{plan.store_host}:{plan.store_port}"
    args.nnodes = f"{plan.nnodes}:{plan.nnodes}"  # the client checked the role's replicas against MIN:MAX
    nvml = "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ
    if nvml:  # --nproc_per_node auto|gpu counts devices without initialising CUDA in a forking process
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        config, cmd, cmd_args = torchrun.config_from_args(args)
    finally:
        if nvml:
            os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
    if config.nproc_per_node > (os.cpu_count() or 1):
        print(
            f"torchrun_node: warning: --nproc_per_node {config.nproc_per_node} is more than this host's "
            f"{os.cpu_count()} cores; the workers will share them",
            file=sys.stderr,
            flush=True,
        )
    config.rdzv_backend = BACKEND
    config.rdzv_configs = {**config.rdzv_configs, "node_rank": plan.node_rank}
    config.max_restarts = max(config.max_restarts, plan.restarts)
    try:
        rdzv_registry.handler_registry.register(BACKEND, _make_rendezvous)
    except ValueError:
        pass  # registered by an earlier run in this process (tests)
    if callable(cmd) and args.start_method == "spawn":
        config.start_method = "fork"  # --run-path: the function runs in a fork of this warm process
    mp_api.get_subprocess_handler = _worker_handler_class(base_path)  # the one seam where torch execs a worker
    try:
        elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
    except ChildFailedError as e:
        _write_error_file(_failure_message(e, config.max_restarts))
        print(f"torch.distributed.elastic.multiprocessing.errors.ChildFailedError: {e}", file=sys.stderr, flush=True)
        return 1
    except SignalException as e:  # cancelled: torch's agent stopped the workers; end as the signal says
        signal.signal(e.sigval, signal.SIG_DFL)
        os.kill(os.getpid(), e.sigval)
        return 128 + int(e.sigval)
    except RendezvousClosedError:
        msg = "stopped: the role's workers failed on another host (its torchrun ended the run)"
        _write_error_file(msg)
        print(f"torchrun: {msg}", file=sys.stderr, flush=True)
        return 1
    except RendezvousError as e:
        _write_error_file(str(e))
        print(f"torchrun: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
