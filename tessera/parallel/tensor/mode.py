"""What a tensor-parallel mode offers ``tessera.nn``: one :class:`TensorMode` object per mode.

Every entry has the same signature in every mode, so ``tessera.nn`` dispatches by table lookup
(``MODES[ctx.dims.tensor_mode].linear(...)``, :mod:`tessera.parallel.tensor.modes`). Arguments
that only one mode uses are taken by every mode and ignored by the others: 1D picks a row- or
column-parallel linear from ``input_is_parallel`` and reads sequence parallelism from
``ctx.dims.sequence_parallel``; the grid modes read ``ctx.dims.keep_blocks`` for their Linears.
Each entry takes the context explicitly; ``ctx`` is None only
for the single-rank mode (no context at all).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from tessera.context import ParallelContext

__all__ = [
    "ActivationMap",
    "ClassifierFactory",
    "DropoutFactory",
    "EmbeddingFactory",
    "GatherActivation",
    "LayerNormFactory",
    "LinearFactory",
    "LossFactory",
    "PatchEmbeddingFactory",
    "TensorMode",
    "grid_mode",
    "identity",
    "need_context",
]


class LinearFactory(Protocol):
    def __call__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        input_is_parallel: bool = False,
        out_groups: int = 1,
        ctx: ParallelContext | None,
    ) -> nn.Module: ...


class LayerNormFactory(Protocol):
    def __call__(
        self, normalized_shape: int, eps: float = 1e-5, bias: bool = True, *, ctx: ParallelContext | None
    ) -> nn.Module: ...


class EmbeddingFactory(Protocol):
    def __call__(self, num_embeddings: int, embedding_dim: int, *, ctx: ParallelContext | None) -> nn.Module: ...


class ClassifierFactory(Protocol):
    def __call__(
        self,
        in_features: int,
        num_classes: int,
        bias: bool,
        *,
        weight: nn.Parameter | None = None,
        ctx: ParallelContext | None,
    ) -> nn.Module: ...


class PatchEmbeddingFactory(Protocol):
    def __call__(
        self, img_size: int, patch_size: int, in_chans: int, embed_size: int, *, ctx: ParallelContext | None
    ) -> nn.Module: ...


class DropoutFactory(Protocol):
    def __call__(self, p: float = 0.5, *, parallel_input: bool = False, ctx: ParallelContext | None) -> nn.Module: ...


class LossFactory(Protocol):
    def __call__(self, *, ctx: ParallelContext | None) -> nn.Module: ...


ActivationMap = Callable[[torch.Tensor, ParallelContext | None], torch.Tensor]


class GatherActivation(Protocol):
    def __call__(self, x: torch.Tensor, ctx: ParallelContext | None, full_shape: Any = None) -> torch.Tensor: ...


@dataclass(frozen=True)
class TensorMode:
    """One tensor-parallel mode: its layers and activation helpers, each with the signature
    ``tessera.nn``'s function of the same name has (in snake case), plus its explicit classes."""

    name: str  # the config's parallel.tensor.mode ("1d", ...), or "single" for a one-rank group
    classes: tuple[type[nn.Module], ...]  # the explicit layers (Linear2D, ...), each with ``ctx=`` keyword
    linear: LinearFactory
    layer_norm: LayerNormFactory
    embedding: EmbeddingFactory
    vocab_parallel_embedding: EmbeddingFactory
    classifier: ClassifierFactory
    vocab_parallel_classifier: ClassifierFactory
    patch_embedding: PatchEmbeddingFactory
    dropout: DropoutFactory
    cross_entropy_loss: LossFactory
    vocab_parallel_cross_entropy_loss: LossFactory
    split_activation: ActivationMap  # full [b, s, h] -> this rank's piece
    gather_activation: GatherActivation  # inverse of split_activation; full_shape drops padding
    enter_sequence_parallel: ActivationMap  # 1D with sequence_parallel: [b, s, h] -> [b, s/P, h]
    exit_sequence_parallel: ActivationMap
    hidden_parts: Callable[[ParallelContext | None], int]  # blocks of the hidden dimension
    batch_parts: Callable[[ParallelContext | None], int]  # blocks of the batch


def need_context(ctx: ParallelContext | None, mode: str) -> ParallelContext:
    """``ctx``, which a parallel mode cannot do without."""
    if ctx is None:
        raise ValueError(f"tensor mode {mode!r} needs a parallel context (ctx=...)")
    return ctx


