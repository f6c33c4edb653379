"""LARS: SGD with momentum and a layer-wise learning rate (You et al. 2017, "Large Batch Training
of Convolutional Networks"), in the "LARS with momentum" form most implementations use (the
local rate scales the gradient before it enters the momentum buffer).

For each parameter ``w`` with gradient ``g``::

    local_lr = trust_coefficient * ||w|| / (||g|| + weight_decay * ||w|| + eps)
                                 (1 if ||w|| or ||g|| is 0)
    d = (g + weight_decay * w) * local_lr
    buf = momentum * buf + d     (buf starts at 0, so the first step sets buf = d)
    w = w - lr * buf

An excluded parameter (by default a bias or norm weight) gets neither the local rate nor weight
decay: ``d = g``, plain SGD with momentum. The norms are of the WHOLE parameter, however it is
split over ranks (see :mod:`tessera.optim.norms`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from tessera.context import ParallelContext
from tessera.optim.lamb import ExcludeRule, check_hyperparameters, default_exclude
from tessera.optim.norms import mesh_of, whole_sq_norms, zero_layout_of


class LARS(torch.optim.Optimizer):
    """LARS (see the module docstring for the exact formulas).

    ``exclude(param) -> bool`` picks the parameters that get no local rate and no weight decay;
    by default those whose whole parameter has ``ndim <= 1``. ``ctx``: the parallel context whose
    groups sum the norms of split parameters (default: the current tessera context, if any).
    ``defaults`` holds only the numeric hyperparameters, so ``LARS(other, **opt.defaults)``
    builds the same optimizer over other tensors.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 1e-8,
        *,
        exclude: ExcludeRule | None = None,
        ctx: ParallelContext | None = None,
    ) -> None:
        check_hyperparameters(
            lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient, eps=eps
        )
        defaults = dict(
            lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient, eps=eps
        )
        super().__init__(params, defaults)
        self.exclude: ExcludeRule = exclude or default_exclude
        self.ctx = ctx

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One LARS step over every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plans = []
        adapted_params: list[torch.Tensor] = []
        adapted_grads: list[torch.Tensor] = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("LARS does not support sparse gradients")
            adapted = [i for i, p in enumerate(params) if not self.exclude(p)]
            plans.append((group, params, adapted))
            adapted_params += [params[i] for i in adapted]
            adapted_grads += [params[i].grad for i in adapted]
        # Every norm of the step in one call (one all-reduce per kind of split).
        n = len(adapted_params)
        sq = whole_sq_norms(
            adapted_params + adapted_grads,
            adapted_params + adapted_params,
            self.ctx or mesh_of(p for group in self.param_groups for p in group["params"]),
            zero_layout_of(self, 2),
        )
        w_norm, g_norm = sq[:n].sqrt(), sq[n:].sqrt()
        offset = 0
        for group, params, adapted in plans:
            wn, gn = w_norm[offset : offset + len(adapted)], g_norm[offset : offset + len(adapted)]
            offset += len(adapted)
            self._update(group, params, adapted, wn, gn)
        return loss

    def _update(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        adapted: list[int],
        w_norm: torch.Tensor,
        g_norm: torch.Tensor,
    ) -> None:
        """d, the momentum buffers and the weights of one group; norms ``[len(adapted)]``."""
        wd, device = group["weight_decay"], params[0].device
        local_lr = group["trust_coefficient"] * w_norm / (g_norm + wd * w_norm + group["eps"])
        local_lr = torch.where((w_norm > 0) & (g_norm > 0), local_lr, torch.ones_like(local_lr)).to(device)
        directions: list[torch.Tensor] = [p.grad for p in params]  # type: ignore[misc]
        if adapted:
            a_params = [params[i] for i in adapted]
            a_grads = [directions[i] for i in adapted]
            d = torch._foreach_add(a_grads, a_params, alpha=wd) if wd != 0 else torch._foreach_mul(a_grads, 1.0)
            torch._foreach_mul_(d, list(local_lr.unbind()))
            for i, tensor in zip(adapted, d):
                directions[i] = tensor
        bufs = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            bufs.append(state["momentum_buffer"])
        torch._foreach_mul_(bufs, group["momentum"])
        torch._foreach_add_(bufs, directions)
        torch._foreach_add_(params, bufs, alpha=-group["lr"])
