"""What an optimizer that wraps the user's shows of it: the user's parameter groups, state and
defaults, so that LR schedulers and user code bound to the user's optimizer keep working."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class WrapsOptimizer:
    """Mixin for sharded optimizers (ZeRO, Gemini) that step through ``self.optimizer``."""

    optimizer: torch.optim.Optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults


def optimizer_entries(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, trainable: bool = False
) -> tuple[list[tuple[str, nn.Parameter]], list[int]]:
    """The optimizer's parameters in group order as ``(model name, parameter)``, and the group
    index of each (``trainable``: only those that require a gradient, not a frozen base's);
    raises ValueError on a parameter that is not ``model``'s."""
    names = {id(p): n for n, p in model.named_parameters()}
    entries: list[tuple[str, nn.Parameter]] = []
    group_of: list[int] = []
    for index, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError("the optimizer holds a parameter that is not the model's")
            if p.requires_grad or not trainable:
                entries.append((names[id(p)], p))
                group_of.append(index)
    return entries, group_of
