"""2D (SUMMA) layers: thin ``nn.Module``s over :mod:`tessera.parallel.tensor.tp2d.functional`
(the layout and the parameters' blocks are described there), written against the mode's
:class:`~tessera.parallel.tensor.grid.SummaGrid` (``grid_of``) so that 2.5D subclasses them with
its own grid. Each takes its context as ``ctx=``; ``tessera.nn`` has the same classes taking the
current context by default."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tessera.context import ParallelContext
from tessera.parallel.tensor.common import ShardSpec, check_tied, shard_parameter
from tessera.parallel.tensor.grid import SummaGrid
from tessera.parallel.tensor.plain import PatchEmbedding
from tessera.parallel.tensor.tp2d.functional import (
    check_hidden,
    classifier,
    cross_entropy,
    embedding,
    grid_2d,
    hidden_spec,
    layer_norm,
    linear,
    linear_form,
    mask_padded_classes,
    patch_embedding,
    summa_weight_spec,
    table_spec,
    vocab_parallel_embedding,
    vocab_parallel_loss,
)

__all__ = [
    "Classifier2D",
    "CrossEntropyLoss2D",
    "Dropout2D",
    "Embedding2D",
    "GridOf",
    "LayerNorm2D",
    "Linear2D",
    "PatchEmbedding2D",
    "VocabParallelClassifier2D",
    "VocabParallelCrossEntropyLoss2D",
    "VocabParallelEmbedding2D",
]

GridOf = Callable[[ParallelContext], SummaGrid]


class _GridLayer(nn.Module):
    """A layer on a SUMMA grid; ``grid_of`` picks the mode's grid (2D here, 2.5D in tp2p5d)."""

    grid_of: ClassVar[GridOf] = staticmethod(grid_2d)

    def __init__(self, ctx: ParallelContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.grid = type(self).grid_of(self.ctx)


class Linear2D(_GridLayer):
    """``y = x W^T + b``: ``[b/q, (s,) in/q]`` -> ``[b/q, (s,) out/q]`` by SUMMA; ``bias [out]``
    keeps block ``j``, ``weight [out, in]`` block ``(j, i)`` in form "ab" (the output stays put)
    or ``(i, j)`` in form "abt" (the input stays put). ``form`` None keeps the wider side put
    (``functional.linear_form``: "abt" when ``out < in``); ``keep_blocks`` keeps the blocks
    received in the forward for the backward (fewer bytes, more activation memory). With
    ``out_groups`` fused outputs the local output is this rank's block of each part, side by side."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        out_groups: int = 1,
        form: str | None = None,
        keep_blocks: bool = False,
        ctx: ParallelContext,
    ) -> None:
        super().__init__(ctx)
        self.in_features, self.out_features, self.out_groups = in_features, out_features, out_groups
        self.keep_blocks = keep_blocks
        if form is None:
            out_local, in_local = summa_weight_spec(self.grid, out_features, in_features, out_groups).local_shape(ctx)
            form = linear_form(in_local, out_local)
        self.form = form
        full = torch.empty(out_features, in_features)
        nn.init.kaiming_uniform_(full, a=math.sqrt(5))  # as torch.nn.Linear
        spec = summa_weight_spec(self.grid, out_features, in_features, out_groups, form)
        self.weight = shard_parameter(full, spec, self.ctx)
        self.bias: nn.Parameter | None = None
        if bias:
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0.0
            full_bias = torch.empty(out_features).uniform_(-bound, bound)
            self.bias = shard_parameter(full_bias, hidden_spec(self.grid, (out_features,), out_groups), self.ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_hidden(x, self.in_features, self.grid, type(self).__name__)
        return linear(x, self.weight, self.bias, self.grid, self.form, self.keep_blocks)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"out_groups={self.out_groups}, form={self.form}, keep_blocks={self.keep_blocks}"
        )


class LayerNorm2D(_GridLayer):
    """Layer norm of ``[b/q, (s,) h/q]`` over the whole (true) hidden size; ``weight``/``bias``
    ``[h]`` keep block ``j``."""

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        bias: bool = True,
        *,
        ctx: ParallelContext,
    ) -> None:
        super().__init__(ctx)
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if len(shape) != 1:
            raise ValueError(f"{type(self).__name__} normalises the hidden dimension only; got shape {shape}")
        self.hidden, self.eps = shape[0], eps
        spec = hidden_spec(self.grid, shape)
        self.weight = shard_parameter(torch.ones(shape), spec, self.ctx)
        self.bias: nn.Parameter | None = shard_parameter(torch.zeros(shape), spec, self.ctx) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_hidden(x, self.hidden, self.grid, type(self).__name__)
        return layer_norm(x, self.weight, self.bias, self.hidden, self.eps, self.grid)

    def extra_repr(self) -> str:
        return f"{self.hidden}, eps={self.eps}, bias={self.bias is not None}"


class Embedding2D(_GridLayer):
    """Full ids ``[B, (S)]`` -> ``[B/q, (S,) D/q]``. The table ``[V, D]`` is stored 1/q^2 per rank
    (rows block i, hidden block j) and all-gathered over ``2d_col`` (the whole vocabulary of
    hidden block j) for the lookup."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, ctx: ParallelContext) -> None:
        super().__init__(ctx)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        full = torch.randn(num_embeddings, embedding_dim)  # as torch.nn.Embedding
        self.weight = shard_parameter(full, table_spec(self.grid, num_embeddings, embedding_dim), self.ctx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return embedding(ids, self.weight, self.grid)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class VocabParallelEmbedding2D(_GridLayer):
    """Full ids ``[B, (S)]`` -> ``[B/q, (S,) D/q]`` with the vocabulary split too: the table
    ``[V, D]`` is split as a SUMMA weight (vocabulary block j, hidden block i), so a
    :class:`VocabParallelClassifier2D` can share it. Costs a row reduce-scatter of the partial
    lookups ``[B, (S,) D/q]`` and a grid transpose of the result ``[B/q, (S,) D/q]``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, ctx: ParallelContext) -> None:
        super().__init__(ctx)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        full = torch.randn(num_embeddings, embedding_dim)
        self.weight = shard_parameter(full, summa_weight_spec(self.grid, num_embeddings, embedding_dim), self.ctx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embedding(ids, self.weight, self.grid)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class Classifier2D(_GridLayer):
    """``[b/q, (s,) h/q]`` -> logits ``[b/q, (s,) C]`` with every class (equal along ``2d_row``).
    ``weight [C, h]`` is stored as :class:`Embedding2D`'s table (and may be that weight, tied);
    ``bias [C]`` is replicated."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        bias: bool = True,
        *,
        weight: nn.Parameter | None = None,
        ctx: ParallelContext,
    ) -> None:
        super().__init__(ctx)
        self.in_features, self.num_classes = in_features, num_classes
        plain = nn.Linear(in_features, num_classes, bias=bias)
        spec = table_spec(self.grid, num_classes, in_features)
        if weight is None:
            self.weight = shard_parameter(plain.weight, spec, self.ctx)
        else:
            self.weight = check_tied(weight, spec, type(self).__name__)
        self.bias = nn.Parameter(plain.bias.detach().clone()) if plain.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_hidden(x, self.in_features, self.grid, type(self).__name__)
        return classifier(x, self.weight, self.bias, self.num_classes, self.grid)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, num_classes={self.num_classes}, bias={self.bias is not None}"


class VocabParallelClassifier2D(Linear2D):
    """``[b/q, (s,) h/q]`` -> logits ``[b/q, (s,) C/q]`` split over the classes as the hidden
    dimension is: a :class:`Linear2D` (``weight [C, h]`` may be a
    :class:`VocabParallelEmbedding2D`'s, tied: then in form "ab", as the embedding splits it).
    Padded classes get the dtype's lowest logit, so a softmax or
    :class:`VocabParallelCrossEntropyLoss2D` gives them no probability or gradient."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        bias: bool = False,
        *,
        weight: nn.Parameter | None = None,
        keep_blocks: bool = False,
        ctx: ParallelContext,
    ) -> None:
        form = "ab" if weight is not None else None
        super().__init__(in_features, num_classes, bias, form=form, keep_blocks=keep_blocks, ctx=ctx)
        self.num_classes = num_classes
        if weight is not None:
            expected = summa_weight_spec(self.grid, num_classes, in_features)
            self.weight = check_tied(weight, expected, type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mask_padded_classes(super().forward(x), self.num_classes, self.grid)


class PatchEmbedding2D(_GridLayer):
    """ViT patch embedding (as ``plain.PatchEmbedding``): full images ``[B, c, H, W]``
    -> ``[B/q, 1 + N, E/q]``. Every parameter keeps embedding block j (replicated over
    ``2d_col``; their gradients are summed over it)."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_size: int, *, ctx: ParallelContext) -> None:
        super().__init__(ctx)
        plain = PatchEmbedding(img_size, patch_size, in_chans, embed_size)
        self.patch_size, self.num_patches, self.embed_size = patch_size, plain.num_patches, embed_size

        def shard(p: torch.Tensor, dim: int) -> nn.Parameter:
            dims = tuple((self.grid.row.name,) if d == dim else () for d in range(p.dim()))
            return shard_parameter(p, ShardSpec(tuple(p.shape), dims), self.ctx)

        self.weight = shard(plain.weight, 0)
        assert plain.bias is not None
        self.bias = shard(plain.bias, 0)
        self.cls_token = shard(plain.cls_token, 2)
        self.pos_embed = shard(plain.pos_embed, 2)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        params = (self.weight, self.bias, self.cls_token, self.pos_embed)
        return patch_embedding(images, params, self.patch_size, self.grid)

    def extra_repr(self) -> str:
        return f"patch_size={self.patch_size}, num_patches={self.num_patches}, embed_size={self.embed_size}"


class Dropout2D(_GridLayer):
    """Dropout of split activations: every rank holds a different block, so the mask comes from
    ``ctx.rng.fork("tensor")`` (different per tensor rank, equal across data replicas)."""

    def __init__(self, p: float = 0.5, *, ctx: ParallelContext) -> None:
        super().__init__(ctx)
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must be in [0, 1], got {p}")
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with self.ctx.rng.fork("tensor"):
            return F.dropout(x, self.p, training=True)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class CrossEntropyLoss2D(_GridLayer):
    """Mean cross entropy of logits ``[b/q, (s,) C]`` (all classes, e.g. :class:`Classifier2D`'s)
    against full targets ``[B, (S)]``: the mean over the whole batch, equal on every rank."""

    def __init__(self, *, ignore_index: int = -100, ctx: ParallelContext) -> None:
        super().__init__(ctx)
        self.ignore_index = ignore_index

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, targets, self.ignore_index, self.grid)


class VocabParallelCrossEntropyLoss2D(_GridLayer):
    """Mean cross entropy of class-split logits ``[b/q, (s,) C/q]`` (a
    :class:`VocabParallelClassifier2D`'s) against full targets ``[B, (S)]``; equal on every rank.

    ``num_classes``: the true class count, so that the padding of an uneven split is masked out.
    Left None it is taken as ``C/q * q``: right for an even split and for the classifier's
    logits, whose padded classes already hold the lowest logit."""

    def __init__(self, *, num_classes: int | None = None, ignore_index: int = -100, ctx: ParallelContext) -> None:
        super().__init__(ctx)
        self.num_classes, self.ignore_index = num_classes, ignore_index

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        num_classes = self.num_classes if self.num_classes is not None else logits.shape[-1] * self.grid.q
        return vocab_parallel_loss(logits, targets, num_classes, self.ignore_index, self.grid)
