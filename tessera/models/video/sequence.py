"""What each rank holds of a video under sequence parallelism, and the two attentions over it.

A clip of ``T`` frames of ``S`` patches each is split over the ``N`` ranks of the ``sequence``
axis **by frames**: rank r holds the frames the axis' layout gives it (``layout_for(mode, T, N)``:
contiguous for ``all_to_all`` and ``ring_qk``; zigzag, 2N pieces, for ``ring``), every patch of
each. Spatial attention (within a frame), cross-attention and the MLP then run on each rank's
frames without communication. Temporal attention (across the frames, at each patch position)
needs every frame:

- ``all_to_all`` (Open-Sora 1.x): one all-to-all turns the activations ``[B, T/N, S, D]`` into
  ``[B, T, S/N, D]`` (every frame, this rank's patch positions), attention over the frames runs
  locally, and a second all-to-all turns the output back. Each moves ``B * T/N * S * D``
  elements per rank (of which ``(N-1)/N`` leave it); the backward runs both in reverse. ``S``
  must divide by ``N``.
- ``ring`` / ``ring_qk`` (Open-Sora 2.0's ring attention): the frames stay split; attention over
  the frame axis, with every patch position a row of the batch (``B * S`` rows), runs as
  :func:`~tessera.parallel.sequence.sequence_attention` over the sequence group: ``N - 1`` hops
  of the key and value blocks, ``2 * B * S * heads * T/N * head_dim`` elements per hop for
  ``ring``.

Batches are split by :func:`take_frames` (the engine calls it through
:meth:`~tessera.models.video.model.VideoDiT.sequence_tokens`): dim 2 of every 5-dim tensor
(``[B, C, T, H, W]``: the noisy latents and the velocity target), nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from tessera import comm
from tessera.comm import AxisGroup
from tessera.context import ParallelContext
from tessera.parallel.sequence import SequenceLayout, sequence_attention
from tessera.parallel.sequence.tokens import model_layout

#: ``attend(q, k, v) -> y`` over ``[rows, heads, frames, head_dim]``
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def frame_layout(mode: str, frames: int, size: int) -> SequenceLayout:
    """The frames each rank holds: ``mode``'s layout of ``frames`` over ``size`` ranks. A clip
    whose frames do not divide into the layout's pieces is refused, naming the numbers."""
    return model_layout(
        mode, frames, size, items="{length} frames do", remedy="use clips of a multiple of {pieces} frames"
    )


def take_frames(batch: Any, group: AxisGroup, mode: str) -> Any:
    """``batch`` with dim 2 (frames) of every 5-dim tensor ``[B, C, T, H, W]`` cut to this rank's
    frames; other leaves (timesteps, captions) unchanged."""

    def cut(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() == 5:
            return frame_layout(mode, leaf.shape[2], group.size).split(leaf, 2, group.rank)
        return leaf

    return tree_map(cut, batch)


@dataclass(frozen=True)
class FrameSplit:
    """This rank's share of a clip of ``frames`` frames over ``group`` (None: one process)."""

    frames: int
    group: AxisGroup | None = None
    mode: str = "ring"

    @staticmethod
    def of(ctx: ParallelContext | None, local_frames: int) -> FrameSplit:
        """The split the current layout gives a rank holding ``local_frames`` frames."""
        if ctx is None or ctx.size("sequence") == 1:
            return FrameSplit(local_frames)
        group = ctx.group("sequence")
        return FrameSplit(local_frames * group.size, group, ctx.dims.sequence_mode)

    @property
    def size(self) -> int:
        return 1 if self.group is None else self.group.size

    @property
    def layout(self) -> SequenceLayout:
        return frame_layout(self.mode, self.frames, self.size)

    def frame_indices(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Global indices [T/N] of this rank's frames (in its local order)."""
        if self.group is None:
            return torch.arange(self.frames, device=device)
        return self.layout.positions(self.group.rank, device)

    def temporal(self, x: torch.Tensor, project: Callable[[torch.Tensor, Attend], torch.Tensor]) -> torch.Tensor:
        """``project(h, attend)`` over the frame axis of ``x`` [B, T/N, S, D]: ``project`` maps
        tokens ``[rows, frames, D]`` to their attention output, calling ``attend`` for the
        attention itself; this routes it over the ranks as the mode says. Returns [B, T/N, S, D]."""
        b, t, s, d = x.shape
        if self.group is None or self.mode != "all_to_all":
            rows = x.transpose(1, 2).reshape(b * s, t, d)  # each patch position a row, its frames the sequence
            out = project(rows, self._attend)
            return out.reshape(b, s, t, d).transpose(1, 2)
        if s % self.size:
            raise ValueError(
                f"all-to-all sequence parallelism splits each frame's {s} patches over the {self.size} ranks for "
                f"temporal attention: {s} does not divide by {self.size}; use mode 'ring' or another frame size"
            )
        # [B, T/N, S, D] -> [B, T, S/N, D]: every frame, this rank's patch positions
        whole = comm.all_to_all_forward_all_to_all_backward(x.contiguous(), self.group, scatter_dim=2, gather_dim=1)
        s_local = whole.shape[2]
        rows = whole.transpose(1, 2).reshape(b * s_local, self.frames, d)
        out = project(rows, _local_attention).reshape(b, s_local, self.frames, d).transpose(1, 2)
        return comm.all_to_all_forward_all_to_all_backward(out.contiguous(), self.group, scatter_dim=1, gather_dim=2)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return _local_attention(q, k, v)
        return sequence_attention(q, k, v, self.group, self.layout, self.mode)


def _local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)


__all__ = ["Attend", "FrameSplit", "frame_layout", "take_frames"]
