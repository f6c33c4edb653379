"""Filling a rank's tensor from the pieces of a checkpoint written under any layout.

The target is a tensor and its :class:`~tessera.context.views.View`; the source is the index
entry of the same single-process tensor. Only the pieces whose blocks overlap the target's
block are read, one block at a time, so no rank ever holds more than one parameter's block
beyond its own share:

- a piece with the very view of the target (the same layout) is copied as it is;
- pieces of the same block (ZeRO shards over another data size) are copied range by range;
- otherwise each overlapping source block is assembled (its ZeRO pieces put side by side) and
  the boxes it shares with the target's block are copied (``tessera.context.views.boxes``).

Every element the target holds must come from some piece, or the load fails naming the tensor.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tessera.checkpoint.format import CheckpointError, Reader, dtype_of, piece_views
from tessera.context.views import View, copy_block, overlaps


def fill(reader: Reader, name: str, entry: dict[str, Any], target: torch.Tensor, view: View) -> None:
    """Write the checkpoint's values of tensor ``name`` for ``view`` into ``target`` (whose
    shape is the view's local shape, or its flat length for a piece)."""
    if tuple(entry["shape"]) != view.full_shape:
        raise CheckpointError(
            f"{name}: the checkpoint holds shape {tuple(entry['shape'])}, the model has {view.full_shape}"
        )
    pieces = piece_views(entry)
    with torch.no_grad():
        for source, piece in pieces:
            if source == view:  # the same layout: one piece is exactly this tensor
                target.copy_(reader.read(name, piece).reshape(target.shape))
                return
        if view.flat is not None and all(s.block == view.block for s, _ in pieces):
            _fill_flat(reader, name, pieces, target, view)
            return
        _fill_boxes(reader, name, entry, pieces, target, view)


def _fill_flat(
    reader: Reader, name: str, pieces: list[tuple[View, dict[str, Any]]], target: torch.Tensor, view: View
) -> None:
    """Pieces and target are ranges of the same block: copy the overlapping ranges."""
    assert view.flat is not None
    lo, hi = view.flat
    flat_target = target.reshape(-1)
    copied = 0
    for source, piece in pieces:
        a, b = source.flat if source.flat is not None else (0, math.prod(source.local_shape))
        start, end = max(a, lo), min(b, hi)
        if start < end:
            values = reader.read(name, piece).reshape(-1)
            flat_target[start - lo : end - lo].copy_(values[start - a : end - a])
            copied += end - start
    if copied != hi - lo:
        raise CheckpointError(f"{name}: the checkpoint lacks {hi - lo - copied} of the elements this rank needs")


def _fill_boxes(
    reader: Reader,
    name: str,
    entry: dict[str, Any],
    pieces: list[tuple[View, dict[str, Any]]],
    target: torch.Tensor,
    view: View,
) -> None:
    dtype = dtype_of(entry["dtype"])
    dst = view.block
    block = target if view.flat is None else torch.zeros(dst.local_shape, dtype=target.dtype, device=target.device)
    groups: dict[View, list[tuple[View, dict[str, Any]]]] = {}
    for source, piece in pieces:
        groups.setdefault(source.block, []).append((source, piece))
    copied = 0
    for src, members in groups.items():
        if not overlaps(src, dst):
            continue
        if len(members) == 1 and members[0][0].flat is None:
            values = reader.read(name, members[0][1]).reshape(src.local_shape)
        else:  # ZeRO pieces of one block: put them side by side
            values = torch.zeros(math.prod(src.local_shape), dtype=dtype)
            held = 0
            for source, piece in members:
                a, b = source.flat if source.flat is not None else (0, values.numel())
                values[a:b] = reader.read(name, piece).reshape(-1)
                held += b - a
            if held < values.numel():
                raise CheckpointError(f"{name}: a block of the checkpoint misses {values.numel() - held} elements")
            values = values.reshape(src.local_shape)
        copied += copy_block(values, src, block, dst)
    if copied != dst.valid_numel():
        raise CheckpointError(
            f"{name}: the checkpoint lacks {dst.valid_numel() - copied} of the elements this rank needs"
        )
    if view.flat is not None:
        a, b = view.flat
        target.reshape(-1).copy_(block.reshape(-1)[a:b])
