"""Peer actor frameworks, measured the same way as our own: Ray, Monarch, raw asyncio TCP.

    .venv/bin/python benchmarks/actors_peers.py {ray,monarch,asyncio} [--calls N] [--skip-spawn]

Run one peer per invocation (run them as separate subprocesses). Prints ONE JSON object on stdout
at the end, with exactly these keys (null where not measured or where the measurement failed;
the reason goes to stderr):

  rtt_ms       median round trip of a trivial call to one actor in another process, over
               --calls calls (default 2000) after 50 warm-up calls.
               ray: ray.get(a.ping.remote());  monarch: a.ping.call_one().get();
               asyncio: a length-prefixed echo over loopback TCP to a server process.
  call8_ms     median over 200 iterations (after 10 warm-up) of calling 8 actors in 8 processes
               and gathering all 8 replies.  ray: ray.get([a.ping.remote() for a in actors]);
               monarch: mesh.ping.call().get() on a ProcMesh of 8 procs on this_host();
               asyncio: 8 echo server processes, send to all then read all.
  tensor_gbps  a 64 MiB torch.uint8 CPU tensor passed as the argument of a call whose endpoint
               returns t.numel(); 64 MiB / median of 5 calls (after 1 warm-up), decimal GB/s.
               asyncio: the tensor's bytes are written to the socket (no pickling) and the
               server replies with the byte count (= numel for uint8).
  spawn8_s     time to spawn 8 new processes that each import torch, with one actor each, until
               the first reply from all 8.  ray: 8 actors whose __init__ imports torch (ray.init
               done beforehand, not counted);  monarch: this_host().spawn_procs(per_host=
               {"procs": 8}) + an actor whose __init__ imports torch + call().get();
               asyncio: 8 `python -c "import torch; <echo server>"` until each answers one echo.
               --skip-spawn leaves it null.

If the peer's package is not importable, prints {"error": "<one line>"} and exits 0.
Everything runs on this host over loopback. Anything a peer (or its child processes) writes to
stdout is redirected to stderr, so stdout carries only the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from typing import Any, Callable

KEYS = ("rtt_ms", "call8_ms", "tensor_gbps", "spawn8_s")
WARMUP = 50
CALL8_ITERS = 200
CALL8_WARMUP = 10
TENSOR_BYTES = 64 * 1024 * 1024
TENSOR_ITERS = 5
N_PROCS = 8
TIMEOUT_S = 120.0


def log(*a: Any) -> None:
    print("[actors_peers]", *a, file=sys.stderr, flush=True)


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def _time_calls(fn: Callable[[], Any], n: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _make_tensor():
    import torch

    return torch.ones(TENSOR_BYTES, dtype=torch.uint8)


def _gbps(samples: list[float]) -> float:
    return TENSOR_BYTES / 1e9 / statistics.median(samples)


def _measure(results: dict[str, float | None], key: str, fn: Callable[[], float]) -> None:
    t0 = time.perf_counter()
    try:
        results[key] = round(float(fn()), 4)
        log(f"{key} = {results[key]}  ({time.perf_counter() - t0:.1f}s)")
    except Exception as e:  # a failed measurement is reported as null
        log(f"{key} failed: {type(e).__name__}: {e}")
        traceback.print_exc(file=sys.stderr)


# --------------------------------------------------------------------------------------------
# asyncio: length-prefixed echo over loopback TCP. Request: !BQ (op, length) + payload.
# op 0 echoes the payload (!Q length + payload); op 1 replies !Q with the payload's length.
# The server (a BufferedProtocol; op 1 payloads are counted, not kept) prints its port on stdout
# and exits when its stdin closes, so it never outlives us.
# --------------------------------------------------------------------------------------------

ECHO_SERVER = r"""
import asyncio, os, socket, struct, sys, threading
def _watch_stdin():
    try:
        sys.stdin.buffer.read()
    finally:
        os._exit(0)
threading.Thread(target=_watch_stdin, daemon=True).start()
HDR = struct.Struct("!BQ")
LEN = struct.Struct("!Q")
class Echo(asyncio.BufferedProtocol):
    def connection_made(self, tr):
        self.tr = tr
        self.mv = memoryview(bytearray(1 << 20))
        self.hdr = bytearray()
        self.op = None
    def get_buffer(self, hint):
        return self.mv
    def buffer_updated(self, n):
        data, i = self.mv[:n], 0
        while i < n or (self.op is not None and self.got == self.need):
            if self.op is None:
                k = min(HDR.size - len(self.hdr), n - i)
                self.hdr += data[i:i + k]
                i += k
                if len(self.hdr) == HDR.size:
                    self.op, self.need = HDR.unpack(self.hdr)
                    self.hdr, self.got, self.body = bytearray(), 0, bytearray()
            else:
                k = min(self.need - self.got, n - i)
                if self.op == 0:
                    self.body += data[i:i + k]
                self.got += k
                i += k
            if self.op is not None and self.got == self.need:
                if self.op == 0:
                    self.tr.write(LEN.pack(self.need) + bytes(self.body))
                else:
                    self.tr.write(LEN.pack(self.got))
                self.op = None
