"""2D (SUMMA / Optimus) tensor parallelism on a q x q grid of the tensor group.

Rank ``(i, j)`` (tensor index ``i*q + j``): ``i = ctx.local_rank("2d_col")`` is its grid row,
``j = ctx.local_rank("2d_row")`` its grid column.

Layout. An activation ``[b, (s,) h]`` is held as the block ``[b/q (block i), (s,) h/q (block j)]``;
batch and hidden are zero-padded to multiples of q (the batch padding rows carry no loss and are
dropped by :func:`gather_activation`; the hidden padding units stay zero in every layer).

Parameters (torch layouts; a ``ShardSpec`` lists the axes splitting each dimension):

* ``Linear.weight [out, in]``, in one of two SUMMA forms chosen per layer when it is built
  (:func:`linear_form`): ``"ab"``, ``Y = X W^T`` as ``C = A B`` with ``B = W^T`` (rank (i, j) holds
  ``W[out block j, in block i]``: out by ``2d_row``, in by ``2d_col``; the output stays and ``X``
  and ``W`` move) or ``"abt"``, as ``C = A B^T`` with ``B = W`` (rank (i, j) holds
  ``W[out block i, in block j]``: out by ``2d_col``, in by ``2d_row``; the input stays and ``Y``
  and ``W`` move). Either way the tensor is the single-process ``[out, in]`` cut into blocks, so
  full state dicts do not change.
* ``Linear.bias``, ``LayerNorm`` and ``PatchEmbedding`` parameters: their embedding dimension by
  ``2d_row``, replicated over ``2d_col`` (gradients summed over it: its ranks see other batch rows).
* ``Embedding`` / ``Classifier`` tables ``[V, h]``: rows by ``2d_col``, hidden by ``2d_row`` (1/q^2
  per rank), all-gathered over ``2d_col`` for use and the gradient reduce-scattered back.
  ``Classifier.bias`` is replicated.
* ``VocabParallelEmbedding`` / ``VocabParallelClassifier`` ``[V, h]``: as ``Linear.weight``, so the
  head can be tied to the embedding; the head is a SUMMA linear.

Linear cost: with ``X`` this rank's input block ``[b/q * s, in/q]``, ``Y`` its output block
``[b/q * s, out/q]``, ``W`` its weight block ``[out/q, in/q]`` and ``|.|`` bytes, forward and
backward move per rank (``summa.py`` has the steps)

=================  =========================================  =========================================
form, keep_blocks  ``2d_row``                                 ``2d_col``
=================  =========================================  =========================================
ab, off (Optimus)  broadcast 2 (q-1) |X|, reduce (q-1) |X|    broadcast 2 (q-1) |W|, reduce (q-1) |W|
ab, on             broadcast (q-1) |X|, reduce (q-1) |X|      broadcast (q-1) |W|, reduce (q-1) |W|
abt, off           reduce (q-1) |Y|, broadcast (q-1) |Y|      broadcast 2 (q-1) |W|, reduce (q-1) |W|
abt, on            reduce (q-1) |Y|, broadcast (q-1) |Y|      broadcast (q-1) |W|, reduce (q-1) |W|
=================  =========================================  =========================================

plus the all-reduce ``2 (q-1)/q |bias|`` of the bias gradient over ``2d_col`` (the batch blocks).
So "ab" costs ``3 (q-1) (|X| + |W|)`` and "abt" ``(q-1) (2 |Y| + 3 |W|)`` (with ``keep_blocks``
``2 (q-1) (|X| + |W|)`` and ``2 (q-1) (|Y| + |W|)``): the weight term is the same in both, so
the form is chosen from ``in`` and ``out`` alone, whatever the batch (:func:`linear_form`).

The functions here and the layers (:mod:`tessera.parallel.tensor.tp2d.layers`) are written
against a :class:`~tessera.parallel.tensor.grid.SummaGrid`, so 2.5D (``tp2p5d/``) reuses them
with its own grid (``grid_of``): one code path for both modes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from tessera import comm
from tessera.amp import autocast_operands
from tessera.comm import AxisGroup
from tessera.context import ParallelContext
from tessera.parallel.tensor import summa
from tessera.parallel.tensor.common import (
    ShardSpec,
    all_reduce_forward_backward,
    class_parallel_cross_entropy,
    local_range,
    round_up,
    sum_grad_over,
)
from tessera.parallel.tensor.grid import SummaGrid

__all__ = [
    "batch_parts",
    "check_hidden",
    "classifier",
    "cross_entropy",
    "embedding",
    "gather_activation",
    "grid_2d",
    "hidden_parts",
    "hidden_spec",
    "layer_norm",
    "linear",
    "linear_form",
    "mask_padded_classes",
    "mean_over_batch",
    "patch_embedding",
    "split_activation",
    "summa_weight_spec",
    "table_spec",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embedding",
    "vocab_parallel_loss",
]


def grid_2d(ctx: ParallelContext) -> SummaGrid:
    """The q x q grid of a context in tensor mode ``2d``."""
    return SummaGrid.from_context(ctx, row="2d_row", col="2d_col")


# ---- functional core (any SUMMA grid) --------------------------------------------------------


FORMS = ("ab", "abt")


def summa_weight_spec(
    grid: SummaGrid, out_features: int, in_features: int, out_groups: int = 1, form: str = "ab"
) -> ShardSpec:
    """``[out, in]`` for SUMMA form ``form``: "ab" splits out along the grid row (block j) and in
    along the column (block i); "abt" the other way round."""
    if form not in FORMS:
        raise ValueError(f"SUMMA form {form!r} is not one of {FORMS}")
    dims = ((grid.row.name,), (grid.col.name,)) if form == "ab" else ((grid.col.name,), (grid.row.name,))
    return ShardSpec((out_features, in_features), dims, (out_groups, 1))


def linear_form(in_local: int, out_local: int) -> str:
    """The SUMMA form of a Linear whose blocks are ``in_local`` and ``out_local`` wide (padded,
    per rank): the wider side stays put, "abt" (the input stays) when ``out < in`` and "ab" (the
    output stays, Optimus) otherwise. Both forms move the weight alike, so the batch does not
    enter: with ``keep_blocks`` this is the form that moves fewer bytes; without it "abt"
    (``2 |Y|`` against ``3 |X|``, its backward sharing one broadcast) would also win for
    ``out < 1.5 in``, a margin this rule leaves, so that one rule serves both settings and a
    layer with ``out >= in`` keeps the Optimus form."""
    return "abt" if out_local < in_local else "ab"


def table_spec(grid: SummaGrid, rows: int, hidden: int) -> ShardSpec:
    """``[rows, hidden]`` with rows split along the grid column (block i), hidden along the row
    (block j): 1/q^2 per rank, all-gathered over the column for use."""
    return ShardSpec((rows, hidden), ((grid.col.name,), (grid.row.name,)))


def hidden_spec(grid: SummaGrid, shape: Sequence[int], groups: int = 1) -> ShardSpec:
    """Last dimension split as the activations' hidden dimension (block j); the rest whole."""
    dims = tuple((grid.row.name,) if d == len(shape) - 1 else () for d in range(len(shape)))
    return ShardSpec(tuple(shape), dims, (1,) * (len(shape) - 1) + (groups,))


