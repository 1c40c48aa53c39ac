"""``spawn_procs(proc_bind=...)`` (``actor/placement.py``): Monarch's rules checked in the controller,
CPU and node lists read as numactl/taskset read them, and what a proc binds itself to, over a
NUMA topology in a temporary directory (nothing of this process is rebound)."""

from __future__ import annotations

import pytest

from monarch_torchx.actor import placement


@pytest.mark.parametrize(
    "text, cpus",
    [("0", {0}), ("0-3", {0, 1, 2, 3}), ("0-1,8,10-11", {0, 1, 8, 10, 11}), (" 2 , 4-5 ", {2, 4, 5}), ("3-3", {3})],
)
def test_cpu_lists_read_as_taskset_reads_them(text, cpus):
    assert placement.parse_list(text) == cpus


@pytest.mark.parametrize(
    "text, why", [("a-b", "use numbers"), ("3-1", "empty or negative"), ("", "use numbers"), ("-1", "use numbers")]
)
def test_a_bad_cpu_list_is_refused_naming_it(text, why):
    with pytest.raises(ValueError, match=why) as e:
        placement.parse_list(text)
    assert repr(text) in str(e.value)


def test_monarchs_rules_are_checked_before_anything_starts():
    assert placement.check(None, 4) is None
    binds = [{"cpus": "0-1"}, {"cpunodebind": "1", "membind": "1"}]
    checked = placement.check(binds, 2)
    assert checked == binds and checked[0] is not binds[0]  # copies: the caller's dicts stay theirs
    for bind, procs, why in [
        ([{"cpus": "0"}], 2, r"proc_bind length \(1\) must equal procs_per_host \(2\)"),
        (["0-3"], 1, r"proc_bind\[0\] must be a dict"),
        ([{"cpus": "0", "gpus": "0"}], 1, r"unknown keys \['gpus'\]"),
        ([{"cpus": ""}], 1, r"proc_bind\[0\]\['cpus'\] must be a CPU or node list"),
        ([{"membind": 1}], 1, "must be a CPU or node list"),
        ([{"physcpubind": "4-2"}], 1, "empty or negative"),
    ]:
        with pytest.raises(ValueError, match=why):
            placement.check(bind, procs)


@pytest.fixture
def numa(tmp_path, monkeypatch):
    """A host of two NUMA nodes with CPUs 0-3 and 4-7, and a memory-only node 2; binding records
    what it would have applied."""
    for node, cpus in ((0, "0-3"), (1, "4-7"), (2, "")):
        d = tmp_path / f"node{node}"
        d.mkdir()
        (d / "cpulist").write_text(cpus + "\n")
    real = placement.node_cpus
    monkeypatch.setattr(placement, "node_cpus", lambda nodes, root=str(tmp_path): real(nodes, root))
    applied: dict = {}
    monkeypatch.setattr(placement.os, "sched_setaffinity", lambda pid, cpus: applied.update(pid=pid, cpus=set(cpus)))
    monkeypatch.setattr(placement, "_bind_memory", lambda nodes: applied.update(mem=nodes))
    return tmp_path, applied


def test_nodes_cpus_come_from_the_topology_and_a_memory_only_node_has_none(numa):
    root, _ = numa
    assert placement.node_cpus({0, 1}, str(root)) == set(range(8))
    assert placement.node_cpus({2}, str(root)) == set()
    with pytest.raises(ValueError, match="NUMA node 5 does not exist"):
        placement.node_cpus({5}, str(root))


def test_a_proc_binds_itself_to_what_every_key_allows_together(numa):
    _, applied = numa
    placement.apply({"cpunodebind": "1", "physcpubind": "2-6", "cpus": "5-9", "membind": "0,2"})
    assert applied == {"pid": 0, "cpus": {5, 6}, "mem": {0, 2}}  # this process, the CPUs all three allow
    applied.clear()
    placement.apply({"membind": "1"})
    assert applied == {"mem": {1}}  # memory only: its CPUs are left alone


def test_a_binding_that_leaves_no_cpu_is_refused_before_anything_is_bound(numa):
    _, applied = numa
    with pytest.raises(ValueError, match="leaves no CPU to run on"):
        placement.apply({"cpunodebind": "0", "cpus": "4-7", "membind": "0"})
    with pytest.raises(ValueError, match="leaves no CPU"):
        placement.apply({"cpunodebind": "2"})  # a memory-only node
    assert applied == {}
