"""Single-process layers that torch lacks, the references for their parallel versions."""

from __future__ import annotations

import torch
from torch import nn


class PatchEmbedding(nn.Module):
    """ViT input: ``[b, c, H, W]`` images -> ``[b, 1 + N, embed]`` tokens (a class token, then
    the N = (H/p)(W/p) patches, each a linear map of its pixels, plus a learned position
    embedding). Parameters: ``weight [embed, c, p, p]``, ``bias [embed]``,
    ``cls_token [1, 1, embed]``, ``pos_embed [1, 1 + N, embed]``."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_size: int) -> None:
        super().__init__()
        if img_size % patch_size:
            raise ValueError(f"img_size {img_size} is not a multiple of patch_size {patch_size}")
        self.patch_size = patch_size
        self.num_patches = (img_size // patch_size) ** 2
        conv = nn.Conv2d(in_chans, embed_size, patch_size, stride=patch_size)
        self.weight = conv.weight
        self.bias = conv.bias
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_size))
        self.pos_embed = nn.Parameter(torch.randn(1, 1 + self.num_patches, embed_size) * 0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = nn.functional.conv2d(images, self.weight, self.bias, stride=self.patch_size)
        x = x.flatten(2).transpose(1, 2)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        return torch.cat([cls, x], dim=1) + self.pos_embed


class CrossEntropyLoss(nn.Module):
    """Mean cross-entropy of logits ``[..., classes]`` against targets ``[...]`` (any leading shape)."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())
