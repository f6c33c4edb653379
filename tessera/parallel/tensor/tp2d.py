"""2D (SUMMA / Optimus) tensor parallelism on a q x q grid of the tensor group.

Rank ``(i, j)`` (tensor index ``i*q + j``): ``i = ctx.local_rank("2d_col")`` is its grid row,
``j = ctx.local_rank("2d_row")`` its grid column.

Layout. An activation ``[b, (s,) h]`` is held as the block ``[b/q (block i), (s,) h/q (block j)]``;
batch and hidden are zero-padded to multiples of q (the batch padding rows carry no loss and are
dropped by :func:`gather_activation`; the hidden padding units stay zero in every layer).

Parameters (torch layouts; a ``ShardSpec`` lists the axes splitting each dimension):

* ``Linear.weight [out, in]``: out by ``2d_row`` (block j), in by ``2d_col`` (block i). ``Y = X W^T``
  is SUMMA ``C = A B`` with ``B = W^T``, and rank (i, j) holds ``B_ij`` (transposed).
* ``Linear.bias``, ``LayerNorm`` and ``PatchEmbedding`` parameters: their embedding dimension by
  ``2d_row``, replicated over ``2d_col`` (gradients summed over it: its ranks see other batch rows).
* ``Embedding`` / ``Classifier`` tables ``[V, h]``: rows by ``2d_col``, hidden by ``2d_row`` (1/q^2
  per rank), all-gathered over ``2d_col`` for use and the gradient reduce-scattered back.
  ``Classifier.bias`` is replicated.
* ``VocabParallelEmbedding`` / ``VocabParallelClassifier`` ``[V, h]``: as ``Linear.weight``, so the
  head can be tied to the embedding; the head is a SUMMA linear.

Linear cost (Optimus): with ``X`` this rank's input block ``[b/q * s, in/q]``, ``W`` its weight
block ``[out/q, in/q]`` and ``|.|`` bytes, forward and backward move per rank

* ``2d_row``: broadcast ``2 (q-1) |X|`` (X_il in the forward and for dW), reduce ``(q-1) |X|`` (dX);
* ``2d_col``: broadcast ``2 (q-1) |W|`` (W_lj in the forward and for dX), reduce ``(q-1) |W|`` (dW);
  all-reduce ``2 (q-1)/q |bias|`` (the bias gradient over the batch blocks),

in all ``3 (q-1) (|X| + |W|) + 2 (q-1)/q |bias|`` (see ``summa.py`` for the steps).

The layers here are written against a :class:`~tessera.parallel.tensor.summa.SummaGrid`, so
2.5D (``tp2p5d.py``) reuses them with its own grid (``grid_of``): one code path for both modes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tessera import comm
from tessera.comm import AxisGroup
from tessera.context import ParallelContext, get_context
from tessera.nn.plain import PatchEmbedding
from tessera.parallel.tensor import summa
from tessera.parallel.tensor.common import (
    ShardSpec,
    all_reduce_forward_backward,
    check_tied,
    class_parallel_cross_entropy,
    local_range,
    round_up,
    shard_parameter,
    sum_grad_over,
)
from tessera.parallel.tensor.summa import SummaGrid

__all__ = [
    "Classifier2D",
    "CrossEntropyLoss2D",
    "Dropout2D",
    "Embedding2D",
    "LayerNorm2D",
    "Linear2D",
    "PatchEmbedding2D",
    "VocabParallelClassifier2D",
    "VocabParallelCrossEntropyLoss2D",
    "VocabParallelEmbedding2D",
    "batch_parts",
    "gather_activation",
    "grid_2d",
    "hidden_parts",
    "split_activation",
]

GridOf = Callable[[ParallelContext], SummaGrid]


def _context(ctx: ParallelContext | None) -> ParallelContext:
    return ctx if ctx is not None else get_context()


def grid_2d(ctx: ParallelContext) -> SummaGrid:
    """The q x q grid of a context in tensor mode ``2d``."""
    if ctx.dims.tensor_mode != "2d":
        raise ValueError(f"2D tensor-parallel layers need tensor mode '2d'; the context has {ctx.dims.tensor_mode!r}")
    return SummaGrid.from_context(ctx, row="2d_row", col="2d_col")


# ---- functional core (any SUMMA grid) --------------------------------------------------------


def summa_weight_spec(grid: SummaGrid, out_features: int, in_features: int, out_groups: int = 1) -> ShardSpec:
    """``[out, in]`` with out split along the grid row (block j), in along the column (block i)."""
    return ShardSpec((out_features, in_features), ((grid.row.name,), (grid.col.name,)), (out_groups, 1))


def table_spec(grid: SummaGrid, rows: int, hidden: int) -> ShardSpec:
    """``[rows, hidden]`` with rows split along the grid column (block i), hidden along the row
    (block j): 1/q^2 per rank, all-gathered over the column for use."""
    return ShardSpec((rows, hidden), ((grid.col.name,), (grid.row.name,)))


def hidden_spec(grid: SummaGrid, shape: Sequence[int], groups: int = 1) -> ShardSpec:
    """Last dimension split as the activations' hidden dimension (block j); the rest whole."""
    dims = tuple((grid.row.name,) if d == len(shape) - 1 else () for d in range(len(shape)))
    return ShardSpec(tuple(shape), dims, (1,) * (len(shape) - 1) + (groups,))