def identity(x: torch.Tensor, ctx: ParallelContext | None) -> torch.Tensor:
    """An activation map that leaves ``x`` as it is."""
    return x


def grid_mode(
    name: str,
    layers: dict[str, type[nn.Module]],
    *,
    split_activation: Callable[[torch.Tensor, ParallelContext], torch.Tensor],
    gather_activation: Callable[..., torch.Tensor],
    hidden_parts: Callable[[ParallelContext], int],
    batch_parts: Callable[[ParallelContext], int],
) -> TensorMode:
    """The entry of a mode with one activation layout whose layers take ``tessera.nn``'s arguments
    (2D, 2.5D, 3D). ``layers`` maps the ``tessera.nn`` names (``"Linear"``, ...) to its classes;
    ``gather_activation(x, ctx, full_shape=...)``."""

    def need(ctx: ParallelContext | None) -> ParallelContext:
        return need_context(ctx, name)

    def linear(
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        input_is_parallel: bool = False,
        out_groups: int = 1,
        ctx: ParallelContext | None,
    ) -> nn.Module:
        ctx = need(ctx)
        keep = ctx.dims.keep_blocks
        return layers["Linear"](in_features, out_features, bias, out_groups=out_groups, keep_blocks=keep, ctx=ctx)

    def layer_norm(
        normalized_shape: int, eps: float = 1e-5, bias: bool = True, *, ctx: ParallelContext | None
    ) -> nn.Module:
        return layers["LayerNorm"](normalized_shape, eps, bias, ctx=need(ctx))

    def embedding(num_embeddings: int, embedding_dim: int, *, ctx: ParallelContext | None) -> nn.Module:
        return layers["Embedding"](num_embeddings, embedding_dim, ctx=need(ctx))

    def vocab_parallel_embedding(num_embeddings: int, embedding_dim: int, *, ctx: ParallelContext | None) -> nn.Module:
        return layers["VocabParallelEmbedding"](num_embeddings, embedding_dim, ctx=need(ctx))

    def classifier(
        in_features: int, num_classes: int, bias: bool, *, weight: nn.Parameter | None = None,
        ctx: ParallelContext | None,
    ) -> nn.Module:  # fmt: skip
        return layers["Classifier"](in_features, num_classes, bias, weight=weight, ctx=need(ctx))

    def vocab_parallel_classifier(
        in_features: int, num_classes: int, bias: bool, *, weight: nn.Parameter | None = None,
        ctx: ParallelContext | None,
    ) -> nn.Module:  # fmt: skip
        ctx = need(ctx)
        keep = ctx.dims.keep_blocks
        return layers["VocabParallelClassifier"](
            in_features, num_classes, bias, weight=weight, keep_blocks=keep, ctx=ctx
        )

    def patch_embedding(
        img_size: int, patch_size: int, in_chans: int, embed_size: int, *, ctx: ParallelContext | None
    ) -> nn.Module:
        return layers["PatchEmbedding"](img_size, patch_size, in_chans, embed_size, ctx=need(ctx))

    def dropout(p: float = 0.5, *, parallel_input: bool = False, ctx: ParallelContext | None) -> nn.Module:
        return layers["Dropout"](p, ctx=need(ctx))  # every activation is split: one stream per rank

    def cross_entropy_loss(*, ctx: ParallelContext | None) -> nn.Module:
        return layers["CrossEntropyLoss"](ctx=need(ctx))

    def vocab_parallel_cross_entropy_loss(*, ctx: ParallelContext | None) -> nn.Module:
        return layers["VocabParallelCrossEntropyLoss"](ctx=need(ctx))

    return TensorMode(
        name=name,
        classes=tuple(layers.values()),
        linear=linear,
        layer_norm=layer_norm,
        embedding=embedding,
        vocab_parallel_embedding=vocab_parallel_embedding,
        classifier=classifier,
        vocab_parallel_classifier=vocab_parallel_classifier,
        patch_embedding=patch_embedding,
        dropout=dropout,
        cross_entropy_loss=cross_entropy_loss,
        vocab_parallel_cross_entropy_loss=vocab_parallel_cross_entropy_loss,
        split_activation=lambda x, ctx: split_activation(x, need(ctx)),
        gather_activation=lambda x, ctx, full_shape=None: gather_activation(x, need(ctx), full_shape=full_shape),
        enter_sequence_parallel=identity,
        exit_sequence_parallel=identity,
        hidden_parts=lambda ctx: hidden_parts(need(ctx)),
        batch_parts=lambda ctx: batch_parts(need(ctx)),
    )