async def main():
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Echo, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()
asyncio.run(main())
"""


class _EchoClient:
    """Client end: non-blocking socket driven by the event loop (sock_sendall / sock_recv_into)."""

    import struct as _struct

    HDR = _struct.Struct("!BQ")
    LEN = _struct.Struct("!Q")

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self._len = memoryview(bytearray(self.LEN.size))

    @classmethod
    async def connect(cls, port: int) -> _EchoClient:
        import socket

        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setblocking(False)
        await asyncio.get_running_loop().sock_connect(s, ("127.0.0.1", port))
        return cls(s)

    async def send(self, payload: Any, op: int = 0) -> None:
        n = memoryview(payload).nbytes
        if n <= 4096:
            await self.loop.sock_sendall(self.sock, self.HDR.pack(op, n) + bytes(payload))
        else:
            await self.loop.sock_sendall(self.sock, self.HDR.pack(op, n))
            await self.loop.sock_sendall(self.sock, payload)

    async def _recv_into(self, mv: memoryview) -> None:
        got = 0
        while got < len(mv):
            k = await self.loop.sock_recv_into(self.sock, mv[got:])
            if not k:
                raise ConnectionError("echo server closed the connection")
            got += k

    async def recv(self, op: int = 0) -> Any:
        await self._recv_into(self._len)
        (n,) = self.LEN.unpack(self._len)
        if op != 0:
            return n
        buf = bytearray(n)
        await self._recv_into(memoryview(buf))
        return bytes(buf)

    async def call(self, payload: Any = b"x", op: int = 0) -> Any:
        await self.send(payload, op)
        return await self.recv(op)

    async def close(self) -> None:
        self.sock.close()


class _Servers:
    """Echo server subprocesses; closing stdin (or killing) stops them."""

    def __init__(self) -> None:
        self.procs: list[asyncio.subprocess.Process] = []

    async def start(self, n: int, import_torch: bool) -> list[int]:
        src = ("import torch\n" if import_torch else "") + ECHO_SERVER
        procs = [
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                src,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            for _ in range(n)
        ]
        self.procs.extend(procs)

        async def port(p: asyncio.subprocess.Process) -> int:
            line = await asyncio.wait_for(p.stdout.readline(), TIMEOUT_S)
            if not line:
                raise RuntimeError(f"echo server {p.pid} exited with {await p.wait()}")
            return int(line)

        return list(await asyncio.gather(*(port(p) for p in procs)))

    async def stop(self) -> None:
        for p in self.procs:
            if p.returncode is None and p.stdin is not None:
                p.stdin.close()
        for p in self.procs:
            try:
                await asyncio.wait_for(p.wait(), 5)
            except asyncio.TimeoutError:
                p.kill()
                await p.wait()
        self.procs = []


async def _asyncio_main(args: argparse.Namespace) -> dict[str, float | None]:
    res: dict[str, float | None] = dict.fromkeys(KEYS)

    async def timed(fn, n: int, warmup: int) -> list[float]:
        for _ in range(warmup):
            await fn()
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            await fn()
            out.append(time.perf_counter() - t0)
        return out

    async def ameasure(key: str, coro_fn) -> None:
        t0 = time.perf_counter()
        try:
            res[key] = round(float(await coro_fn()), 4)
            log(f"{key} = {res[key]}  ({time.perf_counter() - t0:.1f}s)")
        except Exception as e:
            log(f"{key} failed: {type(e).__name__}: {e}")
            traceback.print_exc(file=sys.stderr)

    servers = _Servers()
    clients: list[_EchoClient] = []
    try:
        ports = await servers.start(N_PROCS, import_torch=False)
        clients = [await _EchoClient.connect(p) for p in ports]
        one = clients[0]

        async def rtt() -> float:
            return _median_ms(await timed(one.call, args.calls, WARMUP))

        async def call8() -> float:
            async def fan() -> None:
                for c in clients:
                    await c.send(b"x")
                for c in clients:
                    await c.recv()

            return _median_ms(await timed(fan, CALL8_ITERS, CALL8_WARMUP))

        async def tensor() -> float:
            t = _make_tensor()
            buf = memoryview(t.numpy())

            async def go() -> None:
                n = await one.call(buf, op=1)
                assert n == t.numel(), n

            return _gbps(await timed(go, TENSOR_ITERS, 1))

        await ameasure("rtt_ms", rtt)
        await ameasure("call8_ms", call8)
        await ameasure("tensor_gbps", tensor)
    finally:
        for c in clients:
            await c.close()
        await servers.stop()

    if not args.skip_spawn:

        async def spawn8() -> float:
            torch_servers = _Servers()
            cs: list[_EchoClient] = []
            try:
                t0 = time.perf_counter()
                ports = await torch_servers.start(N_PROCS, import_torch=True)
                cs = [await _EchoClient.connect(p) for p in ports]
                await asyncio.gather(*(c.call() for c in cs))
                return time.perf_counter() - t0
            finally:
                for c in cs:
                    await c.close()
                await torch_servers.stop()

        await ameasure("spawn8_s", spawn8)
    return res


def run_asyncio(args: argparse.Namespace) -> dict[str, float | None]:
    return asyncio.run(_asyncio_main(args))


# --------------------------------------------------------------------------------------------
# Ray
# --------------------------------------------------------------------------------------------


def _wait_pids_gone(pids: list[int], timeout: float = 20.0) -> None:
    """Wait until these (non-child) processes have exited and been reaped by their parent."""
    deadline = time.monotonic() + timeout
    left = list(pids)
    while left and time.monotonic() < deadline:
        left = [p for p in left if os.path.exists(f"/proc/{p}")]
        if left:
            time.sleep(0.05)
    if left:
        log(f"processes still present after {timeout:.0f}s: {left}")


def run_ray(args: argparse.Namespace) -> dict[str, float | None]:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Without this Ray replaces a 127.0.0.1 node address by the host's routable IP
    # (services.resolve_ip_for_localhost); with it, every Ray address is loopback.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    res: dict[str, float | None] = dict.fromkeys(KEYS)

    # num_cpus=0: 8+ actors on a 2-core machine must not wait for CPU resources.
    @ray.remote(num_cpus=0)
    class Echo:
        def ping(self, x: Any = None) -> Any:
            return x

        def pid(self) -> int:
            return os.getpid()

        def numel(self, t: Any) -> int:
            return t.numel()

    @ray.remote(num_cpus=0)
    class TorchEcho:
        def __init__(self) -> None:
            import torch  # noqa: F401

        def ping(self, x: Any = None) -> Any:
            return x

        def pid(self) -> int:
            return os.getpid()

    def kill(actors: list[Any]) -> None:
        # Wait for the actor processes to exit while the raylet (their parent) can still reap
        # them; otherwise they outlive ray.shutdown() (as zombies, here, under a non-reaping init).
        try:
            pids = ray.get([a.pid.remote() for a in actors], timeout=30)
        except Exception:
            pids = []
        for a in actors:
            ray.kill(a)
        _wait_pids_gone(pids)

    t0 = time.perf_counter()
    ray.init(
        address="local",
        num_cpus=os.cpu_count() or 2,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
    )
    log(f"ray.init {time.perf_counter() - t0:.1f}s (not counted)")
    try:
        actors = [Echo.remote() for _ in range(N_PROCS)]
        ray.get([a.ping.remote() for a in actors], timeout=TIMEOUT_S)
        one = actors[0]

        _measure(res, "rtt_ms", lambda: _median_ms(_time_calls(lambda: ray.get(one.ping.remote()), args.calls, WARMUP)))  # noqa: F821
        _measure(
            res,
            "call8_ms",
            lambda: _median_ms(
                _time_calls(lambda: ray.get([a.ping.remote() for a in actors]), CALL8_ITERS, CALL8_WARMUP)  # noqa: F821
            ),
        )

        def tensor() -> float:
            t = _make_tensor()

            def go() -> None:
                n = ray.get(one.numel.remote(t), timeout=TIMEOUT_S)  # noqa: F821
                assert n == t.numel(), n

            return _gbps(_time_calls(go, TENSOR_ITERS, 1))

        _measure(res, "tensor_gbps", tensor)
        kill(actors)
        del actors, one

        if not args.skip_spawn:

            def spawn8() -> float:
                t0 = time.perf_counter()
                ts = [TorchEcho.remote() for _ in range(N_PROCS)]
                ray.get([a.ping.remote() for a in ts], timeout=TIMEOUT_S)
                dt = time.perf_counter() - t0
                kill(ts)
                return dt

            _measure(res, "spawn8_s", spawn8)
    finally:
        ray.shutdown()
    return res


# --------------------------------------------------------------------------------------------
# Monarch (torchmonarch 0.7)
# --------------------------------------------------------------------------------------------


def run_monarch(args: argparse.Namespace) -> dict[str, float | None]:
    from monarch.actor import Actor, endpoint, shutdown_context, this_host

    res: dict[str, float | None] = dict.fromkeys(KEYS)

    # Classes defined here (in __main__) reach the spawned procs by value (cloudpickle).
    class Echo(Actor):
        @endpoint
        def ping(self, x: Any = None) -> Any:
            return x

        @endpoint
        def numel(self, t: Any) -> int:
            return t.numel()

    class TorchEcho(Actor):
        def __init__(self) -> None:
            import torch  # noqa: F401

        @endpoint
        def ping(self, x: Any = None) -> Any:
            return x

    meshes: list[Any] = []

    def stop(pm: Any) -> None:
        try:
            pm.stop().get(timeout=60)
        except Exception as e:
            log(f"monarch proc mesh stop failed: {type(e).__name__}: {e}")
        if pm in meshes:
            meshes.remove(pm)

    try:
        host = this_host()
        pm1 = host.spawn_procs(per_host={"procs": 1}, name="peer1")
        meshes.append(pm1)
        one = pm1.spawn("echo1", Echo)
        one.ping.call_one().get(timeout=TIMEOUT_S)

        pm8 = host.spawn_procs(per_host={"procs": N_PROCS}, name="peer8")
        meshes.append(pm8)
        mesh8 = pm8.spawn("echo8", Echo)
        mesh8.ping.call().get(timeout=TIMEOUT_S)

        _measure(res, "rtt_ms", lambda: _median_ms(_time_calls(lambda: one.ping.call_one().get(), args.calls, WARMUP)))

        def call8() -> float:
            def go() -> None:
                vm = mesh8.ping.call().get()
                assert len(list(vm.values())) == N_PROCS

            return _median_ms(_time_calls(go, CALL8_ITERS, CALL8_WARMUP))

        _measure(res, "call8_ms", call8)

        def tensor() -> float:
            t = _make_tensor()

            def go() -> None:
                n = one.numel.call_one(t).get(timeout=TIMEOUT_S)
                assert n == t.numel(), n

            return _gbps(_time_calls(go, TENSOR_ITERS, 1))

        _measure(res, "tensor_gbps", tensor)
        stop(pm8)
        stop(pm1)

        if not args.skip_spawn:

            def spawn8() -> float:
                t0 = time.perf_counter()
                pm = this_host().spawn_procs(per_host={"procs": N_PROCS}, name="spawn8")
                meshes.append(pm)
                m = pm.spawn("torch_echo", TorchEcho)
                m.ping.call().get(timeout=TIMEOUT_S)
                dt = time.perf_counter() - t0
                stop(pm)
                return dt

            _measure(res, "spawn8_s", spawn8)
    finally:
        for pm in list(meshes):
            stop(pm)
        try:
            shutdown_context().get(timeout=60)
        except Exception as e:
            log(f"monarch shutdown_context failed: {type(e).__name__}: {e}")
    return res


# --------------------------------------------------------------------------------------------

PEERS = {"ray": run_ray, "monarch": run_monarch, "asyncio": run_asyncio}
# What must import for the peer to run (torch for the tensor and spawn measurements).
REQUIRES = {"ray": ["torch", "ray"], "monarch": ["torch", "monarch.actor"], "asyncio": ["torch"]}


def _import_error(peer: str) -> str | None:
    import importlib

    if peer == "ray":
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    for name in REQUIRES[peer]:
        try:
            importlib.import_module(name)
        except Exception as e:  # not only ImportError: a broken native extension counts too
            msg = f"{peer}: cannot import {name}: {type(e).__name__}: {e}"
            return " ".join(msg.split())[:300]
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("peer", choices=sorted(PEERS))
    ap.add_argument("--calls", type=int, default=2000, help="timed rtt calls (default 2000)")
    ap.add_argument("--skip-spawn", action="store_true", help="do not measure spawn8_s")
    args = ap.parse_args()

    # Keep stdout for the one JSON line: the peers' own chatter, and that of every process they
    # start (which inherit fd 1), goes to stderr.
    sys.stdout.flush()
    json_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    t0 = time.perf_counter()
    err = _import_error(args.peer)
    res: dict[str, Any] = {"error": err} if err else PEERS[args.peer](args)
    log(f"{args.peer}: total {time.perf_counter() - t0:.1f}s")
    json_out.write(json.dumps(res) + "\n")
    json_out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
