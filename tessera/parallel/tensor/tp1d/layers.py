"""1D (Megatron) layers: thin ``nn.Module``s over :mod:`tessera.parallel.tensor.tp1d.functional`
(the layout, sequence parallelism and padding are described there). Each takes its context as
``ctx=``; ``tessera.nn`` has the same classes taking the current context by default."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera import comm
from tessera.context import ParallelContext
from tessera.parallel.tensor.common import ShardSpec, check_tied, local_range, shard_parameter
from tessera.parallel.tensor.plain import PatchEmbedding
from tessera.parallel.tensor.tp1d.functional import (
    TENSOR,
    column_parallel_linear,
    gather_last_dim,
    row_parallel_linear,
    split_last_dim,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
)

__all__ = [
    "Classifier1D",
    "CrossEntropyLoss1D",
    "Dropout1D",
    "Embedding1D",
    "LayerNorm1D",
    "Linear1D_Col",
    "Linear1D_Row",
    "PatchEmbedding1D",
    "VocabParallelClassifier1D",
    "VocabParallelCrossEntropyLoss1D",
    "VocabParallelEmbedding1D",
]


class Linear1D_Col(nn.Module):
    """Column-parallel linear: ``weight [out, in]`` split on ``out`` (each of ``out_groups`` fused
    parts split on its own). ``[..., in]`` -> ``[..., out/P]`` (the concatenation of this rank's
    block of each part), or ``[..., out]`` with ``gather_output``. With ``sequence_parallel`` the
    input is ``[b, s/P, in]`` and the output ``[b, s, out/P]``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        gather_output: bool = False,
        out_groups: int = 1,
        sequence_parallel: bool = False,
        ctx: ParallelContext,
    ) -> None:
        super().__init__()
        self.ctx = ctx
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.out_groups, self.sequence_parallel = gather_output, out_groups, sequence_parallel
        plain = nn.Linear(in_features, out_features, bias=bias)
        spec = ShardSpec((out_features, in_features), ((TENSOR,), ()), (out_groups, 1))
        self.weight = shard_parameter(plain.weight, spec, self.ctx)
        self.bias: nn.Parameter | None = None
        if plain.bias is not None:
            bias_spec = ShardSpec((out_features,), ((TENSOR,),), (out_groups,))
            self.bias = shard_parameter(plain.bias, bias_spec, self.ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.ctx.group(TENSOR)
        y = column_parallel_linear(x, self.weight, self.bias, group, sequence_parallel=self.sequence_parallel)
        if self.gather_output:
            y = gather_last_dim(y, group, self.out_features, self.out_groups)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"out_groups={self.out_groups}, gather_output={self.gather_output}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class Linear1D_Row(nn.Module):
    """Row-parallel linear: ``weight [out, in]`` split on ``in``, ``bias [out]`` replicated.
    ``[..., in/P]`` (or ``[..., in]`` with ``input_is_parallel=False``) -> ``[..., out]`` summed
    over the group; with ``sequence_parallel`` ``[b, s, in/P]`` -> ``[b, s/P, out]``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        ctx: ParallelContext,
    ) -> None:
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("Linear1D_Row: sequence_parallel needs input_is_parallel=True (a Col layer's output)")
        self.ctx = ctx
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        plain = nn.Linear(in_features, out_features, bias=bias)
        spec = ShardSpec((out_features, in_features), ((), (TENSOR,)))
        self.weight = shard_parameter(plain.weight, spec, self.ctx)
        self.bias = plain.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.ctx.group(TENSOR)
        if not self.input_is_parallel:
            x = split_last_dim(x, group)
        _, valid = local_range(self.in_features, group.size, group.rank)
        return row_parallel_linear(
            x, self.weight, self.bias, group, valid_in=valid, sequence_parallel=self.sequence_parallel
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}"
        )


class LayerNorm1D(nn.Module):
    """LayerNorm over the (whole) hidden dimension, replicated ``weight``/``bias``. With
    ``sequence_parallel`` (input ``[b, s/P, h]``) their gradients are all-reduced over ``tensor``."""

    def __init__(
        self,
        normalized_shape: int | list[int] | tuple[int, ...],
        eps: float = 1e-5,
        bias: bool = True,
        *,
        sequence_parallel: bool = False,
        ctx: ParallelContext,
    ) -> None:
        super().__init__()
        self.ctx = ctx
        self.sequence_parallel = sequence_parallel
        plain = nn.LayerNorm(normalized_shape, eps=eps, bias=bias)
        self.normalized_shape, self.eps = plain.normalized_shape, eps
        self.weight, self.bias = plain.weight, plain.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight: torch.Tensor = self.weight
        bias: torch.Tensor | None = self.bias
        if self.sequence_parallel:  # each rank normalised its sequence part only
            group = self.ctx.group(TENSOR)
            weight = comm.copy_forward_all_reduce_backward(weight, group)
            bias = None if bias is None else comm.copy_forward_all_reduce_backward(bias, group)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"


class Embedding1D(nn.Module):
    """Embedding with ``weight [num, dim]`` split on ``dim``: ``ids [...]`` -> ``[..., dim]``
    replicated (each rank looks up its columns, then all-gather)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        ctx: ParallelContext,
    ) -> None:
        super().__init__()
        self.ctx = ctx
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        plain = nn.Embedding(num_embeddings, embedding_dim, padding_idx)
        self.padding_idx = plain.padding_idx
        spec = ShardSpec((num_embeddings, embedding_dim), ((), (TENSOR,)))
        self.weight = shard_parameter(plain.weight, spec, self.ctx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = F.embedding(ids, self.weight, self.padding_idx)
        return gather_last_dim(local, self.ctx.group(TENSOR), self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}"


class VocabParallelEmbedding1D(nn.Module):
    """Embedding with ``weight [num, dim]`` split on ``num`` (padded when uneven): ``ids [...]`` ->
    ``[..., dim]`` replicated (masked local lookup, then all-reduce)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        ctx: ParallelContext,
    ) -> None:
        super().__init__()
        self.ctx = ctx
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        plain = nn.Embedding(num_embeddings, embedding_dim, padding_idx)
        self.padding_idx = plain.padding_idx
        spec = ShardSpec((num_embeddings, embedding_dim), ((TENSOR,), ()))
        self.weight = shard_parameter(plain.weight, spec, self.ctx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        group = self.ctx.group(TENSOR)
        start, _ = local_range(self.num_embeddings, group.size, group.rank)
        return vocab_parallel_embedding(ids, self.weight, group, start, self.padding_idx)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}"


class Classifier1D(nn.Module):
    """Classifier head, row-parallel over ``in_features``: ``weight [classes, in]`` split on ``in``
    (may be ``Embedding1D.weight``, tied), ``bias`` replicated. ``[..., in]`` -> ``[..., classes]``
    replicated."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        bias: bool = True,
        *,
        weight: nn.Parameter | None = None,
        ctx: ParallelContext,
    ) -> None:
        super().__init__()
        self.ctx = ctx
        self.in_features, self.num_classes = in_features, num_classes
        plain = nn.Linear(in_features, num_classes, bias=bias)
        spec = ShardSpec((num_classes, in_features), ((), (TENSOR,)))
        if weight is None:
            self.weight = shard_parameter(plain.weight, spec, self.ctx)
        else:
            self.weight = check_tied(weight, spec, "Classifier1D")
        self.bias = plain.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.ctx.group(TENSOR)
        _, valid = local_range(self.in_features, group.size, group.rank)
        return row_parallel_linear(split_last_dim(x, group), self.weight, self.bias, group, valid_in=valid)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, num_classes={self.num_classes}, bias={self.bias is not None}"


