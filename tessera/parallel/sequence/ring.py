"""Ring attention with online softmax (Liu et al. 2023).

Each member holds its queries, keys and values (its tokens in a :class:`SequenceLayout`). The
key/value blocks circulate around the ring; each member attends its queries to every block as
it passes, one piece pair at a time (a zigzag layout has two pieces per member: a causal pair
with nothing to attend is skipped, which is what balances the work), and combines the partial
results by their log-sum-exp. No member ever holds more than [local x local] scores.

Backward (recomputing each block's probabilities from the saved log-sum-exp): the blocks
circulate again; each member adds its queries' gradient locally and contributes to the
visiting block's key and value gradients, which are summed on their way home
(:func:`~tessera.parallel.sequence.circulate.circulate_reduce`). Per layer and member: the key
and value blocks make N - 1 hops forward, N - 1 again backward, and the fp32 gradient sums of
keys and values N - 1 hops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tessera.comm import Group, resolve
from tessera.parallel.sequence.blocks import attend_block, block_grads, keep_mask, merge
from tessera.parallel.sequence.circulate import Blocks, circulate, circulate_reduce
from tessera.parallel.sequence.layout import SequenceLayout


@dataclass(frozen=True)
class _Pair:
    """A query piece of this member against a key piece of ``origin``'s block: local slices,
    the pieces' global starts and sizes, and whether it needs a mask (padded keys, a key-padding
    mask, or a causal cut through it) or is a causal diagonal (a piece against itself)."""

    queries: slice
    keys: slice
    q_start: int
    k_start: int
    masked: bool
    diagonal: bool

    def keep(
        self, length: int, causal: bool, key_keep: torch.Tensor | None, device: torch.device
    ) -> torch.Tensor | None:
        """The pair's mask (None when it needs none), built from global positions."""
        if not self.masked:
            return None
        q_pos = torch.arange(self.q_start, self.q_start + self.queries.stop - self.queries.start, device=device)
        k_pos = torch.arange(self.k_start, self.k_start + self.keys.stop - self.keys.start, device=device)
        pad = None if key_keep is None else key_keep[:, self.keys]
        return keep_mask(q_pos, k_pos, length, causal, pad)


def _plan(layout: SequenceLayout, rank: int, causal: bool, key_mask: bool) -> list[list[_Pair]]:
    """Per origin member, the piece pairs this member attends with something to attend (from
    the layout alone: the same in the forward and the backward pass)."""

    plan = []
    for origin in range(layout.size):
        pairs = []
        for q_off, q_start, q_n in layout.local_pieces(rank):
            for k_off, k_start, k_n in layout.local_pieces(origin):
                if causal and k_start > q_start + q_n - 1:
                    continue  # every key of the piece comes after every query
                if k_start >= layout.length:
                    continue  # all padding
                whole = not key_mask and k_start + k_n <= layout.length
                diagonal = causal and whole and q_n == k_n and q_start == k_start
                masked = not (whole and (diagonal or not causal or k_start + k_n <= q_start))
                pairs.append(_Pair(slice(q_off, q_off + q_n), slice(k_off, k_off + k_n), q_start, k_start,
                                   masked, diagonal and not masked))  # fmt: skip
        plan.append(pairs)
    return plan


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_keep: torch.Tensor | None,
        group: Group,
        layout: SequenceLayout,
        causal: bool,
        scale: float,
    ) -> torch.Tensor:
        g = resolve(group)
        plan = _plan(layout, g.rank, causal, key_keep is not None)
        b, h, local, d = q.shape
        out = torch.zeros(b, h, local, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, local), float("-inf"), dtype=torch.float32, device=q.device)

        def visit(origin: int, blocks: Blocks) -> None:
            k_blk, v_blk = blocks[0][0], blocks[0][1]
            keep_blk = blocks[1] != 0 if len(blocks) > 1 else None
            for pair in plan[origin]:
                qs, ks, keep = pair.queries, pair.keys, pair.keep(layout.length, causal, keep_blk, q.device)
                part, part_lse = attend_block(q[:, :, qs], k_blk[:, :, ks], v_blk[:, :, ks], scale, keep, pair.diagonal)
                out[:, :, qs], lse[:, :, qs] = merge(out[:, :, qs], lse[:, :, qs], part.float(), part_lse.float())

        circulate(_blocks(k, v, key_keep), g, visit)
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, key_keep, result, lse)
        ctx.setup = (g, plan, layout.length, causal, scale)
        return result

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, key_keep, out, lse = ctx.saved_tensors
        g, plan, length, causal, scale = ctx.setup
        grad_out = grad_out.contiguous()
        delta = (grad_out.float() * out.float()).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)

        def contribute(origin: int, blocks: Blocks) -> torch.Tensor:
            k_blk, v_blk = blocks[0][0], blocks[0][1]
            keep_blk = blocks[1] != 0 if len(blocks) > 1 else None
            dkv = torch.zeros((2, *k_blk.shape), dtype=torch.float32, device=q.device)
            for pair in plan[origin]:
                qs, ks, keep = pair.queries, pair.keys, pair.keep(length, causal, keep_blk, q.device)
                dq_p, dk_p, dv_p = block_grads(
                    q[:, :, qs], k_blk[:, :, ks], v_blk[:, :, ks], scale, keep,
                    lse[:, :, qs], grad_out[:, :, qs], out[:, :, qs], delta[:, :, qs], pair.diagonal,
                )  # fmt: skip
                dq[:, :, qs] += dq_p.float()
                dkv[0][:, :, ks] += dk_p.float()
                dkv[1][:, :, ks] += dv_p.float()
            return dkv

        dkv = circulate_reduce(_blocks(k, v, key_keep), g, contribute)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def _blocks(k: torch.Tensor, v: torch.Tensor, key_keep: torch.Tensor | None) -> Blocks:
    kv = torch.stack([k, v]).contiguous()
    return (kv,) if key_keep is None else (kv, key_keep.to(torch.uint8).contiguous())  # gloo sends no bool


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group,
    layout: SequenceLayout,
    causal: bool = False,
    key_keep: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of this member's queries over the whole sequence: ``q``, ``k``, ``v``
    [b, h, layout.local, d] hold this member's tokens of ``layout``; ``key_keep`` [b, local]
    (True: a real key) is this member's part of a key-padding mask. Returns [b, h, local, d]."""
    return _RingAttention.apply(
        q, k, v, key_keep, group, layout, causal, q.shape[-1] ** -0.5 if scale is None else scale
    )  # type: ignore[no-any-return]


__all__ = ["ring_attention"]
