"""The parallel layout as one validated value, and the group tables derived from it.

Everything here is pure: no processes, no torch.distributed. A global rank is laid out with the
tensor axis innermost, then sequence, then pipeline, and data outermost::

    rank = ((data * P + pipeline) * S + sequence) * T + tensor

The data axis splits into two sub-axes when experts are spread (``expert > 1``): with ``d`` the
rank's data index, ``d = e_data * E + e`` where ``expert`` varies ``e`` (the ranks that share one
set of tokens' experts, exchanging tokens by all-to-all) and ``expert_data`` varies ``e_data``
(the ranks holding the same experts, which average their gradients). Both axes always exist:
with ``expert == 1``, ``expert`` is every rank alone and ``expert_data`` is ``data``.

The tensor axis is further split into the sub-axes of its mode. With ``t`` the rank's index
inside its tensor group:

* 1d:   no sub-axes.
* 2d:   ``t = i*q + j`` on a q x q grid. ``2d_row`` groups the ranks of one row (same ``i``),
  ``2d_col`` the ranks of one column (same ``j``).
* 2.5d: ``t = k*q*q + i*q + j``: ``depth`` stacked q x q grids. ``2.5d_row`` and ``2.5d_col`` are
  rows and columns of one grid (same ``k``); ``2.5d_dep`` joins the ranks at the same ``(i, j)``
  position of every grid.
* 3d:   ``t = w*q*q + n*q + o`` on a q x q x q cube. ``3d_output`` varies ``o``, ``3d_input``
  varies ``n`` and ``3d_weight`` varies ``w``; each is a line of the cube through the rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tessera.context.rules import DIMS_PARTS, Combination, check_combination, integer_root
from tessera.errors import ConfigError

BASE_AXES: tuple[str, ...] = ("data", "pipeline", "sequence", "tensor")
EXPERT_AXES: tuple[str, ...] = ("expert", "expert_data")  # sub-axes of data (module docstring)
TENSOR_MODES: tuple[str, ...] = ("1d", "2d", "2.5d", "3d")
SEQUENCE_MODES: tuple[str, ...] = ("ring_qk", "ring", "all_to_all")

# Atomic coordinates of the tensor axis per mode, outermost first.
_TENSOR_COORDS: dict[str, tuple[str, ...]] = {
    "1d": ("tensor",),
    "2d": ("2d_i", "2d_j"),
    "2.5d": ("2.5d_k", "2.5d_i", "2.5d_j"),
    "3d": ("3d_w", "3d_n", "3d_o"),
}

# Which atomic coordinates each tensor sub-axis varies.
_SUBAXIS_VARIES: dict[str, dict[str, tuple[str, ...]]] = {
    "1d": {},
    "2d": {"2d_row": ("2d_j",), "2d_col": ("2d_i",)},
    "2.5d": {"2.5d_row": ("2.5d_j",), "2.5d_col": ("2.5d_i",), "2.5d_dep": ("2.5d_k",)},
    "3d": {"3d_input": ("3d_n",), "3d_weight": ("3d_w",), "3d_output": ("3d_o",)},
}

# Atomic coordinates of the data axis and its sub-axes when experts are spread (expert > 1).
_DATA_COORDS: dict[str, tuple[str, ...]] = {
    "data": ("expert_data", "expert"),
    "expert": ("expert",),
    "expert_data": ("expert_data",),
}

AxisSpec = str | Sequence[str]


def check_tensor_layout(
    size: int, mode: str, depth: int = 1, sequence_parallel: bool = False, keep_blocks: bool = False
) -> None:
    """Raise ConfigError unless ``size`` ranks can run tensor mode ``mode`` with ``depth`` (and
    ``sequence_parallel``, ``keep_blocks``): the values' ranges here, how they combine in the layout
    rules (:mod:`tessera.context.rules`). The config schema and :class:`ParallelDims` call it, and
    the registry of modes (``tessera.parallel.tensor.modes``) has exactly the modes of
    :data:`TENSOR_MODES`."""
    if mode not in TENSOR_MODES:
        raise ConfigError(
            f"parallel.tensor.mode={mode!r} is not a tensor-parallel mode; allowed: {', '.join(TENSOR_MODES)}"
        )
    if size < 1:
        raise ConfigError(f"parallel.tensor.size={size} must be at least 1")
    if depth < 1:
        raise ConfigError(f"parallel.tensor.depth={depth} must be at least 1")
    tensor = Combination(
        tensor=size, tensor_mode=mode, tensor_depth=depth, sequence_parallel=sequence_parallel, keep_blocks=keep_blocks
    )
    check_combination(tensor, parts=("tensor",))


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of every parallel axis; they multiply to ``world_size``.

    ``data`` may be left as None to take whatever the other degrees leave of the world.
    """

    world_size: int
    data: int | None = None
    pipeline: int = 1
    sequence: int = 1
    tensor: int = 1
    tensor_mode: str = "1d"
    tensor_depth: int = 1
    sequence_parallel: bool = False  # 1D only: activations outside Col -> Row regions split along the sequence
    keep_blocks: bool = False  # 2D, 2.5D, 3D: keep the blocks a Linear's forward received for its backward
    sequence_mode: str = "ring"  # ring_qk (ring self-attention), ring (online softmax), all_to_all (Ulysses)
    expert: int = 1  # ranks of the data axis that spread the experts of an MoE layer (divides data)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world size {self.world_size} must be at least 1")
        for name in ("pipeline", "sequence", "tensor"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"parallel.{name} size {value} must be at least 1")
        check_tensor_layout(self.tensor, self.tensor_mode, self.tensor_depth, self.sequence_parallel, self.keep_blocks)
        if self.expert < 1:
            raise ConfigError(f"parallel.expert size {self.expert} must be at least 1")
        if self.sequence_mode not in SEQUENCE_MODES:
            raise ConfigError(
                f"parallel.sequence.mode={self.sequence_mode!r} is not one of {', '.join(SEQUENCE_MODES)}"
            )
        model = self.pipeline * self.sequence * self.tensor
        sizes = f"pipeline={self.pipeline} x sequence={self.sequence} x tensor={self.tensor}"
        if self.data is None:
            if self.world_size % model != 0:
                raise ConfigError(
                    f"the layout does not fit the world: {sizes} = {model} does not divide world size {self.world_size}"
                )
            object.__setattr__(self, "data", self.world_size // model)
        elif self.data < 1:
            raise ConfigError(f"parallel.data={self.data} must be at least 1")
        elif self.data * model != self.world_size:
            raise ConfigError(
                f"the layout does not fit the world: data={self.data} x {sizes} = "
                f"{self.data * model}, but the world size is {self.world_size}"
            )
        check_combination(self.combination(), DIMS_PARTS)  # the mesh's rules; the rest: where a layout runs

    # ---- derived facts -------------------------------------------------------------------
    def combination(self) -> Combination:
        """This layout as the layout rules (:mod:`tessera.context.rules`) read it; the strategy
        choices made on it (ZeRO, Gemini, the pipeline's schedule) are left for the caller to add
        with ``_replace``."""
        return Combination(
            data=self.data,
            pipeline=self.pipeline,
            sequence=self.sequence,
            tensor=self.tensor,
            tensor_mode=self.tensor_mode,
            tensor_depth=self.tensor_depth,
            sequence_parallel=self.sequence_parallel,
            keep_blocks=self.keep_blocks,
            expert=self.expert,
        )

    @property
    def data_size(self) -> int:
        assert self.data is not None  # set in __post_init__
        return self.data

    @property
    def tensor_q(self) -> int:
        """Side of the tensor grid: P for 1d, q for 2d/2.5d/3d."""
        if self.tensor_mode == "1d":
            return self.tensor
        if self.tensor_mode == "3d":
            root = integer_root(self.tensor, 3)
        else:
            root = integer_root(self.tensor // self.tensor_depth, 2)
        assert root is not None  # checked in __post_init__
        return root

    @property
    def axes(self) -> tuple[str, ...]:
        """Every named axis of this layout: the base axes, the data axis's expert sub-axes and the
        tensor mode's sub-axes."""
        return BASE_AXES + EXPERT_AXES + tuple(_SUBAXIS_VARIES[self.tensor_mode])

    def coordinate_sizes(self) -> list[tuple[str, int]]:
        """Atomic coordinates of a rank, outermost first, with their sizes."""
        coords: list[tuple[str, int]] = (
            [("expert_data", self.data_size // self.expert), ("expert", self.expert)]
            if self.expert > 1
            else [("data", self.data_size)]
        )
        coords += [("pipeline", self.pipeline), ("sequence", self.sequence)]
        q = self.tensor_q
        if self.tensor_mode == "1d":
            coords.append(("tensor", self.tensor))
        elif self.tensor_mode == "2d":
            coords += [("2d_i", q), ("2d_j", q)]
        elif self.tensor_mode == "2.5d":
            coords += [("2.5d_k", self.tensor_depth), ("2.5d_i", q), ("2.5d_j", q)]
        else:
            coords += [("3d_w", q), ("3d_n", q), ("3d_o", q)]
        return coords

    def coordinates(self, rank: int) -> dict[str, int]:
        """Atomic coordinates of global ``rank`` (row-major, last coordinate innermost)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        out: dict[str, int] = {}
        rest = rank
        for name, size in reversed(self.coordinate_sizes()):
            out[name] = rest % size
            rest //= size
        return dict(reversed(list(out.items())))

    def varied_coordinates(self, axis: AxisSpec) -> tuple[str, ...]:
        """Atomic coordinates that change along ``axis`` (a name or a sequence of names)."""
        names = (axis,) if isinstance(axis, str) else tuple(axis)
        varied: list[str] = []
        for name in names:
            if name == "world":
                part = tuple(c for c, _ in self.coordinate_sizes())
            elif name == "tensor":
                part = _TENSOR_COORDS[self.tensor_mode]
            elif name in ("data", "expert", "expert_data"):
                part = _DATA_COORDS[name] if self.expert > 1 else (() if name == "expert" else ("data",))
            elif name in ("pipeline", "sequence"):
                part = (name,)
            elif name in _SUBAXIS_VARIES[self.tensor_mode]:
                part = _SUBAXIS_VARIES[self.tensor_mode][name]
            else:
                raise KeyError(
                    f"axis {name!r} does not exist in this layout (tensor mode "
                    f"{self.tensor_mode!r}); axes: {', '.join(self.axes)}"
                )
            varied += [c for c in part if c not in varied]
        return tuple(varied)

    def axis_size(self, axis: AxisSpec) -> int:
        sizes = dict(self.coordinate_sizes())
        return math.prod(sizes[c] for c in self.varied_coordinates(axis))

    def axis_index(self, axis: AxisSpec, rank: int) -> int:
        """Position of ``rank`` inside its group along ``axis`` (row-major over the coordinates)."""
        sizes = dict(self.coordinate_sizes())
        coords = self.coordinates(rank)
        index = 0
        for name in self.varied_coordinates(axis):
            index = index * sizes[name] + coords[name]
        return index


def group_table(dims: ParallelDims, axis: AxisSpec) -> list[tuple[int, ...]]:
    """All groups along ``axis``: each a tuple of global ranks in ascending order.

    Two ranks share a group exactly when their coordinates agree outside the axis. The groups
    partition the world and come sorted by their first rank.
    """
    varied = set(dims.varied_coordinates(axis))
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(dims.world_size):
        coords = dims.coordinates(rank)
        key = tuple(v for name, v in coords.items() if name not in varied)
        groups.setdefault(key, []).append(rank)
    return sorted((tuple(g) for g in groups.values()), key=lambda g: g[0])


def group_tables(dims: ParallelDims, axes: Iterable[AxisSpec] | None = None) -> dict[AxisSpec, list[tuple[int, ...]]]:
    """Group tables for ``axes`` (default: every named axis of the layout)."""
    return {axis: group_table(dims, axis) for axis in (axes or dims.axes)}
