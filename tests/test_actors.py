"""The actor mesh on a real warm monarch_local pool: adverbs, shapes, ports, supervision, faults."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import monarch_torchx.actor.mesh as mesh_mod
from monarch_torchx import Accumulator, ActorError, Channel, SupervisionError, ValueMesh, attach, this_host
from monarch_torchx.errors import MonarchError
from monarch_torchx.pool import PoolRequest, ensure_pool, stop_pool
from monarch_torchx.registry import Registry
from tests.conftest import module_pool, wait_for
from tests.fixtures.actors import (
    Aborter,
    Bad,
    Blaster,
    BlocksInInit,
    Caller,
    Cleaner,
    CleanupCounter,
    Counter,
    Fatal,
    FlakyOwner,
    Forever,
    Gate,
    KeepsAFinalizer,
    MeshMate,
    MonarchCleaner,
    Owner,
    Placement,
    RemoteSpawner,
    Responder,
    Spawner,
    Store,
    StoreUser,
    Talker,
    Wrapper,
    WrapperMarker,
)

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("test_actors")]  # (its module-wide pool: one worker)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """One warm 2-host pool for the module (each test spawns its own procs on it)."""
    with module_pool(tmp_path_factory, "actors", 2) as p:
        yield p


@pytest.fixture
def procs(pool):
    pm = attach(pool[0]).spawn_procs(per_host={"procs": 2})
    yield pm
    pm.stop().get()


def test_adverbs_values_and_ranks(procs):
    counters = procs.spawn("counter", Counter, 10)
    vm = counters.incr.call(5).get()
    assert isinstance(vm, ValueMesh) and list(vm.values()) == [15] * 4
    assert vm.item(hosts=1, procs=0) == 15
    points = [dict(p) for p, _ in vm.items()]
    assert points == [
        {"hosts": 0, "procs": 0},
        {"hosts": 0, "procs": 1},
        {"hosts": 1, "procs": 0},
        {"hosts": 1, "procs": 1},
    ]
    ranks = [v[1] for v in counters.aget.call().get().values()]  # async endpoint, current_rank()
    assert ranks == points
    assert counters.aget.call().get().item(hosts=0, procs=0)[2] == {"hosts": 2, "procs": 2}
    one = counters.slice(hosts=1, procs=0)
    assert len(one) == 1 and one.incr.call_one(10).get() == 25
    assert counters.slice(hosts=1).sizes == {"procs": 2}
    chosen = [counters.incr.choose(0).get() for _ in range(8)]
    assert set(chosen) <= {15, 25}
    streamed = [f.get()[0] for f in counters.aget.stream()]
    assert sorted(streamed) == [15, 15, 15, 25]
    counters.incr.broadcast(100)  # fire and forget; FIFO: the next call sees it
    assert sorted(counters.incr.call(0).get().values()) == [115, 115, 115, 125]
    total = Accumulator(counters.incr, 0, lambda a, b: a + b).accumulate(0).get()
    assert total == 115 * 3 + 125
    arrived = Accumulator(counters.incr, [], lambda acc, r: acc + [r]).accumulate(0).get()  # folded as they came
    assert sorted(arrived) == [115, 115, 115, 125]


def test_shapes(procs):
    c = procs.spawn("c", Counter)
    assert c.size() == 4 and len(c) == 4 and c.size("procs") == 2 and c.extent == {"hosts": 2, "procs": 2}
    flat = c.flatten("gpu")
    assert flat.sizes == {"gpu": 4}
    assert flat.slice(gpu=slice(1, 3)).size() == 2
    renamed = c.rename(procs="gpus")
    assert renamed.sizes == {"hosts": 2, "gpus": 2}
    ranks = [v[1] for v in renamed.slice(gpus=1).aget.call().get().values()]
    assert ranks == [{"hosts": 0}, {"hosts": 1}]  # current_rank(), as Monarch's: the message's point in the slice
    with pytest.raises(ValueError, match="no dimension 'nodes'"):
        c.slice(nodes=0)
    with pytest.raises(IndexError):
        c.slice(procs=5)
    sub = procs.slice(hosts=0)
    assert sub.spawn("sub", Counter).incr.call().get().extent == {"procs": 2}


def test_fifo_and_async_endpoints(procs):
    c = procs.spawn("c", Counter).slice(hosts=0, procs=1)
    for i in range(200):
        (c.arecord if i % 3 == 0 else c.record).broadcast(i)
    assert c.get_log.call_one().get() == list(range(200))


def test_future_timeout_does_not_consume(procs):
    c = procs.spawn("c", Counter).slice(hosts=0, procs=0)
    fut = c.sleep.call_one(1.0)
    with pytest.raises(TimeoutError):
        fut.get(timeout=0.05)
    assert fut.get(timeout=30) == "slept" and fut.result() == "slept" and fut.exception() is None


def test_await_in_controller(procs):
    import asyncio

    c = procs.spawn("c", Counter, 1)

    async def main():
        vm = await c.incr.call(1)
        one = await c.slice(hosts=0, procs=0).incr.call_one(1)
        return list(vm.values()), one

    assert asyncio.run(main()) == ([2, 2, 2, 2], 3)


def test_actor_error_keeps_actor(procs, faults):
    c = procs.spawn("c", Counter, 0).slice(hosts=0, procs=0)
    fut = c.boom.call_one()
    with pytest.raises(ActorError, match="Counter.boom on proc 0 .* raised ValueError: boom from the actor") as ei:
        fut.get()
    assert "raise ValueError" in ei.value.traceback
    assert isinstance(fut.exception(), ActorError)
    assert c.incr.call_one().get() == 1  # the actor survives
    bad = procs.spawn("bad", Bad)  # returns at once, as Monarch's spawn
    with pytest.raises(ActorError, match="constructor failed"):
        bad.initialized.get(timeout=30)
    with pytest.raises(SupervisionError, match="constructor failed.*never created"):
        bad.slice(hosts=1, procs=1).ping.call_one().get(timeout=30)
    # as in Monarch, each failed constructor is also a supervision event for the spawner
    wait_for(lambda: len(faults) >= 4, timeout=30, what="a fault per failed constructor")
    assert all(
        "The actor" in f.report() and "bad{" in f.report() and "constructor failed" in f.report() for f in faults
    )


def test_tensors_out_of_band(procs):
    c = procs.spawn("c", Counter).slice(hosts=1, procs=1)
    t = torch.arange(1 << 20, dtype=torch.float32).reshape(1024, 1024)
    back = c.echo.call_one(t).get()
    assert torch.equal(back, t)
    for x in (
        t.t(),
        torch.ones(3, dtype=torch.bfloat16),
        torch.empty(0),
        torch.tensor(7),
        torch.ones(2, requires_grad=True),
    ):
        y = c.echo.call_one(x).get()
        assert torch.equal(y.detach(), x.detach()) and y.dtype == x.dtype and y.requires_grad == x.requires_grad


def test_bad_input_errors_at_call_site(procs):
    c = procs.spawn("c", Counter)
    with pytest.raises(TypeError, match="cannot send the arguments of Counter.echo"):
        c.echo.call(threading.Lock())
    with pytest.raises(AttributeError, match="Counter has no endpoint 'nope'"):
        c.nope.call()
    with pytest.raises(AttributeError, match="no endpoint 'not_an_endpoint'"):
        c.not_an_endpoint.call()
    with pytest.raises(ValueError, match="call_one\\(\\) needs a mesh of exactly one actor"):
        c.incr.call_one()
    with pytest.raises(TypeError, match="needs an Actor subclass"):
        procs.spawn("x", dict)
    assert list(c.incr.call().get().values()) == [1, 1, 1, 1]  # nothing was sent by the refused calls


@pytest.mark.parametrize(
    "how,reason",
    [("kill", "killed by signal SIGKILL"), ("segv", "killed by signal SIGSEGV"), ("exit", "exited with code 3")],
)
def test_proc_death_fails_calls_with_reason(procs, how, reason):
    c = procs.spawn("c", Counter)
    victim = c.slice(hosts=1, procs=0)
    slow = victim.asleep.call_one(30)  # pending when the proc dies
    procs.spawn("killer", Counter).slice(hosts=1, procs=0).die.broadcast(how)
    t0 = time.time()
    with pytest.raises(SupervisionError, match=f"proc 2 of mesh .* on host 1 .*{reason}"):
        slow.get(timeout=20)
    assert time.time() - t0 < 10
    with pytest.raises(SupervisionError, match=reason):
        c.incr.call().get(timeout=20)  # the whole mesh call fails, naming the dead proc
    with pytest.raises(SupervisionError):
        victim.incr.call_one().get(timeout=20)  # later calls fail at once
    assert list(c.slice(hosts=0).incr.call().get(timeout=20).values()) == [2, 2]  # the rest still answer
    c.incr.broadcast(10)  # fire and forget over a mesh with a dead proc: no error, the others get it
    assert list(c.slice(hosts=0).incr.call(0).get(timeout=20).values()) == [12, 12]


def test_actor_holds_and_calls_other_meshes(procs):
    counters = procs.slice(hosts=1).spawn("counters", Counter, 0)
    callers = procs.slice(hosts=0, procs=0).spawn("caller", Caller)
    assert callers.call_sync.call_one(counters).get() == [1, 1]
    assert callers.call_async.call_one(counters).get() == [2, 2]
    # a mesh that includes the caller's own proc: reached through its event loop, not a socket
    everywhere = procs.spawn("everywhere", Counter, 0)
    assert callers.call_sync.call_one(everywhere).get() == [1, 1, 1, 1]
    assert callers.call_async.call_one(everywhere).get() == [2, 2, 2, 2]
    # as in Monarch, a sync endpoint may block on any future, an actor of its own proc included:
    # it runs on its actor's thread, not on the proc's event loop
    assert callers.call_sync.call_one(procs.spawn("async_only", Caller)).get(timeout=30) == [0, 0, 0, 0]


def test_procs_sending_each_other_big_payloads_do_not_deadlock(procs):
    b = procs.slice(procs=0).spawn("blaster", Blaster)  # one per host
    t0 = time.time()
    b.blast.call(b, 4, 32).get(timeout=60)  # each sends 4 x 32 MiB to both, at the same time
    expect = 2 * 4 * (32 << 18)
    wait_for(lambda: list(b.received.call().get().values()) == [expect, expect], timeout=60, what="all bytes")
    assert time.time() - t0 < 60


def test_channels(procs, pool):
    c = procs.spawn("c", Counter)
    port, rx = Channel.open()
    c.send_rank.broadcast(port)
    assert sorted(rx.recv().get(timeout=20) for _ in range(4)) == [0, 1, 2, 3]
    # a port opened inside an actor, fed by other actors
    caller = procs.slice(hosts=0, procs=0).spawn("caller", Caller)
    back, back_rx = Channel.open()
    result = caller.inbox.call_one(4, back)
    inner_port = back_rx.recv().get(timeout=20)
    c.send_rank.broadcast(inner_port)
    assert result.get(timeout=20) == [0, 1, 2, 3]


def test_supervise_hook(procs, faults):
    handled = procs.slice(hosts=0, procs=0).spawn("owner", Owner, True)
    os.kill(handled.child_pid.call_one().get(), signal.SIGKILL)
    seen = wait_for(lambda: handled.failures_seen.call_one().get(), timeout=20, what="__supervise__")
    assert "killed by signal SIGKILL" in seen[0]
    assert handled.ping.call_one().get() == "pong"  # handled: the owner lives on
    unhandled = procs.slice(hosts=1, procs=0).spawn("owner", Owner, False)
    os.kill(unhandled.child_pid.call_one().get(), signal.SIGKILL)

    def failed():
        try:
            unhandled.ping.call_one().get()
            return False
        except SupervisionError as e:
            return str(e)

    lingering = unhandled.linger.call_one(10)  # in flight while the owner fails: it fails too (Monarch's)
    msg = wait_for(failed, timeout=20, what="owner to fail")
    assert "a mesh it owns lost a proc" in msg and "SIGKILL" in msg
    with pytest.raises(SupervisionError, match="a mesh it owns lost a proc"):
        lingering.get(timeout=30)
    # unhandled, the event goes up to the owner's own owner (here the controller), naming the leaf
    wait_for(lambda: faults, timeout=20, what="the controller's fault hook")
    report = faults[0].report()
    assert "The actor child{'procs': 0/1} and all its descendants have failed" in report, report
    assert "the process this actor was running on failed: Killed(sig=9)" in report, report


def test_cleanup_on_stop(pool, tmp_path):
    pm = attach(pool[0]).spawn_procs(per_host={"procs": 1})
    cl = pm.spawn("cleaner", Cleaner, str(tmp_path / "clean"))
    assert list(cl.ping.call().get().values()) == ["pong", "pong"]
    pm.stop().get()
    with pytest.raises(RuntimeError, match="`ProcMesh` has already been stopped"):
        pm.spawn("late", Cleaner, str(tmp_path / "late"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clean.0", "clean.1"]
    with pytest.raises(SupervisionError, match="was stopped"):
        cl.ping.call().get()


def test_module_globals_are_finalized_when_a_proc_stops(pool, tmp_path):
    """As a real interpreter's exit does (Monarch's procs run Py_FinalizeEx): an object held in a
    module global of the actor's code has its __del__ run when the proc stops."""
    pm = attach(pool[0]).spawn_procs(per_host={"procs": 1})
    keeper = pm.spawn("keeper", KeepsAFinalizer, str(tmp_path / "marker"))
    pids = list(keeper.pid.call().get().values())
    assert os.getpid() not in pids
    pm.stop().get()
    wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in pids), what="the procs to exit")
    assert sorted((p.name, p.read_text()) for p in tmp_path.iterdir()) == [
        ("marker.0", "finalized"),
        ("marker.1", "finalized"),
    ]


