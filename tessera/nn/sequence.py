"""Attention and positions that follow the configured sequence parallelism: models written with
them run unchanged whether or not the ``sequence`` axis splits their tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.context import ParallelContext
from tessera.nn.layers import resolve_context
from tessera.parallel.sequence.attention import sequence_attention
from tessera.parallel.sequence.tokens import model_layout, token_positions


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    ctx: ParallelContext | None = None,
) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` over [b, h, s, d] for this rank's
    tokens. Under sequence parallelism (``parallel.sequence.size > 1``) ``q``, ``k`` and ``v``
    hold this rank's tokens of every sequence (as the engine hands them out) and the attention
    covers the whole sequence in the configured mode; otherwise it is torch's."""
    ctx = resolve_context(ctx)
    if ctx is None or ctx.size("sequence") == 1:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale)
    if dropout_p > 0.0:
        raise ValueError(
            f"attention dropout (dropout_p={dropout_p}) is not available under sequence parallelism: the "
            "attention weights of one query row are spread over the ranks; set the model's attention dropout to 0"
        )
    group, mode = ctx.group("sequence"), ctx.dims.sequence_mode
    layout = model_layout(mode, q.shape[2] * group.size, group.size)
    return sequence_attention(q, k, v, group, layout, mode, causal, scale=scale)


class Attention(torch.nn.Module):
    """:func:`attention` as a module: ``Attention(causal=True)(q, k, v)``; ``dropout`` applies
    in training only."""

    def __init__(self, causal: bool = False, dropout: float = 0.0, scale: float | None = None) -> None:
        super().__init__()
        self.causal, self.dropout, self.scale = causal, dropout, scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        return attention(q, k, v, causal=self.causal, dropout_p=p, scale=self.scale)


def positions(local: int, device: torch.device | str = "cpu", ctx: ParallelContext | None = None) -> torch.Tensor:
    """Global positions [local] of this rank's ``local`` tokens of a sequence: ``arange(local)``
    without sequence parallelism."""
    ctx = resolve_context(ctx)
    if ctx is None or ctx.size("sequence") == 1:
        return torch.arange(local, device=device)
    return token_positions(local, ctx.group("sequence"), ctx.dims.sequence_mode, device)


__all__ = ["Attention", "attention", "positions"]
