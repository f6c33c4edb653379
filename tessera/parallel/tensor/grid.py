"""A rank's place on the grid of its tensor group: the coordinates SUMMA (2D, 2.5D) and 3D share.

The multi-dimensional modes arrange the tensor group as a grid and number it row-major, the
outermost line first (``tessera.context.dims``): 2D ``t = i*q + j``, 2.5D ``t = k*q*q + i*q + j``,
3D ``t = w*q*q + n*q + o``. Each line through a rank is a process group whose members differ in
one coordinate, so the rank's coordinate on that line is its rank in the group.
:class:`GridCoordinates` holds what follows from that alone (coordinates, numbering, its check);
:class:`SummaGrid` and :class:`Cube` name the lines of their modes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tessera.comm import AxisGroup
from tessera.context import ParallelContext


class GridCoordinates:
    """This rank's lines through a grid of the tensor group, outermost first (``lines``), and the
    whole group (``tensor``), numbered row-major over the lines. Process groups are handles, so a
    copied module shares its grid."""

    tensor: AxisGroup

    @property
    def lines(self) -> tuple[AxisGroup, ...]:
        """The groups of the grid's lines through this rank, outermost first."""
        raise NotImplementedError

    @property
    def coords(self) -> tuple[int, ...]:
        """This rank's coordinate on each line, outermost first."""
        return tuple(line.rank for line in self.lines)

    def index_of(self, *coords: int) -> int:
        """The tensor rank at ``coords`` (outermost first): row-major over the lines' sizes."""
        index = 0
        for line, c in zip(self.lines, coords, strict=True):
            index = index * line.size + c
        return index

    def check_numbering(self, layout: str) -> None:
        """Raise unless the lines span the tensor group and number it as ``layout`` says."""
        if self.tensor.size != math.prod(line.size for line in self.lines) or self.tensor.rank != self.index_of(
            *self.coords
        ):
            raise ValueError(f"tensor group {self.tensor} does not number the grid as {layout}")

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return self  # process groups are handles: a copied module shares them


@dataclass(frozen=True)
class SummaGrid(GridCoordinates):
    """This rank's place in the q x q grid (and, in 2.5D, in the stack of ``depth`` grids).

    Rank ``(k, i, j)``: grid ``k``, row ``i``, column ``j``; its index in the tensor group is
    ``k*q*q + i*q + j``. ``dep`` (None in 2D) joins the ranks at the same ``(i, j)`` of every grid.
    """

    row: AxisGroup  # this grid row: members differ in j
    col: AxisGroup  # this grid column: members differ in i
    dep: AxisGroup | None  # same (i, j) across grids (2.5D)
    tensor: AxisGroup

    def __post_init__(self) -> None:
        if self.row.size != self.col.size:
            raise ValueError(f"SUMMA grid must be square: row {self.row.size} x column {self.col.size}")
        self.check_numbering("k*q*q + i*q + j")

    @classmethod
    def from_context(cls, ctx: ParallelContext, row: str, col: str, dep: str | None = None) -> SummaGrid:
        return cls(ctx.group(row), ctx.group(col), ctx.group(dep) if dep else None, ctx.group("tensor"))

    @property
    def lines(self) -> tuple[AxisGroup, ...]:
        return (self.col, self.row) if self.dep is None else (self.dep, self.col, self.row)

    @property
    def q(self) -> int:
        return self.row.size

    @property
    def depth(self) -> int:
        return 1 if self.dep is None else self.dep.size

    @property
    def i(self) -> int:
        return self.col.rank

    @property
    def j(self) -> int:
        return self.row.rank

    @property
    def k(self) -> int:
        return 0 if self.dep is None else self.dep.rank

    def tensor_index(self, k: int, i: int, j: int) -> int:
        return (k * self.q + i) * self.q + j

    @property
    def batch_groups(self) -> tuple[AxisGroup, ...]:
        """Groups splitting the batch, outermost first: block ``k*q + i`` of ``depth*q``."""
        return (self.col,) if self.dep is None else (self.dep, self.col)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        return tuple(g.name for g in self.batch_groups)

    @property
    def batch_parts(self) -> int:
        return self.depth * self.q

    @property
    def batch_index(self) -> int:
        return self.k * self.q + self.i

    @property
    def weight_replicas(self) -> tuple[AxisGroup, ...]:
        """Groups over which a parameter split on the hidden dimension only is replicated: its
        members see different batch blocks, so their gradient shares are summed."""
        return self.batch_groups


INPUT, WEIGHT, OUTPUT, TENSOR = "3d_input", "3d_weight", "3d_output", "tensor"


@dataclass(frozen=True)
class Cube(GridCoordinates):
    """This rank's three lines through the q x q x q cube, and the whole tensor group: rank
    ``(w, n, o)`` is tensor rank ``w*q*q + n*q + o``."""

    input: AxisGroup  # members differ in n
    weight: AxisGroup  # members differ in w
    output: AxisGroup  # members differ in o
    tensor: AxisGroup

    def __post_init__(self) -> None:
        q = self.input.size
        if not self.weight.size == self.output.size == q or self.tensor.size != q**3:
            raise ValueError(f"3D: the cube lines {self.weight}, {self.input}, {self.output} do not form a q^3 cube")
        self.check_numbering("w*q*q + n*q + o")

    @classmethod
    def of(cls, ctx: ParallelContext) -> Cube:
        return cls(ctx.group(INPUT), ctx.group(WEIGHT), ctx.group(OUTPUT), ctx.group(TENSOR))

    @property
    def lines(self) -> tuple[AxisGroup, ...]:
        return (self.weight, self.input, self.output)

    @property
    def q(self) -> int:
        return self.input.size

    @property
    def w(self) -> int:
        return self.weight.rank

    @property
    def n(self) -> int:
        return self.input.rank

    @property
    def o(self) -> int:
        return self.output.rank

    @property
    def block(self) -> int:
        """This rank's block of a hidden dimension split q^2 ways: ``o*q + n``."""
        return self.o * self.q + self.n

    @property
    def hidden_groups(self) -> tuple[AxisGroup, AxisGroup]:
        """The groups splitting the hidden dimension (statistics over it are summed over both)."""
        return (self.input, self.output)

    def per_rank(self, size: int) -> int:
        """Units per rank of a hidden dimension of ``size``: ``ceil(size/q^2)``."""
        return -(-size // self.q**2)
