"""Losses for the reference models."""

from __future__ import annotations

import torch
from torch import nn

from tessera import nn as tnn


class NextTokenLoss(nn.Module):
    """Mean cross-entropy of logits ``[batch, seq, vocab]`` against targets ``[batch, seq]``.

    In a tensor-parallel layout the logits are this rank's piece (split over the vocabulary)
    and the loss is the vocabulary-parallel one of the mode; the value is the same.
    """

    def __init__(self) -> None:
        super().__init__()
        self.loss = tnn.VocabParallelCrossEntropyLoss()

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss(logits, targets)