def test_proc_bind_pins_each_proc_as_taskset_and_numactl_would(pool):
    """Monarch's spawn_procs(proc_bind=[...]): one dict per proc of a host; the forked procs pin
    themselves (CPU lists, NUMA nodes' CPUs); bad binds are refused before anything starts."""
    host = attach(pool[0])
    with pytest.raises(ValueError, match=r"proc_bind length \(1\) must equal procs_per_host \(2\)"):
        host.spawn_procs(per_host={"gpus": 2}, proc_bind=[{"cpus": "0"}])
    with pytest.raises(ValueError, match="unknown keys \\['cores'\\]"):
        host.spawn_procs(per_host={"gpus": 1}, proc_bind=[{"cores": "0"}])
    with pytest.raises(ValueError, match="bad CPU or node list 'zero'"):
        host.spawn_procs(per_host={"gpus": 1}, proc_bind=[{"cpus": "zero"}])
    available = sorted(os.sched_getaffinity(0))
    if len(available) < 2:
        pytest.skip("needs 2 CPUs")
    a, b = available[:2]
    pm = host.spawn_procs(per_host={"gpus": 2}, proc_bind=[{"cpus": str(a)}, {"cpus": str(b)}])
    got = pm.spawn("where", Placement).cpus.call().get(timeout=30)
    assert list(got.values()) == [[a], [b], [a], [b]]  # in rank order: host-major, then gpus
    pm.stop().get()
    if os.path.exists("/sys/devices/system/node/node0/cpulist"):
        from monarch_torchx.actor.placement import node_cpus

        pm = host.slice(hosts=0).spawn_procs(per_host={"gpus": 1}, proc_bind=[{"cpunodebind": "0", "membind": "0"}])
        assert set(pm.spawn("where", Placement).cpus.call_one().get(timeout=30)) == node_cpus({0})
        pm.stop().get()
    with pytest.raises(Exception, match="NUMA node 999 does not exist"):
        host.slice(hosts=0).spawn_procs(per_host={"gpus": 1}, proc_bind=[{"cpunodebind": "999"}])


