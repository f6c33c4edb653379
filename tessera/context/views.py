"""Where a rank's tensor sits inside the single-process tensor: the geometry of resharding.

A :class:`View` describes one tensor a rank holds (a parameter, a ZeRO piece of one, or an
optimizer state shaped like them) in the coordinates of the full, single-process tensor:

- per dimension, the *segments* that map local indices onto full ones: ``(local_start,
  full_start, length)``. A whole dimension is one segment; a dimension split by tensor
  parallelism is one segment per fused part (q, k and v each contribute their block), and local
  positions covered by no segment are padding;
- ``local_shape``: the shape of the rank's block (the tensor-parallel local shape);
- ``flat``: for a ZeRO piece, the range ``[start, end)`` of the block's row-major elements the
  piece holds (None: the whole block).

Two views of the same full tensor intersect in boxes: per dimension the overlapping segments
pair up, and their product gives rectangular copies from one block into the other. That is all
resharding needs, for every tensor mode, pipeline cut and ZeRO stage, because every layout
describes its tensors this way (``Strategy.checkpoint_tensors``, which lists them as
:class:`HeldTensor` records).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tessera.context.placement import ShardSpec, round_up

Segment = tuple[int, int, int]  # (local_start, full_start, length)


@dataclass(frozen=True, slots=True)
class View:
    """One held tensor in full coordinates (see the module docstring)."""

    full_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    segments: tuple[tuple[Segment, ...], ...]
    flat: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not (len(self.full_shape) == len(self.local_shape) == len(self.segments)):
            raise ValueError(f"view of {self.full_shape}: {len(self.segments)} segment lists, shape {self.local_shape}")
        if self.flat is not None:
            start, end = self.flat
            if not 0 <= start <= end <= math.prod(self.local_shape):
                raise ValueError(f"view flat range {self.flat} outside a block of {self.local_shape}")

    @property
    def numel(self) -> int:
        """Elements the held tensor has."""
        if self.flat is not None:
            return self.flat[1] - self.flat[0]
        return math.prod(self.local_shape)

    @property
    def block(self) -> View:
        """The whole block this view is (a flat range of)."""
        return View(self.full_shape, self.local_shape, self.segments, None)

    def valid_numel(self) -> int:
        """Elements of the block that hold real (unpadded) values."""
        return math.prod(sum(s[2] for s in segs) for segs in self.segments)

    def with_flat(self, start: int, end: int) -> View:
        return View(self.full_shape, self.local_shape, self.segments, (start, end))

    # ---- (de)serialisation for the index -----------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "local_shape": list(self.local_shape),
            "segments": [[list(s) for s in segs] for segs in self.segments],
            "flat": list(self.flat) if self.flat is not None else None,
        }

    @classmethod
    def from_json(cls, full_shape: Sequence[int], data: dict[str, Any]) -> View:
        flat = data.get("flat")
        return cls(
            tuple(full_shape),
            tuple(data["local_shape"]),
            tuple(tuple((int(a), int(b), int(c)) for a, b, c in segs) for segs in data["segments"]),
            (int(flat[0]), int(flat[1])) if flat is not None else None,
        )


@dataclass(frozen=True, slots=True)
class HeldTensor:
    """A tensor a rank holds for a checkpoint: the single-process state-dict ``key`` of the
    parameter or buffer it is (a block or piece of), the ``tensor`` holding its value (for a
    parameter, at the precision the optimizer steps: fp32 masters under mixed-precision ZeRO),
    and its ``view``."""

    key: str
    tensor: torch.Tensor
    view: View


def whole_view(shape: Sequence[int]) -> View:
    """The view of a tensor held whole (one shared object per shape: views are immutable, and
    a model asks for one per tensor)."""
    return _whole_view(tuple(int(n) for n in shape))


@functools.lru_cache(maxsize=1024)
def _whole_view(shape: tuple[int, ...]) -> View:
    return View(shape, shape, tuple(((0, 0, n),) if n > 0 else () for n in shape))


def spec_view(spec: ShardSpec, ctx: Any) -> View:
    """The view of this rank's tensor-parallel block of a tensor split by ``spec`` on ``ctx``
    (the same arithmetic as ``tessera.parallel.tensor.common.local_shard``)."""
    local_shape: list[int] = []
    segments: list[tuple[Segment, ...]] = []
    for dim, n in enumerate(spec.full_shape):
        if not spec.dims[dim]:
            local_shape.append(n)
            segments.append(((0, 0, n),) if n > 0 else ())
            continue
        parts, index, groups = spec.parts(dim, ctx), spec.index(dim, ctx), spec.groups[dim]
        per_group = n // groups
        block = round_up(per_group, spec.multiple(dim, ctx)) // parts
        segs = []
        for g in range(groups):
            start = index * block
            valid = max(0, min(block, per_group - start))
            if valid > 0:
                segs.append((g * block, g * per_group + start, valid))
        local_shape.append(groups * block)
        segments.append(tuple(segs))
    return View(tuple(spec.full_shape), tuple(local_shape), tuple(segments))


def _pairs(src: Sequence[Segment], dst: Sequence[Segment]) -> list[tuple[int, int, int]]:
    """Overlaps of two segment lists of one dimension: ``(src_local, dst_local, length)``."""
    out = []
    for s_local, s_full, s_len in src:
        for d_local, d_full, d_len in dst:
            lo, hi = max(s_full, d_full), min(s_full + s_len, d_full + d_len)
            if lo < hi:
                out.append((s_local + lo - s_full, d_local + lo - d_full, hi - lo))
    return out


def boxes(src: View, dst: View) -> Iterator[tuple[tuple[slice, ...], tuple[slice, ...]]]:
    """The rectangular copies from ``src``'s block into ``dst``'s block: pairs of index tuples
    ``(src_slices, dst_slices)``, ``dst_block[dst_slices] = src_block[src_slices]``."""
    if src.full_shape != dst.full_shape:
        raise ValueError(f"views of different tensors: {src.full_shape} and {dst.full_shape}")
    per_dim = [_pairs(s, d) for s, d in zip(src.segments, dst.segments)]
    for combo in itertools.product(*per_dim):
        yield (
            tuple(slice(a, a + n) for a, _, n in combo),
            tuple(slice(b, b + n) for _, b, n in combo),
        )


def overlaps(src: View, dst: View) -> bool:
    return next(boxes(src.block, dst.block), None) is not None


def copy_block(src_block: torch.Tensor, src: View, dst_block: torch.Tensor, dst: View) -> int:
    """Copy every element ``src``'s block shares with ``dst``'s block; returns how many."""
    copied = 0
    for s, d in boxes(src, dst):
        part = src_block[s]
        dst_block[d].copy_(part)
        copied += part.numel()
    return copied
