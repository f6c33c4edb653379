"""Reference models in plain PyTorch, for the parallel strategies to split and the tests to compare against."""

from tessera.models.gpt import GPT, PRESETS, GPTConfig, gpt
from tessera.models.losses import NextTokenLoss

__all__ = ["GPT", "PRESETS", "GPTConfig", "NextTokenLoss", "gpt"]