def test_with_python_executable_runs_procs_under_it_and_their_this_host_too(pool, tmp_path):
    """Monarch's HostMesh.with_python_executable: the procs are exec'd under that interpreter
    (here a wrapper script that stamps its pid), and so are the procs their actors spawn."""
    wrapper = tmp_path / "python-wrapper"
    wrapper.write_text(f'#!/bin/sh\nexport WRAPPER_PID=$$\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o700)
    host = attach(pool[0]).slice(hosts=0)
    with pytest.raises(ValueError, match="needs the path of a Python executable"):
        host.with_python_executable("")
    wrapped = host.with_python_executable(str(wrapper)).spawn_procs(per_host={"procs": 1})
    am = wrapped.spawn("marker", WrapperMarker)
    outer = am.wrapper_pid.call_one().get(timeout=60)
    inner = am.spawn_inner.call_one().get(timeout=60).wrapper_pid.call_one().get(timeout=60)
    assert outer and inner and outer != inner
    plain = host.spawn_procs(per_host={"procs": 1})
    assert plain.spawn("plain", WrapperMarker).wrapper_pid.call_one().get(timeout=30) == ""  # still warm forks
    wrapped.stop().get()
    plain.stop().get()
    with pytest.raises(MonarchError, match="no such executable on host 0"):
        host.with_python_executable(str(tmp_path / "missing")).spawn_procs(per_host={"procs": 1})


def test_stop_is_a_future_as_in_monarch(pool, tmp_path):
    """ProcMesh.stop() tells the procs at once and returns a Future[None] (Monarch's shape):
    awaited in asyncio, or `async with procs:`; cleanups have run once it completes."""
    import asyncio

    from monarch_torchx.actor.future import Future

    async def main() -> None:
        pm = attach(pool[0]).spawn_procs(per_host={"procs": 1})
        pm.spawn("cleaner", Cleaner, str(tmp_path / "a"))
        stopping = pm.stop()
        assert isinstance(stopping, Future)
        assert await stopping is None
        async with attach(pool[0]).spawn_procs(per_host={"procs": 1}) as pm2:
            pm2.spawn("cleaner", Cleaner, str(tmp_path / "b"))
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a.0", "a.1", "b.0", "b.1"]

    asyncio.run(main())


def test_monarch_cleanup_signature_supervision_error_and_value_mesh_views(pool, tmp_path):
    """Monarch's `__cleanup__(self, exc)` is called (exc None on a stop); SupervisionError is a
    RuntimeError; ValueMesh.slice/flatten give views of the answers by coordinates."""
    from monarch_torchx.actor.shape import Shape

    pm = attach(pool[0]).spawn_procs(per_host={"procs": 1})
    pm.spawn("c", MonarchCleaner, str(tmp_path / "m"))
    pm.stop().get()
    assert [(tmp_path / f"m.{r}").read_text() for r in (0, 1)] == ["None", "None"]
    assert issubclass(SupervisionError, RuntimeError)
    vm = ValueMesh(Shape.dense(("hosts", "gpus"), (2, 3)), list(range(6)))
    assert list(vm.slice(hosts=1).values()) == [3, 4, 5] and vm.slice(hosts=1).extent.labels == ["gpus"]
    assert vm.slice(gpus=slice(1, 3)).item(hosts=0, gpus=1) == 2
    flat = vm.flatten("rank")
    assert flat.extent.labels == ["rank"] and flat.item(rank=4) == 4


def test_a_base_exception_in_an_endpoint_fails_the_actor(procs, faults):
    """SystemExit or KeyboardInterrupt from an endpoint (sync or async) fails the actor, as in
    Monarch: the call gets SupervisionError in Monarch's words (it never hangs, the proc's
    connection stays up), later calls to it say so, the owner gets a supervision event, and the
    proc's other actors go on."""
    a = procs.spawn("fa", Fatal)
    b = procs.spawn("fb", Fatal)
    with pytest.raises(
        SupervisionError,
        match=r"Endpoint call fa.exit_sync\(\) failed, The actor "
        r"tests.fixtures.actors.Fatal fa\{'hosts': 0/2, 'procs': 0/2\} and all its descendants have "
        r"failed:\n.*SystemExit",
    ):
        a.exit_sync.call().get(timeout=30)
    with pytest.raises(SupervisionError, match="has failed"):
        a.ping.call().get(timeout=30)
    with pytest.raises(SupervisionError, match="KeyboardInterrupt"):
        b.slice(hosts=0, procs=0).interrupt_async.call_one().get(timeout=30)
    wait_for(lambda: len(faults) >= 5, timeout=30, what="a fault per failed actor")
    assert b.slice(hosts=1, procs=0).ping.call_one().get(timeout=30) == "pong"
    assert list(procs.spawn("fc", Fatal).ping.call().get(timeout=30).values()) == ["pong"] * len(procs._shape.ranks)


def test_actor_mesh_stop_stops_the_actors_not_their_procs(procs, tmp_path):
    """ActorMesh.stop() (Monarch's): queued calls run, then __cleanup__, then later calls are
    refused; the procs and their other actors serve on."""
    c = procs.spawn("ca", Counter)
    keep = procs.spawn("cb", Counter)
    cl = procs.spawn("cl", Cleaner, str(tmp_path / "s"))
    for _ in range(3):
        c.incr.broadcast(1)
    stopping = c.stop()
    assert stopping.get(timeout=30) is None
    assert cl.stop().get(timeout=30) is None
    assert len(list(tmp_path.iterdir())) == len(procs._shape.ranks)  # each cleaner's __cleanup__ ran
    with pytest.raises(SupervisionError, match="stopped"):
        c.incr.call(1).get(timeout=30)
    assert set(keep.incr.call(2).get(timeout=30).values()) == {2}


def test_a_blocking_constructor_holds_only_its_own_actor(procs, tmp_path):
    """As in Monarch, an actor with async endpoints runs on a loop of its own thread: its
    constructor blocking (here until a file appears) never holds the other actors of its proc."""
    one = procs.slice(hosts=0, procs=0)
    other = one.spawn("other", Counter, 5)
    release = tmp_path / "release"
    blocked = one.spawn("blocked", BlocksInInit, str(release))
    assert other.aget.call_one().get(timeout=30)[0] == 5  # answered while that constructor blocks
    assert other.incr.call_one(1).get(timeout=30) == 6
    pending = blocked.where.call_one()  # waits for the constructor, as any call to it
    assert not pending.done()
    release.touch()
    # __init__ used the running loop (a task it made ran there) and set thread-local state its
    # endpoints see: both run on the actor's thread
    assert pending.get(timeout=30) == (True, True, "ran")


def test_message_rank_is_the_point_in_the_slice_a_message_was_sent_to(procs, monkeypatch):
    """context().message_rank (and current_rank()), as Monarch's: an actor's point in the slice of
    its mesh that the running message was sent to; actor_instance.rank stays where it was spawned.
    By direct calls, then through the multicast tree (a tree for meshes of 2 and more)."""
    r = procs.spawn("ranks", Placement)
    whole = r.ranks.call().get(timeout=30)
    assert [v["message"] for v in whole.values()] == [v["actor"] for v in whole.values()]
    assert whole.item(hosts=1, procs=0)["message"] == {"hosts": 1, "procs": 0}
    for tree in (False, True):
        if tree:
            monkeypatch.setattr(mesh_mod, "TREE_MIN", 2)
            monkeypatch.setattr(mesh_mod, "FANOUT", 2)
            r = procs.spawn("ranks_by_tree", Placement)
        sliced = r.slice(procs=1).ranks.call().get(timeout=30)
        assert [v["message"] for v in sliced.values()] == [{"hosts": 0}, {"hosts": 1}]
        assert [v["actor"] for v in sliced.values()] == [{"hosts": 0, "procs": 1}, {"hosts": 1, "procs": 1}]
        assert [v["size"] for v in sliced.values()] == [{"hosts": 2}, {"hosts": 2}]
    one = r.slice(hosts=1, procs=0).ranks.call_one().get(timeout=30)
    assert one == {"message": {}, "actor": {"hosts": 1, "procs": 0}, "size": {}}


def test_explicit_response_ports_and_port_exceptions(procs):
    """@endpoint(explicit_response_port=True) answers through the port it is given (sync or
    async; the return value is ignored); port.exception(e) fails the call, and on a channel port
    makes the receiver's recv() raise (as Monarch's Port.exception)."""
    from monarch_torchx.actor import endpoint

    r = procs.spawn("r", Responder)
    assert list(r.double.call(21).get(timeout=30).values()) == [42] * len(procs._shape.ranks)
    assert r.slice(hosts=0, procs=1).later.call_one(1).get(timeout=30) == 2
    with pytest.raises(ActorError, match="nope"):
        r.slice(hosts=1, procs=0).refuse.call_one().get(timeout=30)
    port, rx = Channel.open()
    r.slice(hosts=0, procs=0).fail_through.broadcast(port)
    with pytest.raises(ActorError, match="KeyError"):
        rx.recv().get(timeout=30)
    with pytest.raises(NotImplementedError, match="propagate"):
        endpoint(propagate=lambda x: x)


def test_this_proc_in_an_actor_and_in_the_controller(procs):
    """this_proc() (Monarch's): in an actor, its own proc (a child spawned there runs in the
    same process); in the controller, the controller's own proc: its actors run in this very
    process (sync endpoints on their own threads), and, spawned from there, on its pool."""
    from monarch_torchx.actor import context, this_proc

    s = procs.spawn("sp", Spawner).slice(hosts=1, procs=0)
    value, child_pid, my_pid = s.child.call_one().get(timeout=60)
    assert value == 6 and child_pid == my_pid
    mine = this_proc()
    assert mine.sizes == {} and this_proc() is mine
    c = mine.spawn("c", Counter, 1)
    assert c.incr.call_one(1).get(timeout=30) == 2
    assert c.pid.call_one().get(timeout=30) == os.getpid()
    assert str(context().actor_instance) == "<root>"  # the controller's own code is not in an actor
    inner = mine.spawn("sp", Spawner)
    value, child_pid, my_pid = inner.child.call_one().get(timeout=60)
    assert value == 6 and child_pid == my_pid == os.getpid()
    remote = mine.spawn("rs", RemoteSpawner).pids.call_one(attach(procs.pool)).get(timeout=60)
    assert len(remote) == 2 and os.getpid() not in remote
    mine.stop().get()
    with pytest.raises(SupervisionError, match="stopped"):
        c.incr.call_one(1).get(timeout=30)
    again = this_proc()  # a new one: the stopped one is not handed out
    assert again is not mine and again.spawn("c", Counter, 3).incr.call_one(1).get(timeout=30) == 4
    slow = again.spawn("slow", Counter).sleep.call_one(2.0)  # in flight as the proc is let go:
    from monarch_torchx.actor import shutdown_context

    shutdown_context().get(timeout=60)
    with pytest.raises(SupervisionError):  # it fails, it does not hang
        slow.get(timeout=30)


def test_smaller_monarch_apis(procs, home, pool_name):
    """current_actor_name(), Channel.open(once=True), ProcMesh.initialized, is_ibverbs_available(),
    HostMesh.stream_logs / is_fake_in_process, HostMesh.shutdown() (stops the pool) as in Monarch."""
    from monarch_torchx.actor import current_actor_name
    from monarch_torchx.rdma import is_ibverbs_available

    assert current_actor_name() == "client"
    c = procs.spawn("named", Counter)
    assert procs.initialized.get(timeout=1) is True
    port, rx = Channel.open(once=True)
    c.slice(hosts=0, procs=0).send_rank.broadcast(port)
    c.slice(hosts=1, procs=1).send_rank.broadcast(port)
    first = rx.recv().get(timeout=30)
    assert first in (0, 3)
    with pytest.raises(TimeoutError):
        rx.recv().get(timeout=1)  # a once-port takes one value
    assert isinstance(is_ibverbs_available(), bool)
    ensure_pool(PoolRequest("monarch_local", pool_name, {"hosts": 1, "preload": ""}))
    hosts = attach(pool_name)
    assert (hosts.stream_logs, hosts.is_fake_in_process) == (False, False)  # Monarch's HostMesh flags
    attach(pool_name).shutdown().get(timeout=60)
    assert Registry().get(pool_name) is None


def test_answers_written_by_the_actors_thread_and_the_loop_stay_whole_and_matched(procs, monkeypatch):
    """A sync endpoint's answer is written by its actor's thread, straight to the socket when
    nothing waits ahead of it, else queued for the loop; an async endpoint's by the loop. Far
    more answers than the socket holds, from both, while this caller does not read for a while:
    every frame arrives whole, each answer to its own call."""
    from monarch_torchx.actor import hub as hub_mod

    read = hub_mod.Conn.on_readable
    stalled = []

    def slow_reader(conn):  # the first read waits: the proc's socket fills meanwhile
        if not stalled:
            stalled.append(1)
            time.sleep(1.0)
        read(conn)

    sync_one = procs.spawn("echoes", Counter).slice(hosts=0, procs=1)  # only its sync endpoint is called
    async_one = procs.spawn("agets", Counter).slice(hosts=0, procs=1)  # the same proc: one connection
    sync_one.blob.call_one(0, 1).get(timeout=30)
    async_one.aget.call_one().get(timeout=30)
    monkeypatch.setattr(hub_mod.Conn, "on_readable", slow_reader)
    futs = []
    for i in range(1500):
        if i % 10 == 0:
            futs.append(("aget", async_one.aget.call_one()))
        else:
            futs.append((i, sync_one.blob.call_one(i, 60_000)))  # small calls, answers of 60 kB
    for key, fut in futs:
        got = fut.get(timeout=120)
        if key == "aget":
            assert got[0] == 0
        else:
            assert got == (key, bytes([key % 251]) * 60_000)


def test_a_failing_broadcast_is_a_supervision_event(procs, monkeypatch):
    """As in Monarch: an endpoint called by broadcast that raises fails the actor (later calls
    get SupervisionError). Its owner hears of it: a controller through unhandled_fault_hook (the
    default would end it with exit code 1), an owning actor through __supervise__."""
    import monarch_torchx.actor as actor_pkg

    seen = []
    monkeypatch.setattr(actor_pkg, "unhandled_fault_hook", seen.append)
    c = procs.spawn("flaky", Counter)
    one = c.slice(hosts=0, procs=1)
    one.boom.broadcast()
    with pytest.raises(SupervisionError, match="boom from the actor.*has failed"):
        one.incr.call_one().get(timeout=30)
    wait_for(
        lambda: seen or c.slice(hosts=1, procs=0).incr.call_one().get(timeout=30) and seen,
        timeout=30,
        what="the controller's fault hook",
    )
    assert seen[0].mesh_name == "flaky" and seen[0].rank == 1 and "boom from the actor" in seen[0].report()
    assert c.slice(hosts=1, procs=0).incr.call_one().get(timeout=30) >= 1  # the others serve on
    owner = procs.spawn("owner", FlakyOwner).slice(hosts=1, procs=1)
    owner.break_child.call_one().get(timeout=30)
    msgs = wait_for(lambda: owner.seen.call_one().get(timeout=30), timeout=30, what="__supervise__")
    assert msgs[0].startswith("flaky_child:") and "boom" in msgs[0]
    assert not seen[1:]  # handled by the owning actor: the controller heard nothing more


def test_send_with_a_port_and_a_selection(procs):
    """Monarch's send(endpoint, args, kwargs, port=, selection=): every actor's answer (or its
    error) goes to the port; "choose" sends to one actor; without a port it is fire and forget."""
    from monarch_torchx.actor import send

    c = procs.spawn("sc", Counter, 10)
    port, rx = Channel.open()
    send(c.incr, (1,), port=port)
    assert sorted(rx.recv().get(timeout=30) for _ in range(4)) == [11] * 4
    send(c.incr, (), {"by": 5}, port=port, selection="choose")
    assert rx.recv().get(timeout=30) == 16
    pending = rx.recv()
    with pytest.raises(TimeoutError):
        pending.get(timeout=0.5)  # one actor only (the future stays pending: it takes the next value)
    bad = c.slice(hosts=0, procs=0)
    send(bad.incr, ("not an int",), port=port)
    with pytest.raises(ActorError, match="TypeError"):
        pending.get(timeout=30)
    with pytest.raises(ValueError, match="selection"):
        send(c.incr, (), selection="some")


def test_concurrent_endpoints_run_beside_each_other(procs):
    """@concurrent_endpoint (Monarch's): a call that waits does not hold up the next one."""
    g = procs.spawn("gate", Gate).slice(hosts=0, procs=0)
    waiting = g.wait_open.call_one()
    g.open.call_one().get(timeout=30)
    assert waiting.get(timeout=30) == "through"


def test_abort_proc_and_bootstrap(pool, procs, monkeypatch):
    """actor_instance.abort() fails the actor with a supervision event; actor_instance.proc is its
    own proc; spawn_procs(bootstrap=fn) runs fn in every proc first, and a failing one fails it."""
    import monarch_torchx.actor as actor_pkg
    from tests.fixtures.actors import failing_bootstrap, mark_env

    seen = []
    monkeypatch.setattr(actor_pkg, "unhandled_fault_hook", seen.append)
    a = procs.spawn("ab", Aborter).slice(hosts=0, procs=0)
    assert a.proc_sizes.call_one().get(timeout=30) == {}
    from monarch_torchx.actor.errors import ActorAborted

    try:  # as in Monarch, the aborting call itself may be answered first, or fail with the actor
        a.quit.call_one().get(timeout=30)
    except ActorAborted:
        pass
    with pytest.raises(ActorAborted, match="aborted due to: giving up"):
        a.proc_sizes.call_one().get(timeout=30)
    assert seen and "giving up" in seen[0].report()
    hosts = attach(pool[0])
    booted = hosts.spawn_procs(per_host={"procs": 1}, bootstrap=mark_env)
    try:
        assert set(booted.spawn("c", Counter).env.call("BOOTSTRAPPED").get(timeout=30).values()) == {"yes"}
    finally:
        booted.stop().get()
    before = len(seen)
    broken = hosts.spawn_procs(per_host={"procs": 1}, bootstrap=failing_bootstrap)  # returns at once (Monarch's)
    with pytest.raises(ActorError, match="bootstrap broke"):
        broken.initialized.get(timeout=60)
    assert len(seen) == before  # the bootstrap's failure is initialized's error, not a supervision event


def test_concurrent_endpoint_rules_and_an_escaping_explicit_port(procs, monkeypatch):
    """As in Monarch: @concurrent_endpoint wraps only async methods, never an @endpoint; an
    explicit-response-port endpoint that raises instead of answering fails its actor."""
    import monarch_torchx.actor as actor_pkg
    from monarch_torchx.actor import concurrent_endpoint, endpoint

    with pytest.raises(ValueError, match="can only wrap async endpoints"):
        concurrent_endpoint(lambda self: None)
    with pytest.raises(ValueError, match="does not wrap @endpoint"):
        concurrent_endpoint(endpoint(Counter.incr.fn))
    monkeypatch.setattr(actor_pkg, "unhandled_fault_hook", lambda failure: None)
    r = procs.spawn("esc", Responder).slice(hosts=0, procs=0)
    with pytest.raises(SupervisionError, match="instead of answering through its response port"):
        r.escape.call_one().get(timeout=30)
    with pytest.raises(SupervisionError):
        r.double.call_one(1).get(timeout=30)


def test_actor_mesh_on_a_tls_pool(home, pool_name):
    """The hub, the procs and the controller's inbox over TLS (a pool that spans machines has it
    by default; here a local one asks for it; the rdma data plane over TLS is tested on SLURM)."""
    ensure_pool(PoolRequest("monarch_local", pool_name, {"hosts": 2, "preload": "", "tls": True}))
    assert Registry().require(pool_name).tls_pem
    pm = attach(pool_name).spawn_procs(per_host={"procs": 2})
    try:
        c = pm.spawn("c", Counter)
        for _ in range(20):
            assert set(c.incr.call(1).get(timeout=30).values()) == {_ + 1}
        port, rx = Channel.open()
        c.send_rank.broadcast(port)
        assert sorted(rx.recv().get(timeout=30) for _ in range(4)) == [0, 1, 2, 3]
        t = torch.arange(1 << 20, dtype=torch.uint8)
        assert torch.equal(c.slice(hosts=1, procs=1).echo.call_one(t).get(timeout=30), t)  # large frames over TLS
    finally:
        pm.stop().get()


def test_procs_ring_their_agent_and_are_found_by_looking_where_no_bell_fits(home, tmp_path, monkeypatch):
    """A proc that listens rings its agent's bell, a private socket in the agent's private
    directory, so the spawn wakes at once; where that socket's path would not fit a Unix
    address (a long temp directory), the agent looks for the procs' files instead."""
    import glob
    import stat

    for name, tmp in (("short", None), ("long", tmp_path / ("t" * 60) / ("m" * 40))):
        if tmp is not None:
            tmp.mkdir(parents=True, mode=0o700)
            monkeypatch.setenv("TMPDIR", str(tmp))
        pool = f"bell{name}{os.getpid()}"
        ensure_pool(PoolRequest("monarch_local", pool, {"hosts": 1, "preload": ""}))
        pm = attach(pool).spawn_procs(per_host={"procs": 3})
        try:
            assert sorted(pm.spawn("c", Counter).incr.call(1).get(timeout=30).values()) == [1, 1, 1]
        finally:
            pm.stop().get()
        rendezvous = glob.glob(
            os.path.join(str(tmp or tempfile.gettempdir()), f"monarch_torchx-{os.getuid()}", "procs", f"{pool}-*")
        )
        assert len(rendezvous) == 1  # the agent's own directory, in that temp directory
        bells = glob.glob(os.path.join(rendezvous[0], "bell"))
        if tmp is None:
            assert len(bells) == 1 and stat.S_ISSOCK(os.stat(bells[0]).st_mode)
            assert stat.S_IMODE(os.stat(bells[0]).st_mode) == 0o600
        else:
            assert bells == []  # no bell: the spawn above found its procs by looking
        stop_pool(pool)


def test_tree_multicast_keeps_order(procs, monkeypatch):
    monkeypatch.setattr(mesh_mod, "TREE_MIN", 2)
    monkeypatch.setattr(mesh_mod, "FANOUT", 2)
    big = attach(procs.pool).spawn_procs(per_host={"procs": 3})
    try:
        c = big.spawn("c", Counter)
        assert list(c.incr.call(1).get().values()) == [1] * 6
        one = c.slice(hosts=1, procs=2)
        for i in range(30):  # tree-routed broadcasts interleaved with direct calls stay in order
            c.record.broadcast(("tree", i))
            one.record.call_one(("direct", i)).get() if i % 2 else one.record.broadcast(("direct", i))
        log = one.get_log.call_one().get()
        assert log == [x for i in range(30) for x in (("tree", i), ("direct", i))]
        assert [f.get() for f in c.incr.stream(1)] and sorted(c.incr.call(0).get().values()) == [2] * 6
    finally:
        big.stop().get()


def test_spawn_on_stopped_pool(tmp_path, monkeypatch, home, pool_name):
    ensure_pool(PoolRequest("monarch_local", pool_name, {"hosts": 1, "preload": ""}))
    hosts = attach(pool_name)
    stop_pool(pool_name)
    with pytest.raises(MonarchError, match=f"no pool named '{pool_name}'"):
        attach(pool_name)
    with pytest.raises(MonarchError, match="not reachable .* is the pool still running"):
        hosts.spawn_procs()
    ensure_pool(PoolRequest("monarch_local", pool_name, {"hosts": 1, "preload": ""}))  # same name, new secret
    with pytest.raises(MonarchError, match="not reachable .* is the pool still running"):
        hosts.spawn_procs()  # the old handle's agent is gone
    assert list(attach(pool_name).spawn_procs().spawn("c", Counter).incr.call().get().values()) == [1]


CONTROLLER = textwrap.dedent("""
    import os, sys
    from monarch_torchx import Actor, endpoint, attach

    class Local(Actor):          # defined in __main__: travels by value (cloudpickle)
        @endpoint
        def pid(self):
            return os.getpid()

    procs = attach(sys.argv[1]).spawn_procs(per_host={"procs": 2})
    print(*procs.spawn("local", Local).pid.call().get().values(), flush=True)
    sys.stdin.readline()
    os._exit(0) if sys.argv[2] == "exit" else os.kill(os.getpid(), 9)
""")


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_controller_exit_cleans_up_procs(pool, tmp_path, how):
    script = tmp_path / "controller.py"
    script.write_text(CONTROLLER)
    env = {**os.environ, "MONARCH_TORCHX_HOME": str(pool[1])}
    p = subprocess.Popen(
        [sys.executable, str(script), pool[0], how],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = p.stdout.readline()
    pids = [int(x) for x in line.split()]
    assert len(pids) == 4, p.stderr.read()
    assert all(Path(f"/proc/{pid}").exists() for pid in pids)
    p.stdin.write("\n")
    p.stdin.flush()
    p.wait(timeout=30)
    wait_for(
        lambda: not any(Path(f"/proc/{pid}").exists() and "Z" not in _state(pid) for pid in pids),
        timeout=20,
        what="procs to exit after their controller",
    )
    # the pool stays warm
    assert list(attach(pool[0]).spawn_procs().spawn("c", Counter).incr.call().get().values()) == [1, 1]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
    except OSError:
        return "Z"


def test_this_host_is_a_warm_local_pool(home):
    h = this_host()
    assert h.sizes == {}  # as Monarch's: no dims, so per_host names them all
    pm = h.spawn_procs(per_host={"gpus": 2})
    assert pm.sizes == {"gpus": 2}
    assert this_host().spawn_procs(per_host={"hosts": 1, "gpus": 1}).sizes == {"hosts": 1, "gpus": 1}
    assert list(pm.spawn("c", Counter).incr.call().get().values()) == [1, 1]
    pm.stop().get()
    assert this_host().pool == h.pool and Registry().get("local") is not None


def test_this_host_says_once_which_pool_it_picked(home, tmp_path):
    """A controller that names no pool gets the warm pool `local`, which outlives it (Monarch's
    local procs end with the script): one line says so, once per process, with how to end it and
    how to pick another; naming the pool ($MONARCH_TORCHX_LOCAL_POOL) silences it."""
    script = tmp_path / "controller.py"
    script.write_text("from monarch_torchx import this_host\nthis_host(); this_host()\nprint('ok')\n")

    def run(**env):
        res = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "MONARCH_TORCHX_HOME": str(home), **env},
        )
        assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr
        return [ln for ln in res.stderr.splitlines() if "this_host()" in ln]

    first = run()
    assert len(first) == 1 and "warm monarch_local pool 'local' (created now;" in first[0], first
    assert "`monarch-torchx pool stop local` ends it" in first[0] and "MONARCH_TORCHX_LOCAL_POOL=NAME" in first[0]
    assert run(MONARCH_TORCHX_LOCAL_POOL="local") == []
    again = run()
    assert len(again) == 1 and "'local' (reused;" in again[0], again


