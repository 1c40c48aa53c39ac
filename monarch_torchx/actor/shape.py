"""Named-dimension shapes of meshes, and the values a mesh answers with.

A mesh is a dense block of ranks with named dims (``hosts``, ``procs``, ...). Slicing keeps a
view onto the same ranks: ``slice(hosts=0)`` drops the ``hosts`` dim, ``slice(procs=slice(0, 2))``
keeps it. Ranks are positions in the mesh the actors were spawned in, so a slice of a slice
still addresses the right processes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence


class Extent(Mapping[str, int]):
    """Dim name -> size, in dim order. ``labels`` and ``sizes`` are lists, as Monarch's."""

    def __init__(self, labels: Sequence[str], sizes: Sequence[int]):
        self._labels = tuple(labels)
        self._sizes = tuple(sizes)

    @property
    def labels(self) -> list[str]:
        return list(self._labels)

    @property
    def sizes(self) -> list[int]:
        return list(self._sizes)

    def __getitem__(self, label: str) -> int:
        try:
            return self._sizes[self._labels.index(label)]
        except ValueError:
            raise KeyError(label) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._labels)

    def __len__(self) -> int:
        return len(self._labels)

    @property
    def nelements(self) -> int:
        n = 1
        for s in self._sizes:
            n *= s
        return n

    def __repr__(self) -> str:
        return "{" + ", ".join(f"'{k}': {v}" for k, v in zip(self._labels, self._sizes)) + "}"


class Point(Mapping[str, int]):
    """Coordinates of one member of a mesh; ``rank`` is its row-major index in that mesh."""

    def __init__(self, coords: Sequence[int], extent: Extent):
        self.coords = tuple(coords)
        self.extent = extent

    @property
    def rank(self) -> int:
        r = 0
        for c, s in zip(self.coords, self.extent._sizes):
            r = r * s + c
        return r

    def __getitem__(self, label: str) -> int:
        try:
            return self.coords[self.extent._labels.index(label)]
        except ValueError:
            raise KeyError(label) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.extent._labels)

    def __len__(self) -> int:
        return len(self.coords)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Point):
            return self.coords == other.coords and self.extent._labels == other.extent._labels
        if isinstance(other, Mapping):  # as a mapping (Monarch's Point is one): its labels and coordinates
            return dict(self.items()) == dict(other.items())
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.coords, self.extent._labels))

    def __repr__(self) -> str:  # as Monarch prints a point: {'hosts': 0/2, 'gpus': 1/4}
        return (
            "{"
            + ", ".join(f"'{k}': {v}/{n}" for k, v, n in zip(self.extent._labels, self.coords, self.extent._sizes))
            + "}"
        )


@dataclass(frozen=True)
class Shape:
    """Named dims over a set of base ranks (row-major over ``sizes``)."""

    labels: tuple[str, ...]
    sizes: tuple[int, ...]
    ranks: tuple[int, ...]  # base rank of each member, row-major

    @staticmethod
    def dense(labels: Sequence[str], sizes: Sequence[int]) -> Shape:
        n = 1
        for s in sizes:
            n *= s
        return Shape(tuple(labels), tuple(sizes), tuple(range(n)))

    @property
    def extent(self) -> Extent:
        return Extent(self.labels, self.sizes)

    def __len__(self) -> int:
        return len(self.ranks)

    def points(self) -> Iterator[Point]:
        ext = self.extent
        for coords in itertools.product(*(range(s) for s in self.sizes)):
            yield Point(coords, ext)

    def _dim(self, label: str) -> int:
        try:
            return self.labels.index(label)
        except ValueError:
            raise ValueError(f"mesh has no dimension {label!r} (dims: {', '.join(self.labels) or 'none'})") from None

    def slice(self, **dims: int | slice) -> Shape:
        labels, sizes = list(self.labels), list(self.sizes)
        grid: list[Any] = [list(range(s)) for s in sizes]
        for label, sel in dims.items():
            d = self._dim(label)
            if isinstance(sel, bool) or not isinstance(sel, (int, slice)):
                raise TypeError(f"slice({label}=...) takes an int or a slice, not {type(sel).__name__}")
            if isinstance(sel, int):
                if not -sizes[d] <= sel < sizes[d]:
                    raise IndexError(f"{label}={sel} is out of range (size {sizes[d]})")
                grid[d] = [sel % sizes[d]]
            else:
                grid[d] = list(range(sizes[d]))[sel]
                if not grid[d]:
                    raise IndexError(f"{label}={sel} selects nothing (size {sizes[d]})")
        strides = [1] * len(sizes)
        for i in range(len(sizes) - 2, -1, -1):
            strides[i] = strides[i + 1] * sizes[i + 1]
        ranks = tuple(self.ranks[sum(c * s for c, s in zip(coords, strides))] for coords in itertools.product(*grid))
        keep = [i for i in range(len(labels)) if not (labels[i] in dims and isinstance(dims[labels[i]], int))]
        return Shape(tuple(labels[i] for i in keep), tuple(len(grid[i]) for i in keep), ranks)

    def flatten(self, name: str) -> Shape:
        return Shape((name,), (len(self.ranks),), self.ranks)

    def rename(self, **names: str) -> Shape:
        for old in names:
            self._dim(old)
        labels = tuple(names.get(label, label) for label in self.labels)
        if len(set(labels)) != len(labels):
            raise ValueError(f"rename would give two dims the same name: {labels}")
        return Shape(labels, self.sizes, self.ranks)


class ValueMesh:
    """The answers of a mesh, one per member, addressable by coordinates."""

    def __init__(self, shape: Shape, values: Sequence[Any]):
        self._shape = shape
        self._values = list(values)

    @property
    def extent(self) -> Extent:
        return self._shape.extent

    def __len__(self) -> int:
        return len(self._values)

    def items(self) -> Iterator[tuple[Point, Any]]:
        return zip(self._shape.points(), self._values)

    def values(self) -> Iterator[Any]:
        return iter(self._values)

    def item(self, **coords: int) -> Any:
        if set(coords) != set(self._shape.labels):
            raise ValueError(f"item() needs exactly the dims {list(self._shape.labels)}, got {sorted(coords)}")
        sub = self._shape.slice(**coords)
        return self._values[self._shape.ranks.index(sub.ranks[0])]

    def slice(self, **dims: int | slice) -> ValueMesh:
        """The answers of part of the mesh (as Monarch's ``ValueMesh.slice``): an int drops its dim."""
        sub = self._shape.slice(**dims)
        at = {r: i for i, r in enumerate(self._shape.ranks)}
        return ValueMesh(sub, [self._values[at[r]] for r in sub.ranks])

    def flatten(self, name: str) -> ValueMesh:
        """The same answers along one dim called ``name``."""
        return ValueMesh(self._shape.flatten(name), self._values)

    def __iter__(self) -> Iterator[tuple[Point, Any]]:
        return self.items()

    def __repr__(self) -> str:
        return f"ValueMesh({self.extent!r}, {self._values!r})"
