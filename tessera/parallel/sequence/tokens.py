"""A model under sequence parallelism: each rank of the ``sequence`` axis runs the model on its
tokens of every sequence of the micro-batch.

The engine hands the model and the loss this rank's tokens (:func:`take_tokens`, along dim 1 of
every tensor of the batch whose dim 1 is the sequence); positions come from
:func:`token_positions` (global ones, so learned and rotary position embeddings see what they
would in one process); attention over the whole sequence runs through
:func:`~tessera.parallel.sequence.attention.sequence_attention` with :func:`model_layout`.
Every rank's loss is the mean over its tokens: all ranks hold equally many, so the mean of the
ranks' losses (and of their gradients, which the strategies average over data and sequence) is
the whole sequence's.

At the model level the sequence length must divide into the layout's pieces (the functional
core also handles lengths that need padding, given the layout).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from tessera.comm import AxisGroup
from tessera.parallel.sequence.attention import layout_for
from tessera.parallel.sequence.layout import SequenceLayout


def model_layout(
    mode: str, length: int, size: int, *, items: str = "a length of {length} tokens does",
    remedy: str = "pad the batches to a multiple of {pieces}",
) -> SequenceLayout:  # fmt: skip
    """The layout a model's tokens are split in (:func:`layout_for`); ``length`` must divide
    into its pieces. ``items`` and ``remedy`` word the error for what is split (frames, say):
    templates of ``{length}`` and ``{pieces}``."""
    layout = layout_for(mode, length, size)
    if layout.padded != length:
        pieces = layout.pieces_total
        raise ValueError(
            f"sequence parallelism over {size} ranks in mode {mode!r} cuts each sequence into {pieces} "
            f"equal pieces: {items.format(length=length)} not divide by {pieces}; {remedy.format(pieces=pieces)}"
        )
    return layout


def take_tokens(batch: Any, group: AxisGroup, mode: str, length: int) -> Any:
    """``batch`` with every tensor whose dim 1 has ``length`` entries cut to this rank's tokens
    (other leaves unchanged)."""
    layout = model_layout(mode, length, group.size)

    def cut(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2 and leaf.shape[1] == length:
            return layout.split(leaf, 1, group.rank)
        return leaf

    return tree_map(cut, batch)


def sequence_length_of(batch: Any) -> int | None:
    """The sequence length of a batch: dim 1 of its first tensor with two or more dims."""
    found: list[int] = []

    def look(leaf: Any) -> Any:
        if not found and isinstance(leaf, torch.Tensor) and leaf.dim() >= 2:
            found.append(leaf.shape[1])
        return leaf

    tree_map(look, batch)
    return found[0] if found else None


def token_positions(local: int, group: AxisGroup, mode: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """Global positions [local] of this rank's ``local`` tokens."""
    return model_layout(mode, local * group.size, group.size).positions(group.rank, device)


__all__ = ["model_layout", "sequence_length_of", "take_tokens", "token_positions"]
