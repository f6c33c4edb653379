"""Mode-dispatching layers: each builds the layer of the current tensor-parallel mode.

With a tensor group of one rank they build plain torch layers, so a model written with these
is a plain PyTorch model on one device. Each is a factory named like the class it stands for;
the explicit classes (``Linear1D_Col``, ``Linear2D``, ...) are in ``tessera.nn`` too.
"""

from __future__ import annotations

import contextlib
import importlib
from types import ModuleType
from typing import Any

import torch
from torch import nn

from tessera.context import ParallelContext, get_context, has_context
from tessera.nn import plain

_MODULES = {"1d": "tp1d", "2d": "tp2d", "2.5d": "tp2p5d", "3d": "tp3d"}
_SUFFIX = {"1d": "1D", "2d": "2D", "2.5d": "2p5D", "3d": "3D"}


def _ctx(ctx: ParallelContext | None) -> ParallelContext | None:
    if ctx is not None:
        return ctx
    return get_context() if has_context() else None


def _is_parallel(ctx: ParallelContext | None) -> bool:
    return ctx is not None and ctx.size("tensor") > 1


def _sequence_parallel(ctx: ParallelContext | None) -> bool:
    """Whether 1D sequence-parallel regions are configured (``parallel.tensor.sequence_parallel``)."""
    return _is_parallel(ctx) and ctx is not None and ctx.dims.sequence_parallel


def mode_module(ctx: ParallelContext) -> ModuleType:
    """The module implementing ``ctx``'s tensor mode (``tessera.parallel.tensor.tp2d``, ...)."""
    mode = ctx.dims.tensor_mode
    return importlib.import_module(f"tessera.parallel.tensor.{_MODULES[mode]}")


def _cls(ctx: ParallelContext, name: str) -> Any:
    return getattr(mode_module(ctx), f"{name}{_SUFFIX[ctx.dims.tensor_mode]}")


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
    ctx = _ctx(ctx)
    if not _is_parallel(ctx):
        return nn.Linear(in_features, out_features, bias)
    assert ctx is not None
    if ctx.dims.tensor_mode == "1d":
        mod = mode_module(ctx)
        seq = _sequence_parallel(ctx)
        if input_is_parallel:
            return mod.Linear1D_Row(in_features, out_features, bias, sequence_parallel=seq, ctx=ctx)
        return mod.Linear1D_Col(in_features, out_features, bias, out_groups=out_groups, sequence_parallel=seq, ctx=ctx)
    return _cls(ctx, "Linear")(in_features, out_features, bias, out_groups=out_groups, ctx=ctx)


def LayerNorm(
    normalized_shape: int, eps: float = 1e-5, bias: bool = True, *, ctx: ParallelContext | None = None
) -> nn.Module:
    """Layer normalisation over the (possibly split) hidden dimension."""
    ctx = _ctx(ctx)
    if not _is_parallel(ctx):
        return nn.LayerNorm(normalized_shape, eps=eps, bias=bias)
    assert ctx is not None
    if ctx.dims.tensor_mode == "1d":
        return mode_module(ctx).LayerNorm1D(
            normalized_shape, eps, bias, sequence_parallel=_sequence_parallel(ctx), ctx=ctx
        )
    return _cls(ctx, "LayerNorm")(normalized_shape, eps, bias, ctx=ctx)


def Embedding(num_embeddings: int, embedding_dim: int, *, ctx: ParallelContext | None = None) -> nn.Module:
    """Lookup with the whole table's rows on every rank (the hidden dimension split as the activations)."""
    ctx = _ctx(ctx)
    if not _is_parallel(ctx):
        return nn.Embedding(num_embeddings, embedding_dim)
    assert ctx is not None
    return _cls(ctx, "Embedding")(num_embeddings, embedding_dim, ctx=ctx)


def VocabParallelEmbedding(num_embeddings: int, embedding_dim: int, *, ctx: ParallelContext | None = None) -> nn.Module:
    """Lookup with the vocabulary split over the tensor group too (for large vocabularies)."""
    ctx = _ctx(ctx)
    if not _is_parallel(ctx):
        return nn.Embedding(num_embeddings, embedding_dim)
    assert ctx is not None
    return _cls(ctx, "VocabParallelEmbedding")(num_embeddings, embedding_dim, ctx=ctx)


def _plain_classifier(in_features: int, num_classes: int, bias: bool, weight: nn.Parameter | None) -> nn.Module:
    layer = nn.Linear(in_features, num_classes, bias)
    if weight is not None:
        layer.weight = weight  # a tied head
    return layer


def Classifier(
    in_features: int, num_classes: int, bias: bool = True, *, weight: nn.Parameter | None = None,
    ctx: ParallelContext | None = None,
) -> nn.Module:  # fmt: skip
    """Logits over all classes on every rank (for few classes)."""
    ctx = _ctx(ctx)
    if not _is_parallel(ctx):
        return _plain_classifier(in_features, num_classes, bias, weight)
    assert ctx is not None
    return _cls(ctx, "Classifier")(in_features, num_classes, bias, weight=weight, ctx=ctx)


