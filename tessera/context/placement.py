"""Where a parameter lives: one typed record per parameter, read by every part that needs it.

A :class:`Placement` says how a parameter (or a ZeRO piece of one) is spread over the ranks:

- ``shard``: the :class:`ShardSpec` of a tensor-parallel block (which axes split which
  dimension), or None for a tensor every rank of the tensor group holds whole;
- ``mesh``: the context whose axes ``shard`` and ``stage`` name (the one the layer was built with);
- ``stage``: the pipeline rank that trains the parameter and reports it (None: every stage);
- ``tied``: held by several pipeline ranks (a GPT's embedding and head), its gradient summed;
- ``zero``: for a ZeRO piece, which parameter of the sharded optimizer it is a piece of;
- ``storage``: the object that owns the parameter's memory when it may be released (a ZeRO
  chunk store): ``storage.gathered()`` makes it readable, ``storage.params_loaded()`` takes new
  values written into it.

Writers: tensor-parallel layers (``shard``), the pipeline stage (``stage``, ``tied``), ZeRO
(``zero``, ``storage``). Readers: norms and clipping, full state dicts, partitioning, memory
reports. Nothing else is stored on a parameter.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from tessera.context.context import ParallelContext

_ATTRIBUTE = "_tessera_placement"


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator / denominator``, which must be exact."""
    if numerator % denominator != 0:
        raise ValueError(f"{what}: {numerator} is not divisible by {denominator}")
    return numerator // denominator


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class ShardSpec:
    """How a tensor of ``full_shape`` is split: ``dims[d]`` are the axes splitting dimension ``d``
    (outermost first; empty: not split), ``groups[d]`` the fused parts of dimension ``d``, and
    ``pad_to[d]`` (0: the number of parts) the multiple each part of a split dimension is
    zero-padded to; it must be a multiple of the number of parts (3D pads a dimension split q
    ways to a multiple of q^2, so that its blocks are unions of another dimension's q^2 blocks).

    A dimension split by axes ``(a, b)`` is cut into ``size(a) * size(b)`` equal blocks and the
    rank holds block ``index(a) * size(b) + index(b)``; a dimension with ``groups`` fused parts
    (q, k and v, say) has each part padded and split on its own."""

    full_shape: tuple[int, ...]
    dims: tuple[tuple[str, ...], ...]
    groups: tuple[int, ...] = ()
    pad_to: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.dims) != len(self.full_shape):
            raise ValueError(f"ShardSpec: {len(self.dims)} dim entries for shape {self.full_shape}")
        if not self.groups:
            object.__setattr__(self, "groups", (1,) * len(self.full_shape))
        if not self.pad_to:
            object.__setattr__(self, "pad_to", (0,) * len(self.full_shape))
        for size, g in zip(self.full_shape, self.groups, strict=True):
            divide(size, g, "ShardSpec: fused parts of a dimension")
        if len(self.pad_to) != len(self.full_shape):
            raise ValueError(f"ShardSpec: {len(self.pad_to)} pad_to entries for shape {self.full_shape}")
        for axes, multiple in zip(self.dims, self.pad_to, strict=True):
            if multiple < 0 or (multiple and not axes):
                raise ValueError(f"ShardSpec: pad_to {self.pad_to} must be >= 0, and 0 on dimensions not split")

    @property
    def axes(self) -> tuple[str, ...]:
        """Every axis that splits some dimension."""
        return tuple(dict.fromkeys(a for axes in self.dims for a in axes))

    def parts(self, dim: int, ctx: ParallelContext) -> int:
        return math.prod(ctx.size(a) for a in self.dims[dim])

    def index(self, dim: int, ctx: ParallelContext) -> int:
        index = 0
        for axis in self.dims[dim]:
            index = index * ctx.size(axis) + ctx.local_rank(axis)
        return index

    def multiple(self, dim: int, ctx: ParallelContext) -> int:
        """What each part of dimension ``dim`` is padded to a multiple of."""
        parts = self.parts(dim, ctx)
        multiple = self.pad_to[dim] or parts
        divide(multiple, parts, f"ShardSpec: pad_to of dimension {dim}")
        return multiple

    def padded_size(self, dim: int, ctx: ParallelContext) -> int:
        per_group = self.full_shape[dim] // self.groups[dim]
        return self.groups[dim] * round_up(per_group, self.multiple(dim, ctx))

    def local_shape(self, ctx: ParallelContext) -> tuple[int, ...]:
        return tuple(self.padded_size(d, ctx) // self.parts(d, ctx) for d in range(len(self.full_shape)))


@dataclass(frozen=True, slots=True)
class ZeroSlot:
    """A ZeRO piece's parameter: number ``index`` of the ``count`` parameters the sharded
    optimizer holds, of shape ``shape`` on this rank (a tensor-parallel block's shape);
    ``within_host``: the pieces are spread over the replicas of one host and repeated on every
    host (hybrid sharding), so a norm sums them over the host's replicas only."""

    index: int
    count: int
    shape: tuple[int, ...]
    within_host: bool = False


class ReleasableStorage(Protocol):
    """What owns a parameter's memory when the parameter may be released between uses."""

    def gathered(self) -> AbstractContextManager[None]: ...

    def params_loaded(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Placement:
    """How one parameter is spread over the ranks (see the module docstring)."""

    shard: ShardSpec | None = None
    mesh: ParallelContext | None = None
    stage: int | None = None
    tied: bool = False
    zero: ZeroSlot | None = None
    storage: ReleasableStorage | None = None

    @property
    def split_axes(self) -> tuple[str, ...]:
        """The mesh axes a tensor-parallel block is split along (empty: not split)."""
        return self.shard.axes if self.shard is not None else ()

    def counted_on(self, stage: int) -> bool:
        """Whether pipeline rank ``stage`` counts this parameter (in norms and full states)."""
        return self.stage is None or self.stage == stage

    def full_shape(self, tensor: torch.Tensor) -> tuple[int, ...]:
        """The single-process shape of the parameter ``tensor`` is (a piece or block of)."""
        if self.shard is not None:
            return self.shard.full_shape
        if self.zero is not None:
            return self.zero.shape
        return tuple(tensor.shape)

    # A placement names live objects (contexts, stores): copies of a model share them, and
    # pickling drops them (a pickled tensor keeps only how it was split).
    def __deepcopy__(self, memo: dict[int, Any]) -> Placement:
        return self

    def __reduce__(self) -> Any:
        return (Placement, (self.shard, None, self.stage, self.tied, self.zero, None))


_NOWHERE = Placement()


def placement_of(tensor: torch.Tensor) -> Placement:
    """The placement of ``tensor`` (a parameter every rank holds whole if none was recorded)."""
    found = getattr(tensor, _ATTRIBUTE, None)
    return found if isinstance(found, Placement) else _NOWHERE


def set_placement(tensor: torch.Tensor, placement: Placement) -> None:
    """Record ``placement`` for ``tensor`` (replacing any earlier one)."""
    setattr(tensor, _ATTRIBUTE, placement)


def update_placement(tensor: torch.Tensor, **changes: Any) -> Placement:
    """Record ``tensor``'s placement with ``changes`` applied; returns the new record."""
    placement = dataclasses.replace(placement_of(tensor), **changes)
    set_placement(tensor, placement)
    return placement


def storages_of(tensors: Iterable[torch.Tensor]) -> list[ReleasableStorage]:
    """The distinct owners of releasable storage behind ``tensors`` (a ZeRO chunk store, say),
    in the order first met: the same order on every rank for the same model."""
    found: dict[int, ReleasableStorage] = {}
    for t in tensors:
        storage = placement_of(t).storage
        if storage is not None:
            found.setdefault(id(storage), storage)
    return list(found.values())


def full_numel(tensor: torch.Tensor) -> int:
    """Elements of the single-process parameter ``tensor`` is (a piece or block of)."""
    return math.prod(placement_of(tensor).full_shape(tensor))
