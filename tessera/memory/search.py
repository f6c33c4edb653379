"""Choosing the chunk size: the fixed chunk capacity that wastes the fewest bytes for a model.

Chunks of one fixed capacity take turns in the same buffers, but the space a chunk's tensors
do not fill is allocated all the same. Tensors are packed in order, a chunk never splits a
tensor nor mixes two labels (parameter groups), so the capacity must hold the largest tensor,
and how well the others fill the chunks depends on the capacity in a way no formula gives:
:func:`search_chunk_numel` tries capacities from the largest tensor up to twice it (or
``limit``) and keeps the smallest one whose utilisation (payload / allocated elements) is within a point
of the best.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ChunkPlan:
    """A chunk capacity and what it gives: ``chunks`` chunks of ``capacity`` elements each
    (rounded up to a multiple of the group size), ``utilisation`` = payload / allocated."""

    capacity: int
    chunks: int
    payload: int
    utilisation: float


def pack(numels: Sequence[int], labels: Sequence[int], capacity: int) -> list[list[int]]:
    """The chunks (lists of tensor indices) that packing ``numels`` in order gives: a new chunk
    starts when the label changes or the tensor would overflow ``capacity`` (a tensor larger
    than ``capacity`` gets a chunk of its own). The rule of :class:`~tessera.memory.chunks.ChunkStore`."""
    chunks: list[list[int]] = []
    filled = 0
    for i, n in enumerate(numels):
        if chunks and chunks[-1] and (labels[chunks[-1][0]] == labels[i]) and filled + n <= capacity:
            chunks[-1].append(i)
            filled += n
        else:
            chunks.append([i])
            filled = n
    return chunks


def packing_labels(model: nn.Module, names: Sequence[str], keys: Sequence[Hashable]) -> list[int]:
    """A label for each of ``model``'s parameters ``names`` such that a chunk never mixes two
    ``keys`` (parameter groups, reductions) nor two blocks: a block is the first element of a
    ``ModuleList``/``Sequential`` on a parameter's path (``blocks.3`` for
    ``blocks.3.attn.qkv.weight``), else the model's child holding it, so that released chunks
    are gathered, and gradients reduced, one block at a time."""
    labels: dict[tuple[Hashable, str], int] = {}
    return [labels.setdefault((key, _block_of(model, name)), len(labels)) for name, key in zip(names, keys)]


def _block_of(model: nn.Module, name: str) -> str:
    parts = name.split(".")
    module: nn.Module = model
    for depth, part in enumerate(parts[:-1]):
        if isinstance(module, nn.ModuleList | nn.Sequential):
            return ".".join(parts[: depth + 1])
        module = getattr(module, part)
    return parts[0] if len(parts) > 1 else ""


def plan(numels: Sequence[int], labels: Sequence[int], capacity: int, group_size: int = 1) -> ChunkPlan:
    """What a capacity gives for these tensors (each chunk allocated at the capacity, or at its
    own size when one tensor is larger)."""
    allocated = 0
    chunks = pack(numels, labels, capacity)
    for chunk in chunks:
        size = max(capacity, sum(numels[i] for i in chunk))
        allocated += math.ceil(size / group_size) * group_size
    payload = sum(numels)
    return ChunkPlan(capacity, len(chunks), payload, payload / allocated if allocated else 1.0)


def search_chunk_numel(
    numels: Sequence[int],
    labels: Sequence[int] | None = None,
    group_size: int = 1,
    *,
    limit: int | None = None,
    steps: int = 256,
    tolerance: float = 0.01,
) -> ChunkPlan:
    """The capacity (elements) with the best utilisation for packing ``numels`` in order.

    Tried: ``steps`` capacities evenly spaced from the largest tensor to twice it, or to
    ``limit`` elements when that is larger; the smallest capacity whose utilisation is within
    ``tolerance`` of the best wins (smaller chunks place memory more finely)."""
    if not numels:
        raise ValueError("no tensors to pack into chunks")
    labels = list(labels) if labels is not None else [0] * len(numels)
    low = max(numels)
    high = max(2 * low, limit or 0)
    plans = []
    for k in range(steps + 1):
        capacity = math.ceil((low + (high - low) * k // steps) / group_size) * group_size
        plans.append(plan(numels, labels, capacity, group_size))
    best = max(p.utilisation for p in plans)
    return min((p for p in plans if p.utilisation >= best - tolerance), key=lambda p: p.capacity)


__all__ = ["ChunkPlan", "pack", "plan", "search_chunk_numel"]
