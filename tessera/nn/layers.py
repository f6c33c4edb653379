"""Mode-dispatching layers: each builds the layer of the current tensor-parallel mode.

With a tensor group of one rank they build plain torch layers, so a model written with these
is a plain PyTorch model on one device. Each is a factory named like the class it stands for
and a lookup in the registry (``tessera.parallel.tensor.modes``); the explicit classes
(``Linear1D_Col``, ``Linear2D``, ...) are in ``tessera.nn`` too.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from tessera.context import ParallelContext, get_context, has_context
from tessera.parallel.tensor.modes import TensorMode, mode_of


def resolve_context(ctx: ParallelContext | None = None) -> ParallelContext | None:
    """The context a ``tessera.nn`` layer works in: ``ctx`` when given, else the current one
    (``tessera.launch``), else None (no context: plain torch layers)."""
    if ctx is not None:
        return ctx
    return get_context() if has_context() else None


def _mode(ctx: ParallelContext | None) -> tuple[TensorMode, ParallelContext | None]:
    ctx = resolve_context(ctx)
    return mode_of(ctx), ctx


def Linear(
    in_features: int,
    out_features: int,
    bias: bool = True,
    *,
    input_is_parallel: bool = False,
    out_groups: int = 1,
    ctx: ParallelContext | None = None,
) -> nn.Module:
    """``y = x W^T + b``. In 1D a layer whose input is the output of another (``input_is_parallel``)
    is row-parallel, else column-parallel; the other modes have one layout and ignore it.
    ``out_groups`` fused outputs (q, k, v) are each split on their own."""
    mode, ctx = _mode(ctx)
    return mode.linear(
        in_features, out_features, bias, input_is_parallel=input_is_parallel, out_groups=out_groups, ctx=ctx
    )


def LayerNorm(
    normalized_shape: int, eps: float = 1e-5, bias: bool = True, *, ctx: ParallelContext | None = None
) -> nn.Module:
    """Layer normalisation over the (possibly split) hidden dimension."""
    mode, ctx = _mode(ctx)
    return mode.layer_norm(normalized_shape, eps, bias, ctx=ctx)


def Embedding(num_embeddings: int, embedding_dim: int, *, ctx: ParallelContext | None = None) -> nn.Module:
    """Lookup with the whole table's rows on every rank (the hidden dimension split as the activations)."""
    mode, ctx = _mode(ctx)
    return mode.embedding(num_embeddings, embedding_dim, ctx=ctx)


def VocabParallelEmbedding(num_embeddings: int, embedding_dim: int, *, ctx: ParallelContext | None = None) -> nn.Module:
    """Lookup with the vocabulary split over the tensor group too (for large vocabularies)."""
    mode, ctx = _mode(ctx)
    return mode.vocab_parallel_embedding(num_embeddings, embedding_dim, ctx=ctx)


def Classifier(
    in_features: int, num_classes: int, bias: bool = True, *, weight: nn.Parameter | None = None,
    ctx: ParallelContext | None = None,
) -> nn.Module:  # fmt: skip
    """Logits over all classes on every rank (for few classes)."""
    mode, ctx = _mode(ctx)
    return mode.classifier(in_features, num_classes, bias, weight=weight, ctx=ctx)


def VocabParallelClassifier(
    in_features: int, num_classes: int, bias: bool = False, *, weight: nn.Parameter | None = None,
    ctx: ParallelContext | None = None,
) -> nn.Module:  # fmt: skip
    """Logits split over the classes (a vocabulary); ``weight`` ties it to a VocabParallelEmbedding."""
    mode, ctx = _mode(ctx)
    return mode.vocab_parallel_classifier(in_features, num_classes, bias, weight=weight, ctx=ctx)


def PatchEmbedding(
    img_size: int, patch_size: int, in_chans: int, embed_size: int, *, ctx: ParallelContext | None = None
) -> nn.Module:
    """ViT patch embedding with class token and position embedding."""
    mode, ctx = _mode(ctx)
    return mode.patch_embedding(img_size, patch_size, in_chans, embed_size, ctx=ctx)


def Dropout(p: float = 0.5, *, parallel_input: bool = False, ctx: ParallelContext | None = None) -> nn.Module:
    """Dropout whose masks agree across the ranks that hold the same activations."""
    mode, ctx = _mode(ctx)
    return mode.dropout(p, parallel_input=parallel_input, ctx=ctx)


def CrossEntropyLoss(*, ctx: ParallelContext | None = None) -> nn.Module:
    """Mean cross-entropy of logits ``[..., classes]`` (all classes on every rank) against full targets."""
    mode, ctx = _mode(ctx)
    return mode.cross_entropy_loss(ctx=ctx)


def VocabParallelCrossEntropyLoss(*, ctx: ParallelContext | None = None) -> nn.Module:
    """Mean cross-entropy of logits split over the classes, against full targets."""
    mode, ctx = _mode(ctx)
    return mode.vocab_parallel_cross_entropy_loss(ctx=ctx)


# ---- boundary helpers ----------------------------------------------------------------------


def split_activation(x: torch.Tensor, ctx: ParallelContext | None = None) -> torch.Tensor:
    """This rank's piece of a full ``[batch, seq, hidden]`` (or ``[batch, hidden]``) activation."""
    mode, ctx = _mode(ctx)
    return mode.split_activation(x, ctx)


def gather_activation(x: torch.Tensor, ctx: ParallelContext | None = None, full_shape: Any = None) -> torch.Tensor:
    """The full activation from every rank's piece (collective over the tensor group)."""
    mode, ctx = _mode(ctx)
    return mode.gather_activation(x, ctx, full_shape)


def enter_sequence_parallel(x: torch.Tensor, ctx: ParallelContext | None = None) -> torch.Tensor:
    """Where the transformer blocks begin: with 1D sequence-parallel regions configured, keep this
    rank's part of the sequence (``[b, s, h] -> [b, s/P, h]``); otherwise ``x`` unchanged."""
    mode, ctx = _mode(ctx)
    return mode.enter_sequence_parallel(x, ctx)


def exit_sequence_parallel(x: torch.Tensor, ctx: ParallelContext | None = None) -> torch.Tensor:
    """Where the transformer blocks end: the inverse of :func:`enter_sequence_parallel`."""
    mode, ctx = _mode(ctx)
    return mode.exit_sequence_parallel(x, ctx)


def hidden_parts(ctx: ParallelContext | None = None) -> int:
    """Into how many blocks the hidden dimension of an activation is split."""
    mode, ctx = _mode(ctx)
    return int(mode.hidden_parts(ctx))


def batch_parts(ctx: ParallelContext | None = None) -> int:
    """Into how many blocks the batch of an activation is split."""
    mode, ctx = _mode(ctx)
    return int(mode.batch_parts(ctx))


def split_region_rng(ctx: ParallelContext | None = None) -> contextlib.AbstractContextManager[None]:
    """Random stream for work on split activations (attention dropout): distinct per tensor rank."""
    ctx = resolve_context(ctx)
    if ctx is None or ctx.size("tensor") == 1:
        return contextlib.nullcontext()
    return ctx.rng.fork("tensor")
