"""Single-process layers that torch lacks, the references for their parallel versions, and the
single-rank mode (:data:`SINGLE_RANK`): what ``tessera.nn`` builds without a context or with a
tensor group of one rank, plain torch layers."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera.context import ParallelContext
from tessera.parallel.tensor.mode import TensorMode, identity

__all__ = ["SINGLE_RANK", "CrossEntropyLoss", "PatchEmbedding"]


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


# ---- the single-rank mode: plain torch layers -------------------------------------------------


def _linear(
    in_features: int,
    out_features: int,
    bias: bool = True,
    *,
    input_is_parallel: bool = False,
    out_groups: int = 1,
    ctx: ParallelContext | None,
) -> nn.Module:
    return nn.Linear(in_features, out_features, bias)


def _layer_norm(
    normalized_shape: int, eps: float = 1e-5, bias: bool = True, *, ctx: ParallelContext | None
) -> nn.Module:
    return nn.LayerNorm(normalized_shape, eps=eps, bias=bias)


def _embedding(num_embeddings: int, embedding_dim: int, *, ctx: ParallelContext | None) -> nn.Module:
    return nn.Embedding(num_embeddings, embedding_dim)


def _classifier(
    in_features: int, num_classes: int, bias: bool, *, weight: nn.Parameter | None = None,
    ctx: ParallelContext | None,
) -> nn.Module:  # fmt: skip
    layer = nn.Linear(in_features, num_classes, bias)
    if weight is not None:
        layer.weight = weight  # a tied head
    return layer


def _patch_embedding(
    img_size: int, patch_size: int, in_chans: int, embed_size: int, *, ctx: ParallelContext | None
) -> nn.Module:
    return PatchEmbedding(img_size, patch_size, in_chans, embed_size)


def _dropout(p: float = 0.5, *, parallel_input: bool = False, ctx: ParallelContext | None) -> nn.Module:
    return nn.Dropout(p)


def _cross_entropy_loss(*, ctx: ParallelContext | None) -> nn.Module:
    return CrossEntropyLoss()


def _gather_activation(x: torch.Tensor, ctx: ParallelContext | None, full_shape: Any = None) -> torch.Tensor:
    return x


SINGLE_RANK = TensorMode(
    name="single",
    classes=(),
    linear=_linear,
    layer_norm=_layer_norm,
    embedding=_embedding,
    vocab_parallel_embedding=_embedding,
    classifier=_classifier,
    vocab_parallel_classifier=_classifier,
    patch_embedding=_patch_embedding,
    dropout=_dropout,
    cross_entropy_loss=_cross_entropy_loss,
    vocab_parallel_cross_entropy_loss=_cross_entropy_loss,
    split_activation=identity,
    gather_activation=_gather_activation,
    enter_sequence_parallel=identity,
    exit_sequence_parallel=identity,
    hidden_parts=lambda ctx: 1,
    batch_parts=lambda ctx: 1,
)
