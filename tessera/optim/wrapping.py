"""What an optimizer that wraps the user's shows of it: the user's parameter groups, state and
defaults, so that LR schedulers and user code bound to the user's optimizer keep working."""

from __future__ import annotations

from typing import Any

import torch


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
