"""The current run (layer 6): the context and config that ``tessera.launch`` made, and the
user-facing ``tessera.initialize`` that reads them. Everything below this layer takes its
context and options explicitly."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from tessera.config import Config, require_available
from tessera.config.options import training_options
from tessera.context import ParallelContext, get_context, set_context
from tessera.engine import Engine
from tessera.engine import initialize as initialize_with
from tessera.hf import prepare as prepare_hf
from tessera.init.materialise import Source
from tessera.init.recording import continue_recording

_config: Config | None = None


def set_session(ctx: ParallelContext | None, config: Config | None) -> None:
    """Make ``ctx`` the current context and ``config`` the current run's config."""
    global _config
    set_context(ctx)
    _config = config


def current_config() -> Config:
    """The config of the current run (set by ``tessera.launch``)."""
    if _config is None:
        raise RuntimeError("no config yet: call tessera.launch(...) or launch_from_torch(...) first")
    return _config


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    criterion: Callable[..., torch.Tensor] | None = None,
    train_dataloader: DataLoader | None = None,
    test_dataloader: DataLoader | None = None,
    lr_scheduler: Any = None,
    *,
    ctx: ParallelContext | None = None,
    config: Config | None = None,
    init: Source = "random",
) -> tuple[Engine, DataLoader | None, DataLoader | None, Any]:
    """Return ``(engine, train_dataloader, test_dataloader, lr_scheduler)`` for the current layout
    (or ``ctx``) and the launched config (or ``config``).

    The model moves to the rank's device and is handed to the layout's strategy (DDP, ZeRO,
    pipeline stages); the data loaders are rebuilt so that each data-parallel rank reads its own
    samples (their ``batch_size`` stays the per-rank micro-batch). The optimizer must have been
    built over ``model``'s parameters; the scheduler is returned unchanged (step it yourself or
    with the Trainer's LR hook).

    A model built under ``tessera.deferred_init()`` is made here, each rank only what it keeps;
    ``init`` says from what: ``"random"`` (its construction replayed, the single-process
    values), a checkpoint folder or full-state ``.safetensors`` file, or a function
    ``fn(name, shape, dtype)`` returning each tensor's full value (for models whose construction
    cannot be replayed). For a model built normally, a path or function in ``init`` loads it.
    """
    ctx = ctx or get_context()
    if config is None:
        if _config is None:
            raise ValueError("no config for this run; start it with tessera.launch(...) or pass config=")
        config = _config
    require_available(config)
    with continue_recording(model):  # a deferred model's blocks are made when it is materialised
        prepare_hf(model, optimizer, ctx)  # a transformers model under tensor parallelism: its policy
    engine, train_dataloader, test_dataloader, lr_scheduler = initialize_with(
        model,
        optimizer,
        criterion,
        train_dataloader,
        test_dataloader,
        lr_scheduler,
        ctx=ctx,
        options=training_options(config),
        init=init,
    )
    engine.run_config = config  # what checkpoints record as the config that wrote them
    return engine, train_dataloader, test_dataloader, lr_scheduler