def _check_hidden(x: torch.Tensor, full: int, grid: SummaGrid, what: str) -> None:
    local = round_up(full, grid.q) // grid.q
    if x.shape[-1] != local:
        raise ValueError(
            f"{what}: input's last dimension is {x.shape[-1]}, expected this rank's block {local} of {full} "
            f"split {grid.q} ways (use split_activation on a full input)"
        )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grid: SummaGrid) -> torch.Tensor:
    """``[b/(dq), (s,) in/q]`` -> ``[b/(dq), (s,) out/q]`` by SUMMA ``C = A B``: ``A`` the input,
    ``B = W^T`` (``weight`` is this rank's ``[out/q (block j), in/q (block i)]``)."""
    w = sum_grad_over(weight, grid.dep)  # each grid computes its share of dW
    y = summa.matmul_ab(x.reshape(-1, x.shape[-1]), w.t(), grid.row, grid.col)
    y = y.view(*x.shape[:-1], y.shape[-1])
    if bias is not None:
        y = y + sum_grad_over(bias, *grid.weight_replicas)
    return y


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    hidden: int,
    eps: float,
    grid: SummaGrid,
) -> torch.Tensor:
    """Layer norm of ``[..., h/q]`` (block j, zero-padded) over the true ``hidden`` size: two
    row-group all-reduces of ``[..., 1]`` statistics forward and two backward."""
    _, valid = local_range(hidden, grid.q, grid.j)
    real = torch.arange(x.shape[-1], device=x.device) < valid if valid < x.shape[-1] else None
    if real is not None:  # padded units count in no statistic, stay zero and get no gradient
        x = x * real
    mean = all_reduce_forward_backward(x.sum(-1, keepdim=True), grid.row) / hidden
    centred = x - mean if real is None else (x - mean) * real
    var = all_reduce_forward_backward((centred * centred).sum(-1, keepdim=True), grid.row) / hidden
    y = centred * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * sum_grad_over(weight, *grid.weight_replicas)
    if bias is not None:
        y = y + sum_grad_over(bias, *grid.weight_replicas)
    return y


