"""1D (Megatron) tensor parallelism over the ``tensor`` axis of P ranks.

Layout. Activations ``[batch, seq, hidden]`` are full (replicated) on every rank of the tensor
group, so ``hidden_parts(ctx) == 1``. Only the weights are split: a column-parallel linear
(``Linear1D_Col``) keeps ``out/P`` output rows and returns ``[..., out/P]``; a row-parallel one
(``Linear1D_Row``) keeps ``in/P`` input columns, takes ``[..., in/P]`` and all-reduces its output.
A Col -> Row pair (an MLP, or attention with its heads split) costs one all-reduce of the
activations forward and one backward.

Sequence parallelism (Megatron-3, ``sequence_parallel=True``). Outside the Col -> Row region
the activations are split along the sequence, ``[batch, seq/P, hidden]`` (``seq`` must be a
multiple of P). Col all-gathers the sequence before its matmul (reduce-scatter backward) and Row
reduce-scatters its output along the sequence instead of all-reducing it (all-gather backward):
the same bytes as the all-reduce pair, with 1/P of the activation memory outside the region.
Replicated parameters applied to sequence parts (LayerNorm, Row's bias) all-reduce their
gradients over ``tensor`` in backward, so ``param.grad`` is the full gradient on every rank.

Uneven sizes are zero-padded per ``ShardSpec`` (``common.py``); padded outputs stay zero, padded
inputs are cut off before the matmul, so padded parameter entries get zero gradients.

Gradient convention: a replicated tensor carries the full gradient on every rank (every rank
computes the same loss); a split tensor carries the gradient of its part.

This module is the functional core (plain functions taking the tensor group or the context);
the ``nn.Module`` layers are in :mod:`tessera.parallel.tensor.tp1d.layers`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tessera import comm
from tessera.comm import AxisGroup
from tessera.context import ParallelContext
from tessera.parallel.tensor.common import class_parallel_cross_entropy, local_range, round_up

TENSOR = "tensor"
SEQ_DIM = 1  # the sequence dimension of [batch, seq, hidden] activations

__all__ = [
    "batch_parts",
    "column_parallel_linear",
    "gather_activation",
    "gather_last_dim",
    "hidden_parts",
    "row_parallel_linear",
    "split_activation",
    "split_last_dim",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embedding",
]


# ---- functional core -----------------------------------------------------------------------


def _check_sequence_split(x: torch.Tensor, parts: int, what: str) -> None:
    if x.dim() < 3:
        raise ValueError(
            f"{what}: sequence parallelism needs [batch, seq, ...] activations, got shape {tuple(x.shape)}"
        )
    if x.shape[SEQ_DIM] % parts != 0:
        raise ValueError(
            f"{what}: sequence length {x.shape[SEQ_DIM]} is not divisible by the tensor-parallel size "
            f"{parts}; sequence parallelism needs seq % P == 0"
        )


def gather_last_dim(x_local: torch.Tensor, group: AxisGroup, full_size: int, groups: int = 1) -> torch.Tensor:
    """``[..., groups * L]`` (this rank's block of each of ``groups`` fused parts) ->
    ``[..., full_size]`` on every rank, padding dropped. Backward keeps this rank's block."""
    per_part = full_size // groups
    parts = x_local.unflatten(-1, (groups, x_local.shape[-1] // groups))
    gathered = comm.gather_forward_split_backward(parts, group, dim=-1)
    if gathered.shape[-1] != per_part:
        gathered = gathered.narrow(-1, 0, per_part)
    return gathered.flatten(-2)


def split_last_dim(x_full: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """``[..., n]`` replicated -> this rank's block ``[..., ceil(n/P)]`` (zero-padded); backward
    all-gathers the gradient so the replicated input gets its full gradient."""
    padded = round_up(x_full.shape[-1], group.size)
    if padded != x_full.shape[-1]:
        x_full = F.pad(x_full, (0, padded - x_full.shape[-1]))
    return comm.split_forward_gather_backward(x_full, group, dim=-1)


def column_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: AxisGroup,
    *,
    sequence_parallel: bool = False,
    adapter: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``x [..., in]`` (replicated; with ``sequence_parallel`` ``[b, s/P, in]``) times this rank's
    rows ``weight [out/P, in]`` -> ``[..., out/P]`` (``[b, s, out/P]``).

    Backward all-reduces the input gradient (sequence parallel: reduce-scatters it along seq).
    ``adapter``: a further product of the input inside the region (its whole sequence), with
    this rank's ``out/P`` outputs, added to the output: its input gradient is summed with the
    base's (a LoRA adapter's, ``tessera.lora``).
    """
    if sequence_parallel:
        _check_sequence_split(x, 1, "Linear1D_Col")
        x = comm.all_gather_forward_reduce_scatter_backward(x, group, dim=SEQ_DIM)
    else:
        x = comm.copy_forward_all_reduce_backward(x, group)
    y = F.linear(x, weight, bias)
    return y if adapter is None else y + adapter(x)


def row_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: AxisGroup,
    *,
    valid_in: int | None = None,
    sequence_parallel: bool = False,
    adapter: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``x [..., in/P]`` times this rank's columns ``weight [out, in/P]``, summed over the group ->
    ``[..., out]`` replicated (with ``sequence_parallel`` reduce-scattered to ``[b, s/P, out]``).

    ``valid_in``: the unpadded columns of this rank's block; padded ones are cut off, so whatever
    the input holds there, the padded weight columns get no gradient. ``bias`` (replicated) is
    added after the reduction. ``adapter``: a further partial product of the (unpadded) input,
    added before the sum so that one collective sums both (a LoRA adapter's, ``tessera.lora``).
    """
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"row-parallel linear: input has {x.shape[-1]} features, the local weight {weight.shape[1]}")
    if sequence_parallel:
        _check_sequence_split(x, group.size, "Linear1D_Row")
    if valid_in is not None and valid_in < weight.shape[1]:
        x, weight = x.narrow(-1, 0, valid_in), weight.narrow(1, 0, valid_in)
    partial = F.linear(x, weight)
    if adapter is not None:
        partial = partial + adapter(x)
    if sequence_parallel:
        y = comm.reduce_scatter_forward_all_gather_backward(partial, group, dim=SEQ_DIM)
        if bias is not None:  # each rank adds it to its sequence part only: sum its gradient
            bias = comm.copy_forward_all_reduce_backward(bias, group)
    else:
        y = comm.all_reduce_forward_copy_backward(partial, group)
    return y if bias is None else y + bias


def vocab_parallel_embedding(
    ids: torch.Tensor,
    weight: torch.Tensor,
    group: AxisGroup,
    vocab_start: int,
    padding_idx: int | None = None,
) -> torch.Tensor:
    """Look ``ids [...]`` (full vocabulary indices) up in this rank's rows ``weight [V/P, D]``
    starting at ``vocab_start``; ids of other ranks give zeros; all-reduce -> ``[..., D]``.
    ``padding_idx`` is a full vocabulary index (its row gets no gradient on the rank holding it)."""
    rows = weight.shape[0]
    local_pad = padding_idx - vocab_start if padding_idx is not None and 0 <= padding_idx - vocab_start < rows else None
    if group.size == 1:
        return F.embedding(ids, weight, local_pad)
    mine = (ids >= vocab_start) & (ids < vocab_start + rows)
    local = torch.where(mine, ids - vocab_start, torch.zeros_like(ids))
    out = F.embedding(local, weight, local_pad).masked_fill(~mine.unsqueeze(-1), 0.0)
    return comm.all_reduce_forward_copy_backward(out, group)


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    group: AxisGroup,
    num_classes: int,
) -> torch.Tensor:
    """Per-token cross entropy ``[N]`` of ``logits [N, C_local]`` (this rank's block of the
    ``num_classes`` classes, padded ones ignored) against full ``targets [N]``; equal on every rank."""
    start, valid = local_range(num_classes, group.size, group.rank)
    if logits.shape[-1] != round_up(num_classes, group.size) // group.size:
        raise ValueError(
            f"vocab-parallel cross entropy: {logits.shape[-1]} local classes do not fit {num_classes} "
            f"classes split {group.size} ways"
        )
    return class_parallel_cross_entropy(logits, targets, (group,), start, valid)


# ---- boundary helpers ----------------------------------------------------------------------


def hidden_parts(ctx: ParallelContext) -> int:
    """How many parts the hidden dimension of an activation is split into: 1 (it is whole)."""
    return 1


def batch_parts(ctx: ParallelContext) -> int:
    """How many parts the batch is split into: 1 (it is whole)."""
    return 1


def split_activation(x_full: torch.Tensor, ctx: ParallelContext, *, sequence_parallel: bool = False) -> torch.Tensor:
    """The 1D layout of a full ``[b, s, h]`` activation: itself, or with ``sequence_parallel`` this
    rank's ``[b, s/P, h]`` (backward all-gathers the gradient)."""
    if not sequence_parallel:
        return x_full
    group = ctx.group(TENSOR)
    _check_sequence_split(x_full, group.size, "split_activation")
    return comm.split_forward_gather_backward(x_full, group, dim=SEQ_DIM)


def gather_activation(x_local: torch.Tensor, ctx: ParallelContext, *, sequence_parallel: bool = False) -> torch.Tensor:
    """The full ``[b, s, h]`` activation from the 1D layout (inverse of :func:`split_activation`)."""
    if not sequence_parallel:
        return x_local
    return comm.gather_forward_split_backward(x_local, ctx.group(TENSOR), dim=SEQ_DIM)