@pytest.mark.parametrize(
    "example,args,expect",
    [
        ("actors_pingpong.py", ["--volleys", "50"], "50 volleys between two procs"),
        ("actors_ddp.py", ["--procs", "2", "--steps", "3"], "replicas in sync: True"),
        ("actors_rl.py", ["--generators", "2", "--rounds", "2"], "policy v2"),
    ],
)
def test_examples_run(pool, example, args, expect):
    """The examples' actor classes live in their __main__: they reach the procs by value."""
    env = {**os.environ, "MONARCH_TORCHX_HOME": str(pool[1])}
    res = subprocess.run(
        [sys.executable, str(REPO / "examples" / example), "--pool", pool[0], *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0 and expect in res.stdout, res.stdout + res.stderr


def test_actor_output_is_in_telemetry(procs, pool):
    from monarch_torchx.pool import attach as attach_pool
    from monarch_torchx.telemetry import sql

    c = procs.spawn("c", Counter)
    c.say.call("hello from an actor").get()
    query = f"SELECT host, replica, line FROM logs WHERE app_id = 'mesh-{procs.mesh_id}' AND line LIKE 'hello%'"

    def rows():
        res = sql(attach_pool(pool[0]), query)
        return res.to_pylist() if res.num_rows == 4 else None

    got = wait_for(rows, timeout=30, interval=0.5, what="actor output in the logs table")
    assert sorted((r["host"], r["replica"]) for r in got) == [(0, 0), (0, 1), (1, 2), (1, 3)]


def test_a_dead_proc_of_the_controller_and_an_idle_controller_get_the_fault(procs, monkeypatch):
    """As in Monarch: a proc the controller owns dying is a supervision event for the controller's
    unhandled_fault_hook, and events reach the hook while the controller waits on nothing of ours
    (here a threading.Event; the hub's idle reader reads)."""
    import monarch_torchx.actor as actor_pkg

    seen, arrived = [], threading.Event()

    def hook(failure):
        seen.append(failure)
        arrived.set()

    monkeypatch.setattr(actor_pkg, "unhandled_fault_hook", hook)
    c = procs.spawn("idle", Counter)
    c.slice(hosts=0, procs=1).boom.broadcast()
    assert arrived.wait(30), "no supervision event while the controller was idle"
    assert "The actor tests.fixtures.actors.Counter idle{'hosts': 0/2, 'procs': 1/2}" in seen[0].report()
    arrived.clear()
    victim = c.slice(hosts=1, procs=0)
    os.kill(victim.pid.call_one().get(timeout=30), signal.SIGKILL)
    assert arrived.wait(30), "no supervision event for the dead proc"
    report = seen[1].report()
    assert "idle{'hosts': 1/2, 'procs': 0/2}" in report and "failed: Killed(sig=9)" in report, report
    assert seen[1].exit_code == -signal.SIGKILL and not seen[1].actor


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_the_default_fault_hook_ends_the_controller(pool, tmp_path, sigint):
    """Unhandled, a supervision event ends the controller (Monarch's default: exit, after the
    report), even while its main thread waits on something else, and even where the controller
    inherited SIGINT ignored (started in the background by a non-interactive shell)."""
    script = tmp_path / "controller.py"
    script.write_text(
        textwrap.dedent(f"""
        import time
        from monarch_torchx import attach
        from tests.fixtures.actors import Counter
        c = attach({pool[0]!r}).spawn_procs(per_host={{"procs": 1}}).spawn("doomed", Counter)
        c.slice(hosts=0).boom.broadcast()
        time.sleep(60)
        print("still running")
    """)
    )
    root = str(Path(__file__).resolve().parent.parent)
    import signal

    def start() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN if sigint == "ignored" else signal.SIG_DFL)

    res = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=root,
        env={**os.environ, "PYTHONPATH": root},
        preexec_fn=start,
    )
    assert res.returncode != 0 and "still running" not in res.stdout
    assert "unhandled supervision event: The actor tests.fixtures.actors.Counter doomed" in res.stderr, res.stderr


