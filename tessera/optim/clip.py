"""Gradient norm over the whole model, however its parameters are spread over ranks.

Each parameter may say along which axes it is split (``param.tessera_sharded_along``, a tuple
of axis names, set by tensor-parallel layers); its squared norm is then summed over those axes.
Parameters on different pipeline stages are distinct, so the total is summed over the pipeline
axis too. Replicas (the data axis) hold the same gradients after reduction and are not summed.
(ZeRO's pieces are summed by ``ZeroOptimizer.grad_norm``, which knows every rank's layout.)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch

from tessera import comm
from tessera.context import ParallelContext


def global_grad_norm(params: Iterable[torch.nn.Parameter], ctx: ParallelContext | None = None) -> torch.Tensor:
    """The 2-norm of all gradients of the model (a 0-dim fp32 tensor)."""
    by_axes: dict[tuple[str, ...], list[torch.Tensor]] = defaultdict(list)
    stage = ctx.local_rank("pipeline") if ctx is not None else 0
    for p in params:
        owner = getattr(p, "tessera_pipeline_owner", None)
        if owner is not None and owner != stage:
            continue  # counted on its owning stage (a tied parameter has gradients on several)
        if p.grad is not None:
            by_axes[tuple(getattr(p, "tessera_sharded_along", ()))].append(p.grad)
    device = ctx.device if ctx is not None else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for axes, grads in sorted(by_axes.items()):
        norms = torch._foreach_norm(grads, 2.0)
        squares = torch.stack([n.float() for n in norms]).pow(2).sum()
        if ctx is not None:
            for axis in axes:
                comm.all_reduce(squares, ctx.group(axis))
        total = total + squares
    if ctx is not None:
        comm.all_reduce(total, ctx.group("pipeline"))
    return total.sqrt()


def clip_grad_norm_(
    params: Iterable[torch.nn.Parameter],
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
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return norm