def check_hidden(x: torch.Tensor, full: int, grid: SummaGrid, what: str) -> None:
    local = round_up(full, grid.q) // grid.q
    if x.shape[-1] != local:
        raise ValueError(
            f"{what}: input's last dimension is {x.shape[-1]}, expected this rank's block {local} of {full} "
            f"split {grid.q} ways (use split_activation on a full input)"
        )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    grid: SummaGrid,
    form: str = "ab",
    keep_blocks: bool = False,
) -> torch.Tensor:
    """``[b/(dq), (s,) in/q]`` -> ``[b/(dq), (s,) out/q]`` by SUMMA with ``A`` the input: ``C = A B``
    with ``B = W^T`` (form "ab": ``weight`` is this rank's ``[out/q (block j), in/q (block i)]``) or
    ``C = A B^T`` with ``B = W`` (form "abt": ``[out/q (block i), in/q (block j)]``).
    ``keep_blocks``: keep the blocks received in the forward for the backward."""
    w = sum_grad_over(weight, grid.dep)  # each grid computes its share of dW
    a, w = autocast_operands(x.reshape(-1, x.shape[-1]), w)  # SUMMA's products are out of autocast's sight
    if form == "ab":
        y = summa.matmul_ab(a, w.t(), grid.row, grid.col, keep=keep_blocks)
    else:
        y = summa.matmul_abt(a, w, grid.row, grid.col, keep=keep_blocks)
    y = y.view(*x.shape[:-1], y.shape[-1])
    if bias is not None:
        y = y + sum_grad_over(bias, *grid.weight_replicas).to(y.dtype)
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
        y = y + sum_grad_over(bias, *grid.weight_replicas).to(y.dtype)
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


# ---- boundary helpers ------------------------------------------------------------------------


def split_activation(x_full: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Full ``[B, (S,) H]`` -> this rank's ``[B/q (block i), (S,) H/q (block j)]``, zero-padded;
    backward all-gathers the gradient."""
    return summa.split_activation(x_full, grid_2d(ctx))


def gather_activation(x_local: torch.Tensor, ctx: ParallelContext, full_shape: Any = None) -> torch.Tensor:
    """Every rank's block -> the full activation on every rank; ``full_shape`` (the unpadded
    shape, or at least its batch and last sizes) drops the padding."""
    return summa.gather_activation(x_local, grid_2d(ctx), full_shape)


def hidden_parts(ctx: ParallelContext) -> int:
    """Into how many blocks the hidden dimension is split: q."""
    return grid_2d(ctx).q


def batch_parts(ctx: ParallelContext) -> int:
    """Into how many blocks the batch is split: q."""
    return grid_2d(ctx).batch_parts