def test_a_remote_traceback_names_the_scripts_file_and_line(pool, tmp_path):
    """An actor class defined in the controller's script travels by value; when its endpoint
    raises, the caller's error names that script's file and the line of the raise, with its
    source shown, even where the proc's host has no such file (here: deleted after start)."""
    script = tmp_path / "user_script.py"
    script.write_text(
        textwrap.dedent(f"""
        import linecache, os, sys
        from monarch_torchx import Actor, attach, endpoint


        def helper(x):
            return 1 / x


        class Boom(Actor):
            @endpoint
            def go(self):
                raise ValueError("bad input")

            @endpoint
            def nested(self):
                return helper(0)


        linecache.getlines(__file__)  # this process keeps its source; the file goes
        os.unlink(__file__)
        m = attach({pool[0]!r}).spawn_procs(per_host={{"procs": 1}}).slice(hosts=0).spawn("boom", Boom)
        for call in (m.go.call, m.nested.call):
            try:
                call().get(timeout=60)
            except Exception as e:
                print(e)
    """)
    )
    lines = script.read_text().splitlines()
    raise_at = lines.index('        raise ValueError("bad input")') + 1
    helper_at = lines.index("    return 1 / x") + 1
    res = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "MONARCH_TORCHX_HOME": str(pool[1])},
    )
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "<dynamic-code>" not in out, out
    assert f'File "{script}", line {raise_at}, in go\n    raise ValueError("bad input")\n' in out, out
    assert f'File "{script}", line {helper_at}, in helper\n    return 1 / x\n' in out, out


