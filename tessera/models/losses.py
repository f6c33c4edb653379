"""Losses for the reference models."""

from __future__ import annotations

import torch
from torch import nn


class NextTokenLoss(nn.Module):
    """Mean cross-entropy of logits ``[batch, seq, vocab]`` against targets ``[batch, seq]``."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
