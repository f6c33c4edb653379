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

from typing import Any

import torch

from tessera.comm import Group, resolve
from tessera.parallel.sequence.blocks import attend_block, block_grads, keep_mask, merge
from tessera.parallel.sequence.circulate import Blocks, circulate, circulate_reduce
from tessera.parallel.sequence.layout import SequenceLayout


class _Pieces:
    """Local offsets and global positions of the pieces of every member's tokens."""

    def __init__(self, layout: SequenceLayout, device: torch.device) -> None:
        self.layout = layout
        self.of: list[list[tuple[int, int, torch.Tensor]]] = []  # member -> [(offset, tokens, positions)]
        for member in range(layout.size):
            offset, pieces = 0, []
            for start, n in layout.pieces(member):
                pieces.append((offset, n, torch.arange(start, start + n, device=device)))
                offset += n
            self.of.append(pieces)


def _pairs(
    pieces: _Pieces, rank: int, origin: int, causal: bool, key_keep: torch.Tensor | None
) -> list[tuple[slice, slice, torch.Tensor | None, bool]]:
    """(query slice, key slice, keep mask, diagonal) of each piece pair with something to
    attend: a pair of whole pieces needs no mask (every key is attended to, or, for a piece
    with itself under a causal mask, the diagonal rule); the others get one."""
    out = []
    length = pieces.layout.length
    for q_off, q_n, q_pos in pieces.of[rank]:
        for k_off, k_n, k_pos in pieces.of[origin]:
            if causal and int(k_pos[0]) > int(q_pos[-1]):
                continue  # every key of the piece comes after every query
            if int(k_pos[0]) >= length:
                continue  # all padding
            whole = key_keep is None and int(k_pos[-1]) < length
            diagonal = causal and whole and q_n == k_n and int(q_pos[0]) == int(k_pos[0])
            if whole and (diagonal or not causal or int(k_pos[-1]) < int(q_pos[0])):
                keep = None
            else:
                pad = None if key_keep is None else key_keep[:, k_off : k_off + k_n]
                keep = keep_mask(q_pos, k_pos, length, causal, pad)
                diagonal = False
            out.append((slice(q_off, q_off + q_n), slice(k_off, k_off + k_n), keep, diagonal))
    return out


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
        pieces = _Pieces(layout, q.device)
        b, h, local, d = q.shape
        out = torch.zeros(b, h, local, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, local), float("-inf"), dtype=torch.float32, device=q.device)

        def visit(origin: int, blocks: Blocks) -> None:
            k_blk, v_blk = blocks[0][0], blocks[0][1]
            keep_blk = blocks[1] != 0 if len(blocks) > 1 else None
            for qs, ks, keep, diagonal in _pairs(pieces, g.rank, origin, causal, keep_blk):
                part, part_lse = attend_block(q[:, :, qs], k_blk[:, :, ks], v_blk[:, :, ks], scale, keep, diagonal)
                out[:, :, qs], lse[:, :, qs] = merge(out[:, :, qs], lse[:, :, qs], part.float(), part_lse.float())

        circulate(_blocks(k, v, key_keep), g, visit)
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, key_keep, result, lse)
        ctx.setup = (g, pieces, causal, scale)
        return result

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, key_keep, out, lse = ctx.saved_tensors
        g, pieces, causal, scale = ctx.setup
        grad_out = grad_out.contiguous()
        delta = (grad_out.float() * out.float()).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)

        def contribute(origin: int, blocks: Blocks) -> torch.Tensor:
            k_blk, v_blk = blocks[0][0], blocks[0][1]
            keep_blk = blocks[1] != 0 if len(blocks) > 1 else None
            dkv = torch.zeros((2, *k_blk.shape), dtype=torch.float32, device=q.device)
            for qs, ks, keep, diagonal in _pairs(pieces, g.rank, origin, causal, keep_blk):
                dq_p, dk_p, dv_p = block_grads(
                    q[:, :, qs], k_blk[:, :, ks], v_blk[:, :, ks], scale, keep,
                    lse[:, :, qs], grad_out[:, :, qs], out[:, :, qs], delta[:, :, qs], diagonal,
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