def test_get_or_spawn_controller_is_one_actor_per_name_for_the_whole_program(pool, procs):
    """As Monarch's: the first call spawns the named actor, every later one (from the controller,
    from its actors, from procs those actors start) gets the same actor; the first arguments count."""
    from monarch_torchx.actor import get_or_spawn_controller

    store = get_or_spawn_controller("store", Store).get(timeout=60)
    assert store.put.call_one("k", 42).get(timeout=30) == "first"
    again = get_or_spawn_controller("store", Store, "second").get(timeout=60)
    assert again.put.call_one("j", 1).get(timeout=30) == "first"  # the same actor
    users = procs.spawn("users", StoreUser)
    assert set(users.read.call("k").get(timeout=60).values()) == {42}
    assert set(users.aread.call("j").get(timeout=60).values()) == {1}
    assert users.slice(hosts=1, procs=0).read_from_a_child.call_one("k").get(timeout=120) == 42
    assert store.pid.call_one().get(timeout=30) == os.getpid()  # as in Monarch: it runs in the controller


def test_host_mesh_stop_context_manager_and_shutdown_as_in_monarch(home, pool_name):
    """HostMesh.stop() ends only the procs spawned through that HostMesh object; `with`/`async
    with` shut the hosts down on exit, after which the HostMesh refuses work (Monarch's)."""
    ensure_pool(PoolRequest("monarch_local", pool_name, {"hosts": 1, "preload": ""}))
    hm = attach(pool_name)
    assert hm.initialized.get(timeout=1) is True
    mine = hm.spawn_procs(per_host={"procs": 1}).spawn("mine", Counter)
    theirs = attach(pool_name).spawn_procs(per_host={"procs": 1}).spawn("theirs", Counter)
    assert mine.incr.call_one().get(timeout=30) == 1
    hm.stop().get(timeout=60)
    with pytest.raises(SupervisionError):
        mine.incr.call_one().get(timeout=30)
    assert theirs.incr.call_one().get(timeout=30) == 1
    import cloudpickle

    with pytest.raises(RuntimeError, match="was received"):
        cloudpickle.loads(cloudpickle.dumps(hm)).shutdown()  # a reference cannot end the hosts
    with hm:
        pass
    assert Registry().get(pool_name) is None
    with pytest.raises(RuntimeError, match="HostMesh has already been shut down"):
        hm.spawn_procs()
    with pytest.raises(RuntimeError, match="HostMesh has already been shut down"):
        hm.shutdown()


