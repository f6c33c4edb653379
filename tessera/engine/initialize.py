"""``tessera.initialize``: apply the configured layout to a model, optimizer, loss and data."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from tessera.config import require_available
from tessera.context import ParallelContext, get_context
from tessera.engine.engine import Engine
from tessera.errors import ConfigError, NotAvailableError
from tessera.parallel.data import distributed_loader, wrap_data_parallel
from tessera.zero import zero_optimizer


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    criterion: Callable[..., torch.Tensor] | None = None,
    train_dataloader: DataLoader | None = None,
    test_dataloader: DataLoader | None = None,
    lr_scheduler: Any = None,
    *,
    ctx: ParallelContext | None = None,
) -> tuple[Engine, DataLoader | None, DataLoader | None, Any]:
    """Return ``(engine, train_dataloader, test_dataloader, lr_scheduler)`` for the current layout.

    The model moves to the rank's device and is wrapped for data parallelism; the data loaders
    are rebuilt so that each data-parallel rank reads its own samples (their ``batch_size``
    stays the per-rank micro-batch). The optimizer must have been built over ``model``'s
    parameters; the scheduler is returned unchanged (step it yourself or with the Trainer's
    LR hook).
    """
    ctx = ctx or get_context()
    if ctx.config is None:
        raise ValueError("the parallel context has no config; build it with tessera.launch(...)")
    config = ctx.config
    require_available(config)
    model_params = {id(p) for p in model.parameters()}
    stray = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in model_params]
    if stray:
        raise ValueError(f"the optimizer holds {len(stray)} parameter(s) that are not the model's")
    model.to(ctx.device)
    if ctx.size("pipeline") > 1:
        stage = _pipeline_stage(model, criterion, ctx)
        if config.zero.stage > 0:  # stage 1 only (the config refuses 2 and 3 with pipelines)
            optimizer = zero_optimizer(model, optimizer, ctx, config)  # type: ignore[assignment]
        engine = Engine(model, optimizer, criterion, ctx=ctx, config=config, pipeline=stage)
    elif config.zero.stage > 0:
        # ZeRO reduces the gradients itself (reduce-scatter over the data axis): no DDP
        engine = Engine(model, zero_optimizer(model, optimizer, ctx, config), criterion, ctx=ctx, config=config)
    else:
        wrapped = wrap_data_parallel(model, ctx.group("data"), ctx.device)
        engine = Engine(wrapped, optimizer, criterion, ctx=ctx, config=config, module=model)
    data_group = ctx.group("data")
    if train_dataloader is not None:
        train_dataloader = distributed_loader(train_dataloader, data_group, config.seed)
    if test_dataloader is not None:
        test_dataloader = distributed_loader(test_dataloader, data_group, config.seed)
    return engine, train_dataloader, test_dataloader, lr_scheduler


def _pipeline_stage(model: nn.Module, criterion: Callable[..., torch.Tensor] | None, ctx: ParallelContext) -> Any:
    """This rank's pipeline stage of ``model`` per ``parallel.pipeline``."""
    from tessera.parallel.pipeline.stage import PipelineStage

    config = ctx.config
    pp = config.parallel.pipeline
    if criterion is None:
        raise ConfigError("pipeline parallelism computes the loss on the last stage: pass criterion= to initialize")
    if config.gradient_accumulation != 1:
        raise ConfigError(
            f"gradient_accumulation={config.gradient_accumulation} with pipeline stages: the pipeline's "
            "micro-batches are the accumulation; set parallel.pipeline.microbatches instead"
        )
    if config.mixed_precision.dtype == "fp16":
        raise NotAvailableError("fp16 loss scaling with pipeline stages is not available yet; use bf16 or fp32")
    return PipelineStage(
        model,
        criterion,
        ctx,
        schedule=pp.schedule,
        microbatches=pp.microbatches if pp.microbatches is not None else pp.size,
        chunks_per_rank=pp.chunks,
        method=pp.partition,
        boundaries=pp.boundaries,
    )