def embedding(ids: torch.Tensor, weight: torch.Tensor, grid: SummaGrid) -> torch.Tensor:
    """Full ``ids [B, (S)]`` -> ``[B/(dq), (S,) D/q]``: this rank's batch block looked up in the
    table ``[V/q (block i), D/q (block j)]`` all-gathered over the column (gradient
    reduce-scattered, which sums the batch blocks' shares)."""
    table = comm.all_gather_forward_reduce_scatter_backward(sum_grad_over(weight, grid.dep), grid.col, 0)
    return F.embedding(summa.batch_block(ids, grid), table)


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, grid: SummaGrid) -> torch.Tensor:
    """Full ``ids [B, (S)]`` -> ``[B/(dq), (S,) D/q]`` with the table split as a SUMMA weight,
    ``[V/q (block j), D/q (block i)]``: every rank looks its grid's batch up in its vocabulary
    block (zeros elsewhere), a reduce-scatter over the row sums the vocabulary blocks and splits
    the batch (rank (i, j) gets batch block j, hidden block i) and the grid transpose swaps the
    two into the layout."""
    ids = summa.grid_batch(ids, grid)
    w = sum_grad_over(weight, grid.dep)
    start = grid.j * w.shape[0]
    mine = (ids >= start) & (ids < start + w.shape[0])
    local = torch.where(mine, ids - start, torch.zeros_like(ids))
    part = F.embedding(local, w).masked_fill(~mine.unsqueeze(-1), 0.0)
    part = comm.reduce_scatter_forward_all_gather_backward(part, grid.row, 0)
    return summa.grid_transpose(part, grid)


def classifier(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_classes: int, grid: SummaGrid
) -> torch.Tensor:
    """``[b/(dq), (s,) h/q]`` -> logits ``[b/(dq), (s,) C]`` (all classes, equal along the row):
    the table ``[C/q (block i), h/q (block j)]`` is all-gathered over the column, each rank
    multiplies its hidden block, and the row all-reduces the partial logits."""
    table = comm.all_gather_forward_reduce_scatter_backward(sum_grad_over(weight, grid.dep), grid.col, 0)
    partial = x @ table[:num_classes].t()
    logits = comm.all_reduce_forward_copy_backward(partial, grid.row)  # what follows is replicated
    if bias is not None:
        logits = logits + sum_grad_over(bias, *grid.weight_replicas)
    return logits


def mask_padded_classes(logits: torch.Tensor, num_classes: int, grid: SummaGrid) -> torch.Tensor:
    """Class-split logits ``[..., C/q]`` (block j) with padded classes at the dtype's lowest value."""
    _, valid = local_range(num_classes, grid.q, grid.j)
    if valid == logits.shape[-1]:
        return logits
    padded = torch.arange(logits.shape[-1], device=logits.device) >= valid
    return logits.masked_fill(padded, torch.finfo(logits.dtype).min)


def mean_over_batch(local_sum: torch.Tensor, local_count: torch.Tensor, grid: SummaGrid) -> torch.Tensor:
    """Sum of per-token losses and count of counted tokens of this batch block -> the mean over
    the tensor group's batch, equal on every rank (each rank backpropagates its own copy)."""
    count = local_count.to(local_sum.dtype)
    for group in grid.batch_groups:
        local_sum = comm.all_reduce_forward_copy_backward(local_sum, group)
        count = comm.all_reduce(count, group)
    return local_sum / count


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, grid: SummaGrid) -> torch.Tensor:
    """Mean CE of ``[b/(dq), (s,) C]`` (all classes) against full ``targets [B, (S)]``."""
    t = summa.batch_block(targets, grid, pad_value=ignore_index).flatten()
    flat = logits.flatten(0, -2)
    if flat.shape[0] != t.shape[0]:
        raise ValueError(f"cross entropy: logits {tuple(logits.shape)} do not match this rank's targets")
    local = F.cross_entropy(flat, t, ignore_index=ignore_index, reduction="sum")
    return mean_over_batch(local, (t != ignore_index).sum(), grid)


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, num_classes: int, group: AxisGroup
) -> torch.Tensor:
    """Per-token CE ``[N]`` of ``logits [N, C/P]`` (block ``group.rank`` of ``num_classes``
    classes split along ``group``, padding ignored) against ``targets [N]``; equal on ``group``."""
    start, valid = local_range(num_classes, group.size, group.rank)
    if logits.shape[-1] != round_up(num_classes, group.size) // group.size:
        raise ValueError(
            f"vocab-parallel cross entropy: {logits.shape[-1]} local classes do not fit {num_classes} "
            f"classes split {group.size} ways"
        )
    return class_parallel_cross_entropy(logits, targets, (group,), start, valid)


