"""LAMB: Adam moments with a layer-wise trust ratio (You et al. 2019, "Large Batch Optimization
for Deep Learning: Training BERT in 76 minutes", Algorithm 2).

For each parameter ``w`` with gradient ``g`` at step ``t``::

    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    u = (m / (1 - b1**t)) / (sqrt(v / (1 - b2**t)) + eps) + weight_decay * w
    ratio = ||w|| / ||u||        (1 if either norm is 0, or if the parameter is excluded)
    w = w - lr * ratio * u

The norms are of the WHOLE parameter, however it is split over ranks (see
:mod:`tessera.optim.norms`), so a sharded LAMB takes the same steps as a single-process one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from tessera.context import ParallelContext
from tessera.optim.norms import full_ndim, mesh_of, whole_sq_norms, zero_layout_of

ExcludeRule = Callable[[torch.Tensor], bool]


def default_exclude(param: torch.Tensor) -> bool:
    """Biases and normalization weights: the whole parameter has at most one dimension."""
    return full_ndim(param) <= 1


def trust_ratio(numerator_sq: torch.Tensor, denominator_sq: torch.Tensor) -> torch.Tensor:
    """``sqrt(numerator_sq / denominator_sq)`` elementwise, 1 where either is 0."""
    ratio = (numerator_sq / denominator_sq).sqrt()
    return torch.where((numerator_sq > 0) & (denominator_sq > 0), ratio, torch.ones_like(ratio))


def check_hyperparameters(**values: float) -> None:
    for name, value in values.items():
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"invalid {name}: {value} (must be finite and >= 0)")


class LAMB(torch.optim.Optimizer):
    """LAMB (see the module docstring for the exact formulas).

    ``exclude(param) -> bool`` picks the parameters that get no trust ratio (ratio 1; they still
    get weight decay); by default those whose whole parameter has ``ndim <= 1`` (biases, norm
    weights). ``ctx`` is the parallel context whose groups sum the norms of split parameters;
    by default the current tessera context, if any. ``defaults`` holds only the numeric
    hyperparameters, so ``LAMB(other_params, **opt.defaults)`` builds the same optimizer over
    other tensors.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        *,
        exclude: ExcludeRule | None = None,
        ctx: ParallelContext | None = None,
    ) -> None:
        check_hyperparameters(lr=lr, eps=eps, weight_decay=weight_decay)
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid betas: {betas} (each must be in [0, 1))")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.exclude: ExcludeRule = exclude or default_exclude
        self.ctx = ctx

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One LAMB step over every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Phase 1, per group: moments and the Adam direction u (plus weight decay).
        plans = []
        adapted_params: list[torch.Tensor] = []
        adapted_updates: list[torch.Tensor] = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            updates = self._adam_directions(group, params)
            adapted = [i for i, p in enumerate(params) if not self.exclude(p)]
            plans.append((group, params, updates, adapted))
            adapted_params += [params[i] for i in adapted]
            adapted_updates += [updates[i] for i in adapted]
        # Phase 2: every trust-ratio norm of the step in one call (one all-reduce per kind of split).
        n = len(adapted_params)
        sq = whole_sq_norms(
            adapted_params + adapted_updates,
            adapted_params + adapted_params,
            self.ctx or mesh_of(p for group in self.param_groups for p in group["params"]),
            zero_layout_of(self, 2),
        )
        ratios = trust_ratio(sq[:n], sq[n:])
        # Phase 3: w -= lr * ratio * u, with per-tensor scales kept on the device (no host sync).
        offset = 0
        for group, params, updates, adapted in plans:
            device = params[0].device
            scale = torch.ones(len(params), dtype=torch.float32, device=device)
            index = torch.tensor(adapted, dtype=torch.long, device=device)
            scale.index_copy_(0, index, ratios[offset : offset + len(adapted)].to(device))
            offset += len(adapted)
            torch._foreach_mul_(updates, list((scale * group["lr"]).unbind()))
            torch._foreach_sub_(params, updates)
        return loss

    def _adam_directions(self, group: dict[str, Any], params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Update the moments of ``params`` and return ``u`` for each (new tensors)."""
        beta1, beta2 = group["betas"]
        grads: list[torch.Tensor] = [p.grad for p in params]  # type: ignore[misc]  # params have grads
        if any(g.is_sparse for g in grads):
            raise RuntimeError("LAMB does not support sparse gradients")
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(float(state["step"]))
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        # u = (m / bc1) / (sqrt(v) / sqrt(bc2) + eps)
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, [math.sqrt(1 - beta2**t) for t in steps])
        torch._foreach_add_(denom, group["eps"])
        updates = list(torch._foreach_div(exp_avgs, denom))
        torch._foreach_div_(updates, [1 - beta1**t for t in steps])
        if group["weight_decay"] != 0:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])
        return updates
