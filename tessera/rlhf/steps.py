"""The step loop every alignment trainer shares: micro-batches through an engine, the loss and
statistics averaged over the micro-batches and the data ranks.

A trainer gives a ``losses(engine, batch) -> (loss, stats)`` function of one micro-batch (already
on the engine's device); :func:`train_step` runs the engine's accumulation over the micro-batches
and :func:`evaluate` runs held-out batches in eval mode, without gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import torch

from tessera.rlhf.protocols import TrainedModel

__all__ = ["LossesFn", "evaluate", "to_device", "train_step"]

B = TypeVar("B", bound=Mapping[str, Any])
LossesFn = Callable[[TrainedModel, B], tuple[torch.Tensor, Mapping[str, torch.Tensor]]]


def to_device(batch: B, device: torch.device) -> B:
    """``batch`` (a dict of tensors) with every tensor on ``device``; other values as they are."""
    moved = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
    return moved  # type: ignore[return-value]


def _add(totals: dict[str, float], loss: torch.Tensor, stats: Mapping[str, torch.Tensor]) -> None:
    for key, value in {"loss": loss.detach(), **stats}.items():
        totals[key] = totals.get(key, 0.0) + float(value)


def train_step(engine: TrainedModel, micro_batches: Iterable[B], losses: LossesFn[B]) -> dict[str, float]:
    """One optimizer step of ``engine`` over its accumulation of ``micro_batches`` (this rank's):
    each one's loss backward, then the step. Returns the loss and statistics, each averaged over
    the micro-batches and the data ranks. The number of micro-batches must be the engine's."""
    engine.train()
    totals: dict[str, float] = {}
    count = 0
    for batch in micro_batches:
        engine.zero_grad()
        loss, stats = losses(engine, to_device(batch, engine.ctx.device))
        engine.backward(loss)
        engine.step()
        _add(totals, loss, stats)
        count += 1
    if count != engine.micro_batches_per_step:
        raise ValueError(
            f"train_step got {count} micro-batches; the engine accumulates {engine.micro_batches_per_step}"
        )
    return {key: engine.mean_over_data(value / count) for key, value in totals.items()}


@torch.no_grad()
def evaluate(engine: TrainedModel, batches: Iterable[B], losses: LossesFn[B]) -> dict[str, float]:
    """The loss and statistics over ``batches`` (held-out data), averaged over them and the data
    ranks, in eval mode (train mode is put back after)."""
    engine.eval()
    totals: dict[str, float] = {}
    count = 0
    try:
        for batch in batches:
            loss, stats = losses(engine, to_device(batch, engine.ctx.device))
            _add(totals, loss, stats)
            count += 1
    finally:
        engine.train()
    if count == 0:
        raise ValueError("evaluate got no batch")
    return {key: engine.mean_over_data(value / count) for key, value in totals.items()}
