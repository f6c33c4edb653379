"""Attention over one block of keys at a time, in plain PyTorch: the kernel under every
sequence-parallel mode.

A block is this rank's queries ``q`` [b, h, sq, d] against one block of keys and values
[b, h, sk, d], with a ``keep`` mask (True: attend) broadcastable to [b, h, sq, sk]. The forward
returns the block's output and the log-sum-exp of its score rows, so that blocks combine
exactly (online softmax, :func:`merge`); the backward recomputes the block's probabilities from
the rows' final log-sum-exp (as FlashAttention does) instead of keeping them. A row whose keys
are all masked gives zeros (and a log-sum-exp of -inf), not NaN.

Masks are built from global positions (:func:`keep_mask`), so one rule serves contiguous and
zigzag layouts, causal or not, with the sequence's padding and a user's key-padding mask.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def keep_mask(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    length: int,
    causal: bool,
    key_keep: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Which keys each query may attend to: [sq, sk], or [b, 1, sq, sk] with ``key_keep``
    ([b, sk], True for real keys); None when every key is kept. ``q_pos`` [sq] and ``k_pos``
    [sk] are global positions; keys at or past ``length`` are padding."""
    keep = None
    if int(k_pos.max()) >= length:
        keep = (k_pos < length).unsqueeze(0).expand(q_pos.numel(), -1)
    if causal:
        later = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
        keep = later if keep is None else keep & later
    if key_keep is not None:
        pad = key_keep[:, None, None, :]
        keep = pad if keep is None else keep & pad
    return keep


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, keep: torch.Tensor | None) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if keep is not None:
        scores = scores.masked_fill(~keep, NEG_INF)
    return scores


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (rows with no key) as 0, so that exp(score - lse) is 0 there, not NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _fused(q: torch.Tensor, keep: torch.Tensor | None) -> bool:
    """Whether torch's fused CPU kernel (which returns the log-sum-exp) can run this block:
    a CPU block without a mask (a whole block, or a causal diagonal one)."""
    return keep is None and q.device.type == "cpu"


def _causal_keep(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()


def attend_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, keep: torch.Tensor | None, causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output [b, h, sq, d] and log-sum-exp [b, h, sq] of ``q`` over one key block; ``causal``
    (with no ``keep``): a diagonal block, query i sees keys up to i. On CPU a block without a
    mask runs in torch's fused kernel, otherwise in plain PyTorch (the same values to rounding)."""
    if _fused(q, keep):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    if causal and keep is None:
        keep = _causal_keep(q, k)
    scores = _scores(q, k, scale, keep)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
    return torch.matmul(probs, v), lse


def merge(
    out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial results over disjoint key sets (online softmax)."""
    if out is None or lse is None:
        return block_out, block_lse
    total = torch.logaddexp(lse, block_lse)
    finite = _finite(total)
    mixed = out * torch.exp(lse - finite).unsqueeze(-1) + block_out * torch.exp(block_lse - finite).unsqueeze(-1)
    return mixed, total


def block_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    keep: torch.Tensor | None,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    out: torch.Tensor,
    delta: torch.Tensor,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of one block, from the rows' final output ``out`` [b, h, sq, d] and
    log-sum-exp ``lse`` [b, h, sq] over every block, the output's gradient ``grad_out`` and
    ``delta`` = rowsum(grad_out * out) [b, h, sq]; ``causal`` as in :func:`attend_block`."""
    if _fused(q, keep):
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, scale=scale
        )
        return grads[0], grads[1], grads[2]
    if causal and keep is None:
        keep = _causal_keep(q, k)
    probs = torch.exp(_scores(q, k, scale, keep) - _finite(lse).unsqueeze(-1))
    dv = torch.matmul(probs.transpose(-1, -2), grad_out)
    dprobs = torch.matmul(grad_out, v.transpose(-1, -2))
    dscores = probs * (dprobs - delta.unsqueeze(-1))
    dq = torch.matmul(dscores, k).mul_(scale)
    dk = torch.matmul(dscores.transpose(-1, -2), q).mul_(scale)
    return dq, dk, dv


__all__ = ["attend_block", "block_grads", "keep_mask", "merge"]
