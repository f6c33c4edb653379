"""The 1D entry of the registry: ``tessera.nn``'s arguments mapped onto the 1D layers.

A linear whose input is another's output (``input_is_parallel``) is row-parallel, else
column-parallel; sequence parallelism is read from ``ctx.dims.sequence_parallel``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera.context import ParallelContext
from tessera.parallel.tensor.mode import TensorMode, need_context
from tessera.parallel.tensor.tp1d import functional as F1
from tessera.parallel.tensor.tp1d import layers as L1

__all__ = ["MODE_1D"]


def _ctx(ctx: ParallelContext | None) -> ParallelContext:
    return need_context(ctx, "1d")


def _sequence_parallel(ctx: ParallelContext) -> bool:
    return ctx.dims.sequence_parallel


def _linear(
    in_features: int,
    out_features: int,
    bias: bool = True,
    *,
    input_is_parallel: bool = False,
    out_groups: int = 1,
    ctx: ParallelContext | None,
) -> nn.Module:
    c = _ctx(ctx)
    seq = _sequence_parallel(c)
    if input_is_parallel:
        return L1.Linear1D_Row(in_features, out_features, bias, sequence_parallel=seq, ctx=c)
    return L1.Linear1D_Col(in_features, out_features, bias, out_groups=out_groups, sequence_parallel=seq, ctx=c)


def _layer_norm(
    normalized_shape: int, eps: float = 1e-5, bias: bool = True, *, ctx: ParallelContext | None
) -> nn.Module:
    c = _ctx(ctx)
    return L1.LayerNorm1D(normalized_shape, eps, bias, sequence_parallel=_sequence_parallel(c), ctx=c)


def _embedding(num_embeddings: int, embedding_dim: int, *, ctx: ParallelContext | None) -> nn.Module:
    return L1.Embedding1D(num_embeddings, embedding_dim, ctx=_ctx(ctx))


def _vocab_parallel_embedding(num_embeddings: int, embedding_dim: int, *, ctx: ParallelContext | None) -> nn.Module:
    return L1.VocabParallelEmbedding1D(num_embeddings, embedding_dim, ctx=_ctx(ctx))


def _classifier(
    in_features: int, num_classes: int, bias: bool, *, weight: nn.Parameter | None = None,
    ctx: ParallelContext | None,
) -> nn.Module:  # fmt: skip
    return L1.Classifier1D(in_features, num_classes, bias, weight=weight, ctx=_ctx(ctx))


def _vocab_parallel_classifier(
    in_features: int, num_classes: int, bias: bool, *, weight: nn.Parameter | None = None,
    ctx: ParallelContext | None,
) -> nn.Module:  # fmt: skip
    return L1.VocabParallelClassifier1D(in_features, num_classes, bias, weight=weight, ctx=_ctx(ctx))


def _patch_embedding(
    img_size: int, patch_size: int, in_chans: int, embed_size: int, *, ctx: ParallelContext | None
) -> nn.Module:
    return L1.PatchEmbedding1D(img_size, patch_size, in_chans, embed_size, ctx=_ctx(ctx))


def _dropout(p: float = 0.5, *, parallel_input: bool = False, ctx: ParallelContext | None) -> nn.Module:
    c = _ctx(ctx)  # sequence-parallel activations are split too
    return L1.Dropout1D(p, parallel_input=parallel_input or _sequence_parallel(c), ctx=c)


def _cross_entropy_loss(*, ctx: ParallelContext | None) -> nn.Module:
    return L1.CrossEntropyLoss1D(ctx=_ctx(ctx))


def _vocab_parallel_cross_entropy_loss(*, ctx: ParallelContext | None) -> nn.Module:
    return L1.VocabParallelCrossEntropyLoss1D(ctx=_ctx(ctx))


def _split_activation(x: torch.Tensor, ctx: ParallelContext | None) -> torch.Tensor:
    return F1.split_activation(x, _ctx(ctx))


def _gather_activation(x: torch.Tensor, ctx: ParallelContext | None, full_shape: Any = None) -> torch.Tensor:
    return F1.gather_activation(x, _ctx(ctx))  # nothing is padded in 1D


def _enter_sequence_parallel(x: torch.Tensor, ctx: ParallelContext | None) -> torch.Tensor:
    c = _ctx(ctx)
    return F1.split_activation(x, c, sequence_parallel=True) if _sequence_parallel(c) else x


def _exit_sequence_parallel(x: torch.Tensor, ctx: ParallelContext | None) -> torch.Tensor:
    c = _ctx(ctx)
    return F1.gather_activation(x, c, sequence_parallel=True) if _sequence_parallel(c) else x


MODE_1D = TensorMode(
    name="1d",
    classes=tuple(getattr(L1, name) for name in L1.__all__),
    linear=_linear,
    layer_norm=_layer_norm,
    embedding=_embedding,
    vocab_parallel_embedding=_vocab_parallel_embedding,
    classifier=_classifier,
    vocab_parallel_classifier=_vocab_parallel_classifier,
    patch_embedding=_patch_embedding,
    dropout=_dropout,
    cross_entropy_loss=_cross_entropy_loss,
    vocab_parallel_cross_entropy_loss=_vocab_parallel_cross_entropy_loss,
    split_activation=_split_activation,
    gather_activation=_gather_activation,
    enter_sequence_parallel=_enter_sequence_parallel,
    exit_sequence_parallel=_exit_sequence_parallel,
    hidden_parts=lambda ctx: F1.hidden_parts(_ctx(ctx)),
    batch_parts=lambda ctx: F1.batch_parts(_ctx(ctx)),
)
