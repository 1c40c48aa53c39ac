"""Placement, the queue's order, a host's admission and its capacity, as pure functions (the
pool's own use of them is in ``tests/test_placement.py``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from monarch_torchx.agent import admission, capacity
from monarch_torchx.app_queue import QueueEntry, QueueState, SubmittedApp, TorchrunRole
from monarch_torchx.registry import Placement
from monarch_torchx.resources import CapacityRefused, GpuDevice, Holding, HostCapacity, HostLoad, NeverFits, Resources
from monarch_torchx.scheduling import (
    AppAsk,
    ReplicaAsk,
    check_fits_somewhere,
    hosts_to_add,
    place,
    schedule,
    with_empty_hosts,
)
from monarch_torchx.specs import LaunchSpec


def host(i: int, cpus: float = 4, gpus: int = 0, mem: int = 8000, held: list[Holding] | None = None) -> HostLoad:
    cap = HostCapacity(cpus, mem, [GpuDevice(str(g)) for g in range(gpus)])
    return HostLoad(i, cap, list(held or []))


def app(app_id: str, *replicas: tuple[str, int, Resources]) -> AppAsk:
    return AppAsk(app_id, [ReplicaAsk(r, k, res) for r, k, res in replicas])


ONE_CPU = Resources(cpus=1)


def test_torchx_null_resource_asks_nothing():
    assert Resources.from_torchx(-1, -1, -1) == Resources()
    assert Resources.from_torchx(2, 4, 1024) == Resources(2.0, 4, 1024)
    assert Resources(cpus=1, gpus=2, mem_mb=512).describe() == "2 GPUs, 1 CPU, 512 MB"
    with pytest.raises(ValueError, match="not a number"):
        Resources(cpus="many")  # type: ignore[arg-type]


def test_single_replica_apps_spread_over_the_least_loaded_hosts():
    loads = [host(0), host(1)]
    where = []
    for n in range(4):  # four concurrent one-replica apps on a 2-host pool: two per host, not four on host 0
        placed = place(app(f"a{n}", ("python", 0, ONE_CPU)), loads)
        assert placed is not None
        h = placed[("python", 0)]
        loads[h].holdings.append(Holding(f"a{n}/python/0", ONE_CPU))
        where.append(h)
    assert sorted(where) == [0, 0, 1, 1]


def test_a_gang_goes_on_distinct_hosts_all_or_nothing():
    ask = Resources(cpus=1, gpus=2)
    loads = [host(0, gpus=4), host(1, gpus=4), host(2, gpus=1)]
    placed = place(app("g", ("train", 0, ask), ("train", 1, ask)), loads)
    assert placed is not None and sorted(placed.values()) == [0, 1]
    # three nodes of 2 GPUs: only two hosts have 2 free: none of it is placed
    assert place(app("g3", ("train", 0, ask), ("train", 1, ask), ("train", 2, ask)), loads) is None


def test_a_request_larger_than_any_host_is_named_with_the_biggest_host():
    loads = [host(0, gpus=8), host(1, gpus=4)]
    with pytest.raises(NeverFits, match=r"asks 16 GPUs.*the biggest, host 0, has 8 GPU\(s\)"):
        check_fits_somewhere(app("x", ("t", 0, Resources(gpus=16))), loads, "p")
    with pytest.raises(NeverFits, match=r"biggest, host 0, has 8000 MB of memory"):
        check_fits_somewhere(app("x", ("t", 0, Resources(mem_mb=10**6))), loads, "p")
    with pytest.raises(NeverFits, match="on each of 3 distinct hosts, but only 2"):
        ask = Resources(gpus=1)
        check_fits_somewhere(app("x", ("t", 0, ask), ("t", 1, ask), ("t", 2, ask)), loads, "p")
    check_fits_somewhere(app("x", ("t", 0, Resources(gpus=8))), loads, "p")  # (fits: no error)


def test_queue_is_first_come_first_served_and_backfill_cannot_delay_the_head():
    two_gpus = Resources(gpus=2)
    busy = Holding("old/t/0", two_gpus, ["0", "1"])
    loads = [host(0, gpus=2, held=[busy]), host(1, gpus=2, cpus=4)]
    queue = [
        app("head", ("t", 0, two_gpus), ("t", 1, two_gpus)),  # a gang of 2x2 GPUs: waits for host 0
        app("small-gpu", ("t", 0, Resources(gpus=1))),  # would take host 1's GPU the head needs
        app("cpu-only", ("t", 0, Resources(cpus=1))),  # fits beside the head's needs
    ]
    plan = schedule(queue, loads)
    assert [a for a, _ in plan.start] == ["cpu-only"]
    assert plan.waiting["head"] == "waits for 4 GPUs on 2 hosts; 1st in queue"
    assert plan.waiting["small-gpu"].endswith("2nd in queue")
    # once host 0's GPUs are free, the head starts first
    loads[0].holdings.clear()
    plan = schedule(queue[:2], loads)
    assert [a for a, _ in plan.start] == ["head"]


def test_the_ledger_hands_out_disjoint_gpus_and_refuses_what_is_not_free():
    async def go() -> None:
        ledger = admission.Ledger(0, HostCapacity(8, 1000, [GpuDevice(str(i)) for i in range(4)]))
        a = ledger.admit("a/t/0", Resources(gpus=2))
        b = ledger.admit("b/t/0", Resources(gpus=2))
        assert a.gpu_ids == ["0", "1"] and b.gpu_ids == ["2", "3"]
        assert admission.gpu_env(a) == {"CUDA_VISIBLE_DEVICES": "0,1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        with pytest.raises(
            CapacityRefused, match=r"cannot start c/t/0: it asks 1 GPU, and gpus are short.*held by a/t/0"
        ):
            ledger.admit("c/t/0", Resources(gpus=1))
        gen = ledger.load.generation
        waiter = asyncio.ensure_future(ledger.changed_after(gen, 5.0))
        await asyncio.sleep(0)
        ledger.release("a/t/0")
        load = await asyncio.wait_for(waiter, 1.0)
        assert load.generation > gen and load.free.gpus == 2
        assert ledger.admit("c/t/0", Resources(gpus=1)).gpu_ids == ["0"]
        ledger.take_out_gpu("1", "2 uncorrectable ECC error(s)")
        assert ledger.load.free.gpus == 0  # (0 held by c, 1 out of placement, 2 and 3 held by b)
        assert ledger.load.capacity.total.gpus == 3

    asyncio.run(go())


def test_capacity_declared_wins_and_granted_gpus_restrict_what_nvml_sees(monkeypatch: pytest.MonkeyPatch):
    declared = capacity.Declared.parse("cpus=4,gpus=2,mem_mb=2048")
    cap = capacity.detect({}, declared, None, "no NVML")
    assert (cap.cpus, cap.mem_mb, [g.visible_id for g in cap.gpus]) == (4, 2048, ["0", "1"])
    assert cap.sources == {"cpus": "declared", "mem_mb": "declared", "gpus": "declared"}
    bare = capacity.detect({"SLURM_CPUS_ON_NODE": "3", "SLURM_MEM_PER_NODE": "1500"}, capacity.Declared(), None, "x")
    assert (bare.cpus, bare.mem_mb, bare.gpus) == (3, 1500, [])
    assert bare.gpu_note == "no GPUs: x" and bare.sources["cpus"] == "SLURM_CPUS_ON_NODE"
    with pytest.raises(ValueError, match="use cpus=N"):
        capacity.Declared.parse("gpu=2")

    class FakeNvml:  # NVML's answer, as the real library gives it on a 4-GPU host
        def devices(self):
            from monarch_torchx.agent.nvml import GpuInfo

            return [GpuInfo(i, f"GPU-{i}aaa", "H200", 140000) for i in range(4)]

    granted = capacity.detect({"CUDA_VISIBLE_DEVICES": "1,GPU-3"}, capacity.Declared(), FakeNvml(), "")  # type: ignore[arg-type]
    assert [g.visible_id for g in granted.gpus] == ["1", "3"]
    assert granted.sources["gpus"] == "NVML within CUDA_VISIBLE_DEVICES"
    none = capacity.detect({"SLURM_JOB_GPUS": ""}, capacity.Declared(), FakeNvml(), "")  # type: ignore[arg-type]
    assert none.gpus == [] and "grants none" in none.gpu_note


def test_no_nvml_library_is_said_not_raised():
    from monarch_torchx.agent.nvml import NvmlUnavailable, open_nvml

    with pytest.raises(NvmlUnavailable, match="no NVML on this host"):
        open_nvml("libnvidia-ml-not-here.so.1")


def test_a_placement_sets_rank0_torchrun_store_and_workspace_paths():
    specs = [
        LaunchSpec("a", "train", k, ["python", "@ws@/t.py"], cwd="@ws@", resources=Resources(gpus=1).to_wire())
        for k in range(2)
    ]
    sub = SubmittedApp(
        "a",
        "a",
        [],
        specs,
        torchrun={"train": TorchrunRole(2)},
        rank0_env="TORCHX_RANK0_HOST",
        path_token="@ws@",
        workspace_paths={3: "/w3", 5: "/w5"},
    )
    placement = {("train", 0): 5, ("train", 1): 3}
    assert sub.store_hosts(placement) == {"train": 5}
    out = dict(sub.launches(placement, {3: "h3", 5: "h5"}, {"train": 4242}))
    assert out[5].env["TORCHX_RANK0_HOST"] == "h5" and out[3].env["TORCHX_RANK0_HOST"] == "h5"
    assert '"store_host": "h5"' in out[3].env["MONARCH_TORCHX_TORCHRUN"]
    assert '"store_port": 4242' in out[3].env["MONARCH_TORCHX_TORCHRUN"]
    assert (out[3].cwd, out[3].argv[1]) == ("/w3", "/w3/t.py")
    assert specs[0].env == {}  # (launches work on copies)
    back = SubmittedApp.from_wire(sub.to_wire())
    assert back == sub
    entry = QueueEntry("a", QueueState.STARTED, placement=[Placement("train", 0, 5, "inc")])
    assert QueueEntry.from_wire(entry.to_wire()) == entry


def test_cgroup_limits_are_read_up_the_tree(tmp_path: Path):
    leaf = tmp_path / "a" / "b"
    leaf.mkdir(parents=True)
    (tmp_path / "a" / "cpu.max").write_text("150000 100000\n")
    (leaf / "memory.max").write_text(str(512 << 20) + "\n")
    assert capacity._cgroup_cpus(leaf) == 1.5
    assert capacity._cgroup_mem_mb(leaf) == 512


def test_more_cpus_than_a_host_has_is_the_whole_host_never_a_refusal():
    loads = [host(0, cpus=1), host(1, cpus=1)]
    big = Resources(cpus=2, mem_mb=100)
    check_fits_somewhere(app("ddp", ("t", 0, big), ("t", 1, big)), loads, "p")  # (no error: CPUs are clamped)
    placed = place(app("ddp", ("t", 0, big), ("t", 1, big)), loads)
    assert placed is not None and sorted(placed.values()) == [0, 1]
    loads[0].holdings.append(Holding("ddp/t/0", big.within(loads[0].capacity.total)))
    assert loads[0].free.cpus == 0  # the whole host's CPU: the next one waits for it
    assert place(app("x", ("t", 0, ONE_CPU)), loads[:1]) is None
    with pytest.raises(NeverFits, match="8000 MB of memory"):  # memory above every host's: refused
        check_fits_somewhere(app("x", ("t", 0, Resources(cpus=64, mem_mb=9000))), loads, "p")


def test_the_ledger_admits_a_too_big_cpu_ask_as_the_whole_host():
    async def go() -> None:
        ledger = admission.Ledger(0, HostCapacity(1, 1000))
        assert ledger.admit("a/t/0", Resources(cpus=2)).resources == Resources(cpus=1)
        with pytest.raises(CapacityRefused):
            ledger.admit("b/t/0", Resources(cpus=1))

    asyncio.run(go())


def test_a_fork_server_that_preloads_submitit_has_its_plugins_read_once():
    """What a submitit task forked from it would otherwise do first: scan every distribution's
    entry points (the bulk of a task's start, benchmarks/queue_tasks.py)."""
    from submitit.core import plugins

    from monarch_torchx.agent.forkserver import _warm_submitit

    plugins._get_plugins.cache_clear()
    _warm_submitit()
    assert plugins._get_plugins.cache_info().currsize == 1
    assert "monarch" in plugins.get_executors()  # (ours among them: a task finds its environment)


def test_a_pool_that_may_grow_is_sized_for_the_head_of_its_queue():
    """What a SLURM pool's allocator submits (``hosts_to_add``): the fewest empty hosts like the
    first that let the app start beside what runs now, within the room left."""
    busy = host(0, cpus=2, held=[Holding("other/r/0", Resources(cpus=2))])
    gang = app("gang", *(("r", k, ONE_CPU) for k in range(3)))
    assert hosts_to_add(gang, [host(0)], 4) == 2  # host 0 takes one replica of the gang
    assert hosts_to_add(gang, [busy], 4) == 3  # host 0 is full: all three elsewhere
    assert hosts_to_add(gang, [busy], 2) is None  # not within max_nodes
    big = app("big", ("r", 0, Resources(cpus=1, gpus=1)))
    assert hosts_to_add(big, [host(0)], 4) is None  # hosts like host 0 have no GPU: growing does not help
    grown = with_empty_hosts([busy, host(3)], 4)
    assert [h.index for h in grown] == [0, 3, 4, 5] and grown[2].capacity == busy.capacity and not grown[2].holdings
    with pytest.raises(NeverFits):
        check_fits_somewhere(gang, [host(0)], "p")
    check_fits_somewhere(gang, with_empty_hosts([host(0)], 3), "p")  # (a pool that may grow to 3)


def test_an_app_whose_workspace_went_to_some_hosts_starts_only_on_those():
    ask = AppAsk("ws", [ReplicaAsk("r", 0, ONE_CPU)], hosts=frozenset({1}))
    full = host(1, cpus=1, held=[Holding("other/r/0", ONE_CPU)])
    assert place(ask, [host(0), host(1)]) == {("r", 0): 1}
    assert place(ask, [host(0), full]) is None  # host 0 is free, but has no copy of its workspace
    assert hosts_to_add(ask, [host(0), full], 4) is None  # a host that joins would not have it either
    assert ask.shape != AppAsk("x", ask.replicas).shape  # (not placed as one with an unrestricted app)