def vocab_parallel_loss(
    logits: torch.Tensor, targets: torch.Tensor, num_classes: int, ignore_index: int, grid: SummaGrid
) -> torch.Tensor:
    """Mean CE of ``[b/(dq), (s,) C/q]`` (classes split along the row) against full targets."""
    t = summa.batch_block(targets, grid, pad_value=ignore_index).flatten()
    losses = vocab_parallel_cross_entropy(logits.flatten(0, -2), t, num_classes, grid.row)
    kept = t != ignore_index
    return mean_over_batch(torch.where(kept, losses, torch.zeros_like(losses)).sum(), kept.sum(), grid)


def patch_embedding(
    images: torch.Tensor, params: Sequence[torch.Tensor], patch_size: int, grid: SummaGrid
) -> torch.Tensor:
    """Full images ``[B, c, H, W]`` -> ``[B/(dq), 1 + N, E/q]``: conv, class token and position
    embedding of this rank's embedding channels (block j) on its batch block."""
    weight, bias, cls_token, pos_embed = (sum_grad_over(p, *grid.weight_replicas) for p in params)
    x = F.conv2d(summa.batch_block(images, grid), weight, bias, stride=patch_size).flatten(2).transpose(1, 2)
    return torch.cat([cls_token.expand(x.shape[0], -1, -1), x], dim=1) + pos_embed


# ---- layers ----------------------------------------------------------------------------------


class _GridLayer(nn.Module):
    """A layer on a SUMMA grid; ``grid_of`` picks the mode's grid (2D here, 2.5D in tp2p5d)."""

    grid_of: ClassVar[GridOf] = staticmethod(grid_2d)

    def __init__(self, ctx: ParallelContext | None) -> None:
        super().__init__()
        self.ctx = _context(ctx)
        self.grid = type(self).grid_of(self.ctx)


class Linear2D(_GridLayer):
    """``y = x W^T + b``: ``[b/q, (s,) in/q]`` -> ``[b/q, (s,) out/q]`` by SUMMA; ``weight``
    ``[out, in]`` keeps block ``(j, i)``, ``bias [out]`` block ``j``. With ``out_groups`` fused
    outputs the local output is this rank's block of each part, side by side."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        out_groups: int = 1,
        ctx: ParallelContext | None = None,
    ) -> None:
        super().__init__(ctx)
        self.in_features, self.out_features, self.out_groups = in_features, out_features, out_groups
        full = torch.empty(out_features, in_features)
        nn.init.kaiming_uniform_(full, a=math.sqrt(5))  # as torch.nn.Linear
        self.weight = shard_parameter(
            full, summa_weight_spec(self.grid, out_features, in_features, out_groups), self.ctx
        )
        self.bias: nn.Parameter | None = None
        if bias:
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0.0
            full_bias = torch.empty(out_features).uniform_(-bound, bound)
            self.bias = shard_parameter(full_bias, hidden_spec(self.grid, (out_features,), out_groups), self.ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_hidden(x, self.in_features, self.grid, type(self).__name__)
        return linear(x, self.weight, self.bias, self.grid)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"out_groups={self.out_groups}"
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
        ctx: ParallelContext | None = None,
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
        _check_hidden(x, self.hidden, self.grid, type(self).__name__)
        return layer_norm(x, self.weight, self.bias, self.hidden, self.eps, self.grid)

    def extra_repr(self) -> str:
        return f"{self.hidden}, eps={self.eps}, bias={self.bias is not None}"


class Embedding2D(_GridLayer):
    """Full ids ``[B, (S)]`` -> ``[B/q, (S,) D/q]``. The table ``[V, D]`` is stored 1/q^2 per rank
    (rows block i, hidden block j) and all-gathered over ``2d_col`` (the whole vocabulary of
    hidden block j) for the lookup."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, ctx: ParallelContext | None = None) -> None:
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

    def __init__(self, num_embeddings: int, embedding_dim: int, *, ctx: ParallelContext | None = None) -> None:
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
        ctx: ParallelContext | None = None,
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
        _check_hidden(x, self.in_features, self.grid, type(self).__name__)
        return classifier(x, self.weight, self.bias, self.num_classes, self.grid)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, num_classes={self.num_classes}, bias={self.bias is not None}"


