"""Shapes of meshes (``actor/shape.py``): named dims over base ranks, slicing that keeps addressing
the right members, and the answers of a mesh by coordinates."""

from __future__ import annotations

import pytest

from monarch_torchx.actor.shape import Extent, Point, Shape, ValueMesh


def test_a_dense_shape_numbers_its_members_row_major():
    s = Shape.dense(["hosts", "gpus"], [2, 3])
    assert s.ranks == tuple(range(6)) and len(s) == 6
    points = list(s.points())
    assert [p.rank for p in points] == list(range(6))
    assert (points[4]["hosts"], points[4]["gpus"]) == (1, 1) and dict(points[4]) == {"hosts": 1, "gpus": 1}
    assert repr(points[5]) == "{'hosts': 1/2, 'gpus': 2/3}"  # as Monarch prints a point


def test_an_int_drops_its_dim_and_a_slice_keeps_it():
    s = Shape.dense(["hosts", "gpus"], [2, 4])
    host1 = s.slice(hosts=1)
    assert (host1.labels, host1.sizes, host1.ranks) == (("gpus",), (4,), (4, 5, 6, 7))
    odd = s.slice(gpus=slice(1, None, 2))
    assert (odd.labels, odd.sizes, odd.ranks) == (("hosts", "gpus"), (2, 2), (1, 3, 5, 7))
    assert s.slice(hosts=-1) == host1  # negative indices as in Python
    assert s.slice(hosts=0, gpus=2).ranks == (2,) and s.slice(hosts=0, gpus=2).labels == ()


def test_a_slice_of_a_slice_still_names_the_members_of_the_first_mesh():
    s = Shape.dense(["a", "b", "c"], [2, 3, 4])
    inner = s.slice(b=slice(1, 3)).slice(a=1).slice(c=slice(2, 4))
    assert inner.labels == ("b", "c") and inner.sizes == (2, 2)
    assert inner.ranks == tuple(1 * 12 + b * 4 + c for b in (1, 2) for c in (2, 3))
    # ranks stay positions in the original mesh: slicing the flat list gives the same members
    assert s.flatten("all").slice(all=slice(0, 24, 12)).ranks == (0, 12)


@pytest.mark.parametrize(
    "dims, error, match",
    [
        ({"gpus": 4}, IndexError, r"gpus=4 is out of range \(size 4\)"),
        ({"gpus": -5}, IndexError, "out of range"),
        ({"gpus": slice(4, None)}, IndexError, "selects nothing"),
        ({"nodes": 0}, ValueError, r"no dimension 'nodes' \(dims: hosts, gpus\)"),
        ({"gpus": True}, TypeError, "takes an int or a slice, not bool"),
        ({"gpus": "0"}, TypeError, "not str"),
    ],
)
def test_what_a_slice_cannot_select_is_refused_in_one_line(dims, error, match):
    with pytest.raises(error, match=match):
        Shape.dense(["hosts", "gpus"], [2, 4]).slice(**dims)


def test_flatten_and_rename_keep_the_members():
    s = Shape.dense(["hosts", "gpus"], [2, 2]).slice(gpus=1)
    assert s.flatten("procs") == Shape(("procs",), (2,), (1, 3))
    r = Shape.dense(["hosts", "gpus"], [2, 2]).rename(gpus="procs")
    assert r.labels == ("hosts", "procs") and r.ranks == (0, 1, 2, 3)
    with pytest.raises(ValueError, match="two dims the same name"):
        Shape.dense(["hosts", "gpus"], [2, 2]).rename(gpus="hosts")
    with pytest.raises(ValueError, match="no dimension 'x'"):
        Shape.dense(["hosts"], [2]).rename(x="y")


def test_an_extent_is_a_mapping_of_dims_in_order():
    e = Extent(["hosts", "gpus"], [2, 8])
    assert list(e) == ["hosts", "gpus"] and dict(e) == {"hosts": 2, "gpus": 8} and e.nelements == 16
    assert e.labels == ["hosts", "gpus"] and e.sizes == [2, 8] and repr(e) == "{'hosts': 2, 'gpus': 8}"
    with pytest.raises(KeyError):
        e["procs"]


def test_points_are_equal_by_coordinates_and_dims():
    e = Extent(["x", "y"], [2, 2])
    assert Point((1, 0), e) == Point((1, 0), Extent(["x", "y"], [2, 2]))
    assert Point((1, 0), e) != Point((0, 1), e) and len({Point((1, 0), e), Point((1, 0), e)}) == 1


def test_a_point_compares_with_other_values_as_a_mapping():
    e = Extent(["x", "y"], [2, 2])
    assert Point((1, 0), e) == {"x": 1, "y": 0}
    assert Point((1, 0), e) != None  # noqa: E711


def test_a_value_mesh_answers_by_coordinates_and_slices_like_its_shape():
    s = Shape.dense(["hosts", "gpus"], [2, 3])
    vm = ValueMesh(s, [f"r{i}" for i in range(6)])
    assert vm.item(hosts=1, gpus=2) == "r5" and len(vm) == 6
    assert [(p.rank, v) for p, v in vm.items()][:2] == [(0, "r0"), (1, "r1")]
    host1 = vm.slice(hosts=1)
    assert list(host1.values()) == ["r3", "r4", "r5"] and host1.item(gpus=0) == "r3"
    assert list(vm.slice(gpus=slice(0, 3, 2)).flatten("k").values()) == ["r0", "r2", "r3", "r5"]
    with pytest.raises(ValueError, match="exactly the dims"):
        vm.item(hosts=1)
    sub = ValueMesh(s.slice(gpus=1), ["a", "b"])  # a mesh over base ranks 1 and 4
    assert sub.item(hosts=1) == "b"
