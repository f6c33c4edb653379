"""Build the sharded optimizer that the config's ``zero`` section asks for."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera.config import Config
from tessera.context import ParallelContext
from tessera.zero.optimizer import ZeroOptimizer
from tessera.zero.stage3 import ZeroStage3


def zero_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer, ctx: ParallelContext, config: Config
) -> ZeroOptimizer:
    """``optimizer`` sharded over ``ctx``'s data axis per ``config.zero``; ``model``'s
    parameters move into the chunk store (and to the mixed-precision dtype). The model gets a
    ``tessera_zero`` attribute through which full state dicts gather and load."""
    z = config.zero
    options: dict[str, Any] = dict(
        precision=config.mixed_precision.dtype,
        bucket_mb=z.bucket_mb,
        overlap_comm=z.overlap_comm,
        offload=z.offload_optimizer,
    )
    sharded = (
        ZeroStage3(model, optimizer, ctx, **options)
        if z.stage == 3
        else ZeroOptimizer(model, optimizer, ctx, stage=z.stage, **options)
    )
    model.tessera_zero = sharded  # type: ignore[assignment]
    return sharded