def VocabParallelClassifier(
    in_features: int, num_classes: int, bias: bool = False, *, weight: nn.Parameter | None = None,
    ctx: ParallelContext | None = None,
) -> nn.Module:  # fmt: skip
    """Logits split over the classes (a vocabulary); ``weight`` ties it to a VocabParallelEmbedding."""
    ctx = _ctx(ctx)
    if not _is_parallel(ctx):
        return _plain_classifier(in_features, num_classes, bias, weight)
    assert ctx is not None
    return _cls(ctx, "VocabParallelClassifier")(in_features, num_classes, bias, weight=weight, ctx=ctx)


def PatchEmbedding(
    img_size: int, patch_size: int, in_chans: int, embed_size: int, *, ctx: ParallelContext | None = None
) -> nn.Module:
    """ViT patch embedding with class token and position embedding."""
    ctx = _ctx(ctx)
    if not _is_parallel(ctx):
        return plain.PatchEmbedding(img_size, patch_size, in_chans, embed_size)
    assert ctx is not None
    return _cls(ctx, "PatchEmbedding")(img_size, patch_size, in_chans, embed_size, ctx=ctx)


def Dropout(p: float = 0.5, *, parallel_input: bool = False, ctx: ParallelContext | None = None) -> nn.Module:
    """Dropout whose masks agree across the ranks that hold the same activations."""
    ctx = _ctx(ctx)
    if not _is_parallel(ctx):
        return nn.Dropout(p)
    assert ctx is not None
    if ctx.dims.tensor_mode == "1d":
        split = parallel_input or _sequence_parallel(ctx)
        return mode_module(ctx).Dropout1D(p, parallel_input=split, ctx=ctx)
    return _cls(ctx, "Dropout")(p, ctx=ctx)


def CrossEntropyLoss(*, ctx: ParallelContext | None = None) -> nn.Module:
    """Mean cross-entropy of logits ``[..., classes]`` (all classes on every rank) against full targets."""
    ctx = _ctx(ctx)
    if not _is_parallel(ctx):
        return plain.CrossEntropyLoss()
    assert ctx is not None
    if ctx.dims.tensor_mode == "1d":
        return mode_module(ctx).CrossEntropyLoss1D()
    return _cls(ctx, "CrossEntropyLoss")(ctx=ctx)


def VocabParallelCrossEntropyLoss(*, ctx: ParallelContext | None = None) -> nn.Module:
    """Mean cross-entropy of logits split over the classes, against full targets."""
    ctx = _ctx(ctx)
    if not _is_parallel(ctx):
        return plain.CrossEntropyLoss()
    assert ctx is not None
    return _cls(ctx, "VocabParallelCrossEntropyLoss")(ctx=ctx)


# ---- boundary helpers ----------------------------------------------------------------------


def split_activation(x: torch.Tensor, ctx: ParallelContext | None = None) -> torch.Tensor:
    """This rank's piece of a full ``[batch, seq, hidden]`` (or ``[batch, hidden]``) activation."""
    ctx = _ctx(ctx)
    if not _is_parallel(ctx):
        return x
    assert ctx is not None
    return mode_module(ctx).split_activation(x, ctx)


def gather_activation(x: torch.Tensor, ctx: ParallelContext | None = None, full_shape: Any = None) -> torch.Tensor:
    """The full activation from every rank's piece (collective over the tensor group)."""
    ctx = _ctx(ctx)
    if not _is_parallel(ctx):
        return x
    assert ctx is not None
    mod = mode_module(ctx)
    if ctx.dims.tensor_mode == "1d":
        return mod.gather_activation(x, ctx)
    return mod.gather_activation(x, ctx, full_shape=full_shape)


def enter_sequence_parallel(x: torch.Tensor, ctx: ParallelContext | None = None) -> torch.Tensor:
    """Where the transformer blocks begin: with 1D sequence-parallel regions configured, keep this
    rank's part of the sequence (``[b, s, h] -> [b, s/P, h]``); otherwise ``x`` unchanged."""
    ctx = _ctx(ctx)
    if not _sequence_parallel(ctx):
        return x
    assert ctx is not None
    return mode_module(ctx).split_activation(x, ctx, sequence_parallel=True)


def exit_sequence_parallel(x: torch.Tensor, ctx: ParallelContext | None = None) -> torch.Tensor:
    """Where the transformer blocks end: the inverse of :func:`enter_sequence_parallel`."""
    ctx = _ctx(ctx)
    if not _sequence_parallel(ctx):
        return x
    assert ctx is not None
    return mode_module(ctx).gather_activation(x, ctx, sequence_parallel=True)


def hidden_parts(ctx: ParallelContext | None = None) -> int:
    """Into how many blocks the hidden dimension of an activation is split."""
    ctx = _ctx(ctx)
    if not _is_parallel(ctx):
        return 1
    assert ctx is not None
    return int(mode_module(ctx).hidden_parts(ctx))


def split_region_rng(ctx: ParallelContext | None = None) -> contextlib.AbstractContextManager[None]:
    """Random stream for work on split activations (attention dropout): distinct per tensor rank."""
    ctx = _ctx(ctx)
    if not _is_parallel(ctx):
        return contextlib.nullcontext()
    assert ctx is not None
    return ctx.rng.fork("tensor")