class VocabParallelClassifier1D(nn.Module):
    """Classifier head, column-parallel over classes: ``weight [classes, in]`` split on classes
    (may be ``VocabParallelEmbedding1D.weight``, tied). ``[..., in]`` replicated ->
    ``[..., classes/P]`` (padded). Padded classes get the dtype's lowest logit, so a softmax (or
    :class:`VocabParallelCrossEntropyLoss1D`) gives them zero probability and zero gradient."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        bias: bool = False,
        *,
        weight: nn.Parameter | None = None,
        ctx: ParallelContext,
    ) -> None:
        super().__init__()
        self.ctx = ctx
        self.in_features, self.num_classes = in_features, num_classes
        plain = nn.Linear(in_features, num_classes, bias=bias)
        spec = ShardSpec((num_classes, in_features), ((TENSOR,), ()))
        if weight is None:
            self.weight = shard_parameter(plain.weight, spec, self.ctx)
        else:
            self.weight = check_tied(weight, spec, "VocabParallelClassifier1D")
        self.bias: nn.Parameter | None = None
        if plain.bias is not None:
            self.bias = shard_parameter(plain.bias, ShardSpec((num_classes,), ((TENSOR,),)), self.ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.ctx.group(TENSOR)
        logits = column_parallel_linear(x, self.weight, self.bias, group)
        _, valid = local_range(self.num_classes, group.size, group.rank)
        if valid < logits.shape[-1]:
            padded = torch.arange(logits.shape[-1], device=logits.device) >= valid
            logits = logits.masked_fill(padded, torch.finfo(logits.dtype).min)
        return logits

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, num_classes={self.num_classes}, bias={self.bias is not None}"


class PatchEmbedding1D(nn.Module):
    """ViT patch embedding (as ``plain.PatchEmbedding``) with every parameter split on the
    embedding dimension: each rank computes its ``embed/P`` channels (conv, class token,
    position embedding), then all-gather. ``[b, c, H, W]`` -> ``[b, 1 + N, embed]`` replicated."""

    def __init__(
        self,
        img_size: int,
        patch_size: int,
        in_chans: int,
        embed_size: int,
        *,
        ctx: ParallelContext,
    ) -> None:
        super().__init__()
        self.ctx = ctx
        plain = PatchEmbedding(img_size, patch_size, in_chans, embed_size)
        self.patch_size, self.num_patches, self.embed_size = patch_size, plain.num_patches, embed_size
        split_first = ((TENSOR,), (), (), ())
        self.weight = shard_parameter(plain.weight, ShardSpec(tuple(plain.weight.shape), split_first), self.ctx)
        assert plain.bias is not None  # a conv with bias
        self.bias = shard_parameter(plain.bias, ShardSpec((embed_size,), ((TENSOR,),)), self.ctx)
        split_last = ((), (), (TENSOR,))
        self.cls_token = shard_parameter(plain.cls_token, ShardSpec(tuple(plain.cls_token.shape), split_last), self.ctx)
        self.pos_embed = shard_parameter(plain.pos_embed, ShardSpec(tuple(plain.pos_embed.shape), split_last), self.ctx)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        group = self.ctx.group(TENSOR)
        images = comm.copy_forward_all_reduce_backward(images, group)  # each rank's channels feed back a part
        x = F.conv2d(images, self.weight, self.bias, stride=self.patch_size).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return gather_last_dim(x, group, self.embed_size)

    def extra_repr(self) -> str:
        return f"patch_size={self.patch_size}, num_patches={self.num_patches}, embed_size={self.embed_size}"


class Dropout1D(nn.Module):
    """Dropout whose mask comes from ``ctx.rng.fork("tensor")`` when the input is split over the
    tensor group (``parallel_input``: column-parallel outputs, sequence-parallel activations), and
    from the default stream, equal on every rank of the group, when the input is replicated."""

    def __init__(self, p: float = 0.5, *, parallel_input: bool = False, ctx: ParallelContext) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must be in [0, 1], got {p}")
        self.ctx = ctx
        self.p, self.parallel_input = p, parallel_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.parallel_input:
            with self.ctx.rng.fork(TENSOR):
                return F.dropout(x, self.p, training=True)
        return F.dropout(x, self.p, training=True)

    def extra_repr(self) -> str:
        return f"p={self.p}, parallel_input={self.parallel_input}"


class CrossEntropyLoss1D(nn.Module):
    """Mean cross entropy of full logits ``[..., C]`` (replicated) and targets ``[...]``; the same
    scalar on every rank."""

    def __init__(self, *, ignore_index: int = -100, ctx: ParallelContext) -> None:
        super().__init__()
        self.ignore_index = ignore_index

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=self.ignore_index)


class VocabParallelCrossEntropyLoss1D(nn.Module):
    """Mean cross entropy of class-split logits ``[..., C/P]`` (a ``VocabParallelClassifier1D``'s
    output) and full targets ``[...]``; the same scalar on every rank.

    ``num_classes``: the true class count, so that the padding of an uneven split is masked out.
    Left None, it is taken as ``C/P * P``: right for an even split, and for logits of
    ``VocabParallelClassifier1D``, whose padded classes already hold the lowest logit.
    """

    def __init__(self, *, num_classes: int | None = None, ignore_index: int = -100, ctx: ParallelContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.num_classes, self.ignore_index = num_classes, ignore_index

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        group = self.ctx.group(TENSOR)
        num_classes = self.num_classes if self.num_classes is not None else logits.shape[-1] * group.size
        flat_targets = targets.flatten()
        losses = vocab_parallel_cross_entropy(logits.flatten(0, -2), flat_targets, group, num_classes)
        kept = flat_targets != self.ignore_index
        return torch.where(kept, losses, torch.zeros_like(losses)).sum() / kept.sum()
