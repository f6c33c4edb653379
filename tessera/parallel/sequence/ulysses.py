"""All-to-all sequence parallelism (DeepSpeed-Ulysses).

Before attention, one all-to-all each for the queries, keys and values turns the sequence split
into a head split: [b, h, local, d] on each member becomes [b, h / N, padded, d], the whole
sequence for h / N heads (in member order: member 0's tokens, then member 1's, ...). Attention
then runs locally, and a fourth all-to-all turns the output back. Per layer and member: four
all-to-alls of b * local * h * d elements forward, four backward. The head count must divide
by N.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera import comm
from tessera.comm import Group, resolve
from tessera.parallel.sequence.blocks import keep_mask
from tessera.parallel.sequence.layout import SequenceLayout


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None, causal: bool, scale: float
) -> torch.Tensor:
    """Attention with a ``keep`` mask (broadcastable to [b, h, sq, sk]); a query row with no
    key gives zeros. Without a mask, torch's fused kernel (``is_causal`` for a causal one)."""
    if keep is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)  # finite: no NaN for empty rows
    probs = torch.softmax(scores, dim=-1) * keep.any(dim=-1, keepdim=True)
    return torch.matmul(probs, v)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group,
    layout: SequenceLayout,
    causal: bool = False,
    key_keep: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """All-to-all attention of this member's tokens; the arguments are those of
    :func:`~tessera.parallel.sequence.ring.ring_attention`."""
    g = resolve(group)
    heads = q.shape[1]
    if heads % g.size:
        raise ValueError(
            f"all-to-all sequence parallelism splits the heads over the {g.size} ranks of the sequence axis: "
            f"{heads} heads do not divide by {g.size}; use a head count divisible by it or mode 'ring'"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qh, kh, vh = (comm.all_to_all_forward_all_to_all_backward(t, g, scatter_dim=1, gather_dim=2) for t in (q, k, v))
    pos = torch.cat([layout.positions(m, q.device) for m in range(g.size)])
    whole_keep = None
    if key_keep is not None:
        whole_keep = comm.all_gather(key_keep.to(torch.uint8).contiguous(), g, dim=1) != 0  # gloo sends no bool
    in_order = not layout.zigzag and layout.padded == layout.length
    keep = None if in_order and whole_keep is None else keep_mask(pos, pos, layout.length, causal, whole_keep)
    out = masked_attention(qh, kh, vh, keep, causal, scale)
    return comm.all_to_all_forward_all_to_all_backward(out, g, scatter_dim=2, gather_dim=1)


__all__ = ["masked_attention", "ulysses_attention"]