class VocabParallelClassifier2D(Linear2D):
    """``[b/q, (s,) h/q]`` -> logits ``[b/q, (s,) C/q]`` split over the classes as the hidden
    dimension is: a :class:`Linear2D` (``weight [C, h]`` may be a
    :class:`VocabParallelEmbedding2D`'s, tied). Padded classes get the dtype's lowest logit, so a
    softmax or :class:`VocabParallelCrossEntropyLoss2D` gives them no probability or gradient."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        bias: bool = False,
        *,
        weight: nn.Parameter | None = None,
        ctx: ParallelContext | None = None,
    ) -> None:
        super().__init__(in_features, num_classes, bias, ctx=ctx)
        self.num_classes = num_classes
        if weight is not None:
            expected = summa_weight_spec(self.grid, num_classes, in_features)
            self.weight = check_tied(weight, expected, type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mask_padded_classes(super().forward(x), self.num_classes, self.grid)


class PatchEmbedding2D(_GridLayer):
    """ViT patch embedding (as ``tessera.nn.plain.PatchEmbedding``): full images ``[B, c, H, W]``
    -> ``[B/q, 1 + N, E/q]``. Every parameter keeps embedding block j (replicated over
    ``2d_col``; their gradients are summed over it)."""

    def __init__(
        self, img_size: int, patch_size: int, in_chans: int, embed_size: int, *, ctx: ParallelContext | None = None
    ) -> None:
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

    def __init__(self, p: float = 0.5, *, ctx: ParallelContext | None = None) -> None:
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

    def __init__(self, *, ignore_index: int = -100, ctx: ParallelContext | None = None) -> None:
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

    def __init__(
        self, *, num_classes: int | None = None, ignore_index: int = -100, ctx: ParallelContext | None = None
    ) -> None:
        super().__init__(ctx)
        self.num_classes, self.ignore_index = num_classes, ignore_index

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        num_classes = self.num_classes if self.num_classes is not None else logits.shape[-1] * self.grid.q
        return vocab_parallel_loss(logits, targets, num_classes, self.ignore_index, self.grid)


# ---- boundary helpers ------------------------------------------------------------------------


def split_activation(x_full: torch.Tensor, ctx: ParallelContext | None = None) -> torch.Tensor:
    """Full ``[B, (S,) H]`` -> this rank's ``[B/q (block i), (S,) H/q (block j)]``, zero-padded;
    backward all-gathers the gradient."""
    return summa.split_activation(x_full, grid_2d(_context(ctx)))


def gather_activation(
    x_local: torch.Tensor, ctx: ParallelContext | None = None, full_shape: Any = None
) -> torch.Tensor:
    """Every rank's block -> the full activation on every rank; ``full_shape`` (the unpadded
    shape, or at least its batch and last sizes) drops the padding."""
    return summa.gather_activation(x_local, grid_2d(_context(ctx)), full_shape)


def hidden_parts(ctx: ParallelContext | None = None) -> int:
    """Into how many blocks the hidden dimension is split: q."""
    return grid_2d(_context(ctx)).q


def batch_parts(ctx: ParallelContext | None = None) -> int:
    """Into how many blocks the batch is split: q."""
    return grid_2d(_context(ctx)).batch_parts