def test_stopping_an_actor_stops_what_it_spawned(procs):
    """As in Monarch: an actor's actor meshes (on its own procs or procs it was given) and its
    proc meshes stop with it; each owned actor's __cleanup__ runs."""
    one = procs.slice(hosts=0, procs=0)
    counter = one.spawn("counter", CleanupCounter)
    wrapper = one.spawn("wrapper", Wrapper, procs.slice(hosts=1, procs=0), counter)
    wrapper.check.call_one().get(timeout=60)
    wrapper.stop().get(timeout=60)
    wait_for(lambda: counter.value.call_one().get(timeout=30) == 2, timeout=30, what="both owned cleanups")


def test_an_actor_whose_constructor_never_returns_can_be_stopped(procs):
    """Its constructor runs on its own thread, so the proc goes on serving (the constructor's side
    effects arrive); stop() answers at once, and the proc's other actors are untouched."""
    port, rx = Channel.open()
    forever = procs.slice(hosts=0, procs=0).spawn("forever", Forever, port)
    assert rx.recv().get(timeout=30) == "started"
    other = procs.slice(hosts=0, procs=0).spawn("other", Counter)
    assert other.incr.call_one().get(timeout=30) == 1
    forever.stop().get(timeout=30)
    with pytest.raises(SupervisionError, match="stopped"):
        forever.unreachable.call_one().get(timeout=30)
    assert other.incr.call_one().get(timeout=30) == 2


def test_monarch_actor_names_are_exported_by_the_package_too():
    """Issue 43: every public name of ``monarch_torchx.actor`` (Monarch's ``monarch.actor``:
    ``attach_to_workers`` and ``run_worker_loop_forever`` too) comes from ``monarch_torchx``
    itself, the same object; importing the package, or a module of it, loads no actor code."""
    code = textwrap.dedent("""
        import sys
        import monarch_torchx
        from monarch_torchx import pool
        assert "monarch_torchx.actor" not in sys.modules, "the package imported its actor API"
        from monarch_torchx import attach_to_workers, run_worker_loop_forever
        import monarch_torchx.actor as api
        assert attach_to_workers is api.attach_to_workers and run_worker_loop_forever is api.run_worker_loop_forever
        missing = [n for n in api.__all__ if getattr(monarch_torchx, n, None) is not getattr(api, n)]
        assert not missing, missing
        assert set(api.__all__) <= set(dir(monarch_torchx))
    """)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_logging_option_streams_proc_output_with_the_actor_prefix(procs, capsys):
    """ProcMesh.logging_option (Monarch's): the procs' root logger level, and their output on the
    controller's stdout, each line led by its rank; log records from actor code start
    [actor=<module.Class name{point}>], as Monarch's do."""
    import asyncio
    import logging

    with pytest.raises(ValueError, match="aggregate_window_sec needs stream_to_client"):
        asyncio.run(procs.logging_option(aggregate_window_sec=1))
    asyncio.run(asyncio.wait_for(procs.logging_option(stream_to_client=True, level=logging.INFO), 30))
    t = procs.spawn("talker", Talker)
    assert set(t.talk.call("hi").get(timeout=30).values()) == {"hi"}
    seen = []

    def printed():
        seen.append(capsys.readouterr().out)
        out = "".join(seen)
        return out if out.count("printed hi") == 4 and out.count("logged hi") == 4 else None

    out = wait_for(printed, timeout=30, what="every proc's output")
    assert "[3] printed hi" in out and "hidden" not in out
    assert "[actor=<root>.<tests.fixtures.actors.Talker talker{'hosts': 1/2, 'procs': 1/2}>] logged hi" in out


