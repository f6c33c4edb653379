"""The answer a layout must give: plain single-process PyTorch on the global batch."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import TensorDataset

from tessera.checkpoint import full_state_dict
from tessera.models import NextTokenLoss


def adamw_reference(
    build: Callable[[], nn.Module], data: TensorDataset, steps: int, global_batch: int, clip: float | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``steps`` AdamW steps (lr 3e-3, eps 1e-6) of ``build()`` over consecutive global batches of
    ``data`` with the next-token loss, the gradients clipped to ``clip`` when given: the losses
    and the final full state dict."""
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    x, y = data.tensors
    losses = []
    for step in range(steps):
        sl = slice(step * global_batch, (step + 1) * global_batch)
        optimizer.zero_grad()
        loss = NextTokenLoss()(model(x[sl]), y[sl])
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        losses.append(loss.item())
    return losses, full_state_dict(model)
