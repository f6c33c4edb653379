"""Learning-rate schedules as multipliers of the peak rate."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def warmup_then_decay(
    total_steps: int, warmup_steps: int = 0, decay: str = "cosine", min_ratio: float = 0.0
) -> Callable[[int], float]:
    """Multiplier for step ``s``: linear warm-up to 1 over ``warmup_steps``, then ``decay``
    (cosine, linear or constant) down to ``min_ratio`` at ``total_steps``."""
    if decay not in ("cosine", "linear", "constant"):
        raise ValueError(f"decay {decay!r} is not one of cosine, linear, constant")

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if decay == "constant":
            return 1.0
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if decay == "cosine" else 1.0 - progress
        return min_ratio + (1.0 - min_ratio) * shape

    return multiplier


def lr_schedule(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0, decay: str = "cosine",
    min_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:  # fmt: skip
    """A ``LambdaLR`` over :func:`warmup_then_decay`."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_decay(total_steps, warmup_steps, decay, min_ratio))