def test_actor_instance_proc_mesh_is_the_mesh_it_was_spawned_on(procs):
    """Monarch's context().actor_instance.proc_mesh: the (sliced) ProcMesh the actor was spawned
    on; spawning on it places actors on those very procs."""
    pids = sorted(procs.spawn("c", Counter).pid.call().get(timeout=30).values())
    sizes, mates, mine = procs.spawn("m", MeshMate).slice(hosts=1, procs=1).mates.call_one().get(timeout=60)
    assert sizes == {"hosts": 2, "procs": 2} and mates == pids and mine in pids
    column = procs.slice(procs=0)
    sizes, mates, _ = column.spawn("m2", MeshMate).slice(hosts=0).mates.call_one().get(timeout=60)
    assert sizes == {"hosts": 2} and mates == sorted(column.spawn("c2", Counter).pid.call().get(timeout=30).values())


def test_proc_mesh_is_made_once_when_asked_and_travels_made():
    """A proc keeps a mesh's procs packed until an actor asks for ``proc_mesh`` (spawning N
    actors would otherwise unpack N addresses in each of N procs); the instance asks once, and a
    pickled instance carries the mesh itself, not the proc's maker."""
    import pickle

    from monarch_torchx.actor.actor import ActorInstance
    from monarch_torchx.actor.shape import Extent, Point

    made = []

    def source():
        made.append(1)
        return {"a mesh": len(made)}

    inst = ActorInstance("a", "a-1", Point((0,), Extent(("procs",), (1,))), 0, "m", 0, proc_mesh_source=source)
    assert made == []
    assert inst.proc_mesh == {"a mesh": 1} and inst.proc_mesh is inst.proc_mesh and made == [1]
    copy = pickle.loads(pickle.dumps(inst))
    assert copy.proc_mesh == {"a mesh": 1} and copy.proc_mesh_source is None and made == [1]
    assert ActorInstance("b", "b-1", inst.rank, 0, "m", 0).proc_mesh is None


def test_actor_names_creators_and_the_log_prefix_switch(procs, caplog):
    """As Monarch names an actor: its creator chain (`<root>.<module.Class name{point}>`), its
    `creator` (the controller is `root`); the controller's own log records say `[actor=<root>]`
    once it used `context()`, and `config.prefix_python_logs_with_actor = False` turns it off."""
    import logging

    from monarch_torchx.actor import config, context

    t = procs.spawn("talker", Talker)
    name, creator, nested = t.slice(hosts=0, procs=1).names.call_one().get(timeout=30)
    assert name == "<root>.<tests.fixtures.actors.Talker talker{'hosts': 0/2, 'procs': 1/2}>"
    assert (creator.name, creator.class_name, str(creator)) == ("root", None, "<root>")
    assert nested == name + ".<tests.fixtures.actors.Talker inner{'procs': 0/1}>"
    assert str(context().actor_instance) == "<root>"
    with caplog.at_level(logging.INFO, logger="controller-test"):
        logging.getLogger("controller-test").info("hello")
        config.prefix_python_logs_with_actor = False
        try:
            logging.getLogger("controller-test").info("plain")
        finally:
            config.prefix_python_logs_with_actor = True
    assert [r.getMessage() for r in caplog.records if r.name == "controller-test"] == ["[actor=<root>] hello", "plain"]


def test_shutdown_context_stops_every_proc_this_process_owns(pool):
    """Monarch's shutdown_context(): the controller's procs stop (as when it exits), the pool stays
    warm, and a second call is harmless."""
    from monarch_torchx.actor import shutdown_context

    pm = attach(pool[0]).spawn_procs(per_host={"procs": 1})
    pids = list(pm.spawn("c", Counter).pid.call().get(timeout=30).values())
    assert shutdown_context().get(timeout=5) is None
    assert shutdown_context().get(timeout=5) is None
    wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in pids), timeout=30, what="the procs to stop")
    fresh = attach(pool[0]).spawn_procs(per_host={"procs": 1})
    try:
        assert len(fresh.spawn("d", Counter).incr.call().get(timeout=30)) == 2
    finally:
        fresh.stop().get()


def _our_connections_to(ports: set) -> int:
    """This process's established TCP connections to those local ports (from /proc: no peer asked)."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "01" and f[9] in inodes and int(f[2].rsplit(":", 1)[1], 16) in ports:  # 01: ESTABLISHED
                count += 1
    return count


def test_the_controller_owns_and_calls_each_proc_over_one_connection(procs):
    """One socket per proc, not two: at 1,024 hosts a controller's descriptors and handshakes
    are what grows. Ownership still rides on it: letting go of the procs stops them."""
    from monarch_torchx.actor import shutdown_context

    ports = {r.addr.port for r in procs._procs}
    assert procs.spawn("c", Counter).incr.call().get(timeout=30)
    assert _our_connections_to(ports) == len(ports) == 4
    pids = list(procs.spawn("p", Counter).pid.call().get(timeout=30).values())
    shutdown_context().get(timeout=5)
    wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in pids), timeout=30, what="the procs to stop")
    assert _our_connections_to(ports) == 0


@pytest.mark.parametrize(
    "header", [("call", 1, None, None, "a0", "incr"), b"not a pickle"], ids=["an-unnamed-tuple", "no-pickle"]
)
def test_a_proc_drops_a_connection_whose_header_is_not_a_named_message(procs, header):
    """The actor protocol's headers are named types: a peer that sends anything else (an old
    positional tuple, garbage) loses that one connection; the proc and its actors go on."""
    import pickle

    from monarch_torchx import wire
    from monarch_torchx.actor import session

    counter = procs.spawn("c", Counter)
    assert counter.incr.call().get(timeout=30)
    ref = procs._procs[0]
    sock = wire.dial(ref.addr.host, ref.addr.port, session.hub_for(procs.pool).creds, ref.addr.identity.encode(), 10)
    try:
        body = header if isinstance(header, bytes) else pickle.dumps(header)
        sock.sendall(b"".join(bytes(memoryview(p).cast("B")) for p in wire.frame_parts(body, [pickle.dumps(None)])))
        sock.settimeout(10)
        assert sock.recv(1) == b""  # dropped, not answered
    finally:
        sock.close()
    assert counter.incr.call().get(timeout=30)  # the owner's connection and the actor are intact


def test_a_bootstrap_command_sets_each_procs_environment(pool):
    """As Monarch's ``spawn_procs(bootstrap_command=...)``: one command for every proc, or one per
    proc from its point; its env is added to the proc's; a later spawn without it has none of it."""
    from monarch_torchx.actor import BootstrapCommand, default_bootstrap_cmd

    hosts = attach(pool[0])
    cmd = default_bootstrap_cmd()
    assert isinstance(cmd, BootstrapCommand) and cmd.args == ["-m", "monarch_torchx.actor"] and cmd.env == {}
    every = hosts.spawn_procs(per_host={"gpus": 2}, bootstrap_command=cmd.with_env({"CUDA_VISIBLE_DEVICES": "3"}))
    assert set(every.spawn("c", Counter).env.call("CUDA_VISIBLE_DEVICES").get().values()) == {"3"}
    every.stop().get()
    each = hosts.spawn_procs(
        per_host={"gpus": 2},
        bootstrap_command=lambda point: cmd.with_env({"CUDA_VISIBLE_DEVICES": str(point["gpus"])}),
    )
    seen = each.spawn("c", Counter).env.call("CUDA_VISIBLE_DEVICES").get()
    # every proc, in rank order, each with its own gpus coordinate (each host spawned its two apart)
    assert [(p.rank, p["gpus"], v) for p, v in seen.items()] == [(0, 0, "0"), (1, 1, "1"), (2, 0, "0"), (3, 1, "1")]
    each.stop().get()
    plain = hosts.spawn_procs(per_host={"gpus": 1})
    assert set(plain.spawn("c", Counter).env.call("CUDA_VISIBLE_DEVICES").get().values()) == {None}
    plain.stop().get()
    with pytest.raises(ValueError, match="procs here run -m monarch_torchx.actor"):
        hosts.spawn_procs(bootstrap_command=BootstrapCommand(sys.executable, None, ["-m", "elsewhere"], {}))
