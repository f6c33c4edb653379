"""Ring self-attention (Li et al. 2021): RingQK and RingAV.

RingQK: the key blocks circulate and each member fills its queries' full score rows
[b, h, local, padded] block by block; the softmax runs over whole rows. RingAV: the value blocks
circulate and each member sums its probabilities' column block times the visiting values. Each
backward circulates the blocks again and sums the blocks' gradients on their way home. Simple
and exact, but every member holds full score rows (local x padded per head): the memory that ring
attention with online softmax (:mod:`tessera.parallel.sequence.ring`) avoids.
"""

from __future__ import annotations

from typing import Any

import torch

from tessera.comm import Group, resolve
from tessera.parallel.sequence.blocks import keep_mask
from tessera.parallel.sequence.circulate import Blocks, circulate, circulate_reduce
from tessera.parallel.sequence.layout import SequenceLayout


class _RingQK(torch.autograd.Function):
    """Scores [b, h, local, padded] (keys in global order) of this member's queries."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, group: Group, layout: SequenceLayout, scale: float
    ) -> torch.Tensor:  # type: ignore[override]
        g = resolve(group)
        b, h, local, _ = q.shape
        scores = q.new_empty(b, h, local, layout.padded)

        def visit(origin: int, blocks: Blocks) -> None:
            for offset, start, n in layout.local_pieces(origin):
                scores[..., start : start + n] = torch.matmul(q, blocks[0][:, :, offset : offset + n].transpose(-1, -2))

        circulate((k.contiguous(),), g, visit)
        scores.mul_(scale)
        ctx.save_for_backward(q, k)
        ctx.setup = (g, layout, scale)
        return scores

    @staticmethod
    def backward(ctx: Any, grad_scores: torch.Tensor) -> tuple[Any, ...]:
        q, k = ctx.saved_tensors
        g, layout, scale = ctx.setup
        grad = grad_scores * scale
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)

        def contribute(origin: int, blocks: Blocks) -> torch.Tensor:
            k_blk = blocks[0]
            dk = torch.zeros(k_blk.shape, dtype=torch.float32, device=q.device)
            for offset, start, n in layout.local_pieces(origin):
                cols = grad[..., start : start + n]
                dq.add_(torch.matmul(cols, k_blk[:, :, offset : offset + n]).float())
                dk[:, :, offset : offset + n] = torch.matmul(cols.transpose(-1, -2), q).float()
            return dk

        dk = circulate_reduce((k.contiguous(),), g, contribute)
        return dq.to(q.dtype), dk.to(k.dtype), None, None, None


class _RingAV(torch.autograd.Function):
    """Output [b, h, local, d] = probabilities [b, h, local, padded] times every member's values."""

    @staticmethod
    def forward(ctx: Any, probs: torch.Tensor, v: torch.Tensor, group: Group, layout: SequenceLayout) -> torch.Tensor:  # type: ignore[override]
        g = resolve(group)
        b, h, local, _ = probs.shape
        out = torch.zeros(b, h, local, v.shape[-1], dtype=torch.float32, device=v.device)

        def visit(origin: int, blocks: Blocks) -> None:
            for offset, start, n in layout.local_pieces(origin):
                out.add_(torch.matmul(probs[..., start : start + n], blocks[0][:, :, offset : offset + n]).float())

        circulate((v.contiguous(),), g, visit)
        ctx.save_for_backward(probs, v)
        ctx.setup = (g, layout)
        return out.to(v.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        probs, v = ctx.saved_tensors
        g, layout = ctx.setup
        grad_probs = torch.empty_like(probs)

        def contribute(origin: int, blocks: Blocks) -> torch.Tensor:
            v_blk = blocks[0]
            dv = torch.zeros(v_blk.shape, dtype=torch.float32, device=v.device)
            for offset, start, n in layout.local_pieces(origin):
                part = v_blk[:, :, offset : offset + n]
                grad_probs[..., start : start + n] = torch.matmul(grad_out, part.transpose(-1, -2))
                dv[:, :, offset : offset + n] = torch.matmul(
                    probs[..., start : start + n].transpose(-1, -2), grad_out
                ).float()
            return dv

        dv = circulate_reduce((v.contiguous(),), g, contribute)
        return grad_probs, dv.to(v.dtype), None, None


def _whole(key_keep: torch.Tensor, group: Group, layout: SequenceLayout) -> torch.Tensor:
    """The whole key-padding mask [b, padded] from every member's part [b, local]."""
    whole = torch.zeros(key_keep.shape[0], layout.padded, dtype=torch.bool, device=key_keep.device)

    def visit(origin: int, blocks: Blocks) -> None:
        for offset, start, n in layout.local_pieces(origin):
            whole[:, start : start + n] = blocks[0][:, offset : offset + n] != 0

    circulate((key_keep.to(torch.uint8).contiguous(),), group, visit)  # gloo sends no bool
    return whole


def ring_self_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group,
    layout: SequenceLayout,
    causal: bool = False,
    key_keep: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Ring self-attention of this member's queries over the whole sequence; the arguments
    are those of :func:`~tessera.parallel.sequence.ring.ring_attention` (a ``key_keep`` part is
    gathered over the ring once, [b, padded])."""
    g = resolve(group)
    scores = _RingQK.apply(q, k, g, layout, q.shape[-1] ** -0.5 if scale is None else scale)
    q_pos = layout.positions(g.rank, q.device)
    k_pos = torch.arange(layout.padded, device=q.device)
    whole_keep = None if key_keep is None else _whole(key_keep, g, layout)
    keep = keep_mask(q_pos, k_pos, layout.length, causal, whole_keep)
    if keep is not None:  # a finite floor: a row with no key gets zeros below, not NaN
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1)
    if keep is not None:
        probs = probs * keep.any(dim=-1, keepdim=True)
    return _RingAV.apply(probs, v, g, layout)  # type: ignore[no-any-return]


__all__ = ["ring_self_attention"]
