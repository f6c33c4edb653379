"""Clip gradients by the global norm of the whole model, however its parameters are spread over
ranks (the norm itself is :func:`tessera.optim.norms.global_grad_norm`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tessera.context import ParallelContext
from tessera.optim.norms import global_grad_norm


def clip_grad_norm_(
    params: Iterable[torch.Tensor],
    max_norm: float,
    ctx: ParallelContext | None = None,
    norm: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm``; returns the norm before
    (``norm``: that norm when the caller has computed it already).

    Same arithmetic as ``torch.nn.utils.clip_grad_norm_``: ``g *= min(1, max_norm / (norm + 1e-6))``.
    """
    params = list(params)
    if norm is None:
        norm = global_grad_norm(params, ctx)
    coef = clip_coefficient(norm, max_norm)
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return norm


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor that clipping multiplies gradients of global norm ``norm`` by:
    ``min(1, max_norm / (norm + 1e-6))`` (``torch.nn.utils.clip_grad_norm_``'s arithmetic)."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)
