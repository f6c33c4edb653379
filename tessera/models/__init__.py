"""Reference models in plain PyTorch, for the parallel strategies to split and the tests to compare against."""

from tessera.models.gpt import GPT, PRESETS, GPTConfig, gpt
from tessera.models.losses import NextTokenLoss
from tessera.models.vit import ViT, ViTConfig, vit

__all__ = ["GPT", "PRESETS", "GPTConfig", "NextTokenLoss", "ViT", "ViTConfig", "gpt", "vit"]
