"""A Vision Transformer (Dosovitskiy et al. 2021) built from ``tessera.nn``: patch embedding
with a class token, pre-norm transformer blocks, a final LayerNorm and a linear head on the class
token. The same definition runs in every tensor-parallel mode."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tessera import nn as tnn
from tessera.context.placement import full_numel
from tessera.models.transformer import Block, StagePart, gpt2_rule, reset_in_full


@dataclass(frozen=True)
class ViTConfig:
    img_size: int = 32
    patch_size: int = 4
    in_chans: int = 3
    num_classes: int = 10
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int | None = None
    dropout: float = 0.0
    layer_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.img_size % self.patch_size:
            raise ValueError(f"ViTConfig.img_size={self.img_size} must be a multiple of patch_size={self.patch_size}")
        if self.d_model % self.n_heads:
            raise ValueError(f"ViTConfig.d_model={self.d_model} must be divisible by n_heads={self.n_heads}")

    @property
    def ff_dim(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.d_model


PRESETS: dict[str, ViTConfig] = {
    "tiny": ViTConfig(),  # 32x32 images, 64 patches, trains in seconds on a CPU
    "small": ViTConfig(d_model=192, n_layers=6, n_heads=6),
    "vit-b16": ViTConfig(img_size=224, patch_size=16, num_classes=1000, d_model=768, n_layers=12, n_heads=12),
}


class ViT(nn.Module):
    """Images ``[batch, channels, H, W]`` -> class logits ``[batch, classes]`` (in a tensor-parallel
    layout: this rank's part of the batch, as the mode splits it)."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = tnn.PatchEmbedding(config.img_size, config.patch_size, config.in_chans, config.d_model)
        self.dropout = tnn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            Block(config.d_model, config.n_heads, config.ff_dim, config.dropout, config.layer_norm_eps, causal=False)
            for _ in range(config.n_layers)
        )
        self.norm = tnn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.head = tnn.Classifier(config.d_model, config.num_classes)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, 0.02) weights, zero biases and class token, unit norms; the same in every layout."""
        base = gpt2_rule(self.config.n_layers)

        def rule(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return torch.zeros(shape) if name.endswith("cls_token") else base(name, shape)

        reset_in_full(self, rule)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.embed(images)
        for block in self.blocks:
            x = block(x)
        return self.classify(x)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """Images -> the first block's input (patches, class token, positions)."""
        return self.dropout(tnn.enter_sequence_parallel(self.patch_embed(images)))

    def classify(self, x: torch.Tensor) -> torch.Tensor:
        """The last block's output -> class logits from the class token."""
        return self.head(tnn.exit_sequence_parallel(self.norm(x))[:, 0])

    def pipeline_layers(self) -> list[nn.Module]:
        """The model as layers for pipeline stages: patch embedding, each block, head."""
        embed = StagePart(self.embed, patch_embed=self.patch_embed, dropout=self.dropout)
        return [embed, *self.blocks, StagePart(self.classify, norm=self.norm, head=self.head)]

    def num_parameters(self) -> int:
        return sum(full_numel(p) for p in self.parameters())


def vit(preset: str = "tiny", **overrides: Any) -> ViT:
    """Build a ViT from a preset, replacing config fields with ``overrides``."""
    if preset not in PRESETS:
        raise ValueError(f"unknown ViT preset {preset!r}; presets: {', '.join(PRESETS)}")
    return ViT(dataclasses.replace(PRESETS[preset], **overrides))
