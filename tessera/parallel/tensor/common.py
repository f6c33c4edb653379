"""Building blocks shared by every tensor-parallel mode: how a full tensor maps onto shards.

A :class:`~tessera.context.placement.ShardSpec` says, for each dimension of a parameter (or activation), which mesh axes
split it. A dimension split by axes ``(a, b)`` is cut into ``size(a) * size(b)`` equal blocks
(after zero-padding it to a multiple of that count, or of ``pad_to[d]`` where given), and the
rank holds block ``index(a) * size(b) + index(b)``. A dimension may hold ``groups`` fused parts
(the q, k and v projections of attention, say): each part is padded and split on its own, so
every rank holds its block of every part, side by side.

Parameters made by :func:`shard_parameter` record their spec and the context that split them in
their placement (``tessera.context.placement``), which is all that
``tessera.checkpoint.full_state_dict`` and the global gradient norm need.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tessera import comm
from tessera.comm import AxisGroup
from tessera.context import ParallelContext
from tessera.context.placement import Placement, ShardSpec, placement_of, round_up, set_placement
from tessera.context.placement import divide as divide  # re-exported for the modes


def local_shard(full: torch.Tensor, spec: ShardSpec, ctx: ParallelContext) -> torch.Tensor:
    """This rank's block of ``full`` (zero-padded where a dimension does not divide). Only the
    block is copied: the padded full tensor is never made."""
    if tuple(full.shape) != spec.full_shape:
        raise ValueError(f"tensor of shape {tuple(full.shape)} does not match its spec {spec.full_shape}")
    out = full
    for dim, axes in enumerate(spec.dims):
        if not axes:
            continue
        parts, index, groups = spec.parts(dim, ctx), spec.index(dim, ctx), spec.groups[dim]
        per_group = out.shape[dim] // groups
        block = round_up(per_group, spec.multiple(dim, ctx)) // parts
        start = min(index * block, per_group)
        valid = max(0, min(block, per_group - start))
        piece = out.unflatten(dim, (groups, per_group)).narrow(dim + 1, start, valid)
        if valid < block:
            pad_shape = list(piece.shape)
            pad_shape[dim + 1] = block - valid
            piece = torch.cat([piece, piece.new_zeros(pad_shape)], dim=dim + 1)
        out = piece.flatten(dim, dim + 1)
    if out.untyped_storage()._cdata == full.untyped_storage()._cdata:  # a view (rows of the first dim):
        return out.clone(memory_format=torch.contiguous_format)  # a parameter must not keep the full tensor alive
    return out.contiguous()


def gather_full(local: torch.Tensor, spec: ShardSpec, ctx: ParallelContext) -> torch.Tensor:
    """The full tensor from every rank's block (collective over the spec's axes), unpadded."""
    out = local
    for dim, axes in enumerate(spec.dims):
        if not axes:
            continue
        groups = spec.groups[dim]
        grouped = out.unflatten(dim, (groups, out.shape[dim] // groups))
        for axis in reversed(axes):  # innermost first: blocks of an outer axis hold inner ones
            grouped = comm.all_gather(grouped, ctx.group(axis), dim=dim + 1)
        per_group = spec.full_shape[dim] // groups
        out = grouped.narrow(dim + 1, 0, per_group).flatten(dim, dim + 1)
    return out


def shard_parameter(full: torch.Tensor, spec: ShardSpec, ctx: ParallelContext) -> nn.Parameter:
    """A parameter holding this rank's block of ``full``, tagged with its spec."""
    param = nn.Parameter(local_shard(full.detach(), spec, ctx))
    set_placement(param, Placement(shard=spec, mesh=ctx))
    return param


def sharded_zeros_like_spec(spec: ShardSpec, ctx: ParallelContext, dtype: torch.dtype | None = None) -> nn.Parameter:
    """An all-zero sharded parameter (biases)."""
    return shard_parameter(torch.zeros(spec.full_shape, dtype=dtype), spec, ctx)


def spec_of(tensor: torch.Tensor) -> ShardSpec | None:
    """How ``tensor`` is split by tensor parallelism (None: held whole)."""
    return placement_of(tensor).shard


def axis_sizes(ctx: ParallelContext, axes: Sequence[str]) -> int:
    return math.prod(ctx.size(a) for a in axes)


def local_range(full: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, valid)``: block ``index`` of a size-``full`` dimension zero-padded to a multiple of
    ``parts`` starts at ``start`` and holds ``valid`` real (unpadded) entries."""
    block = round_up(full, parts) // parts
    start = index * block
    return start, max(0, min(block, full - start))


def check_tied(weight: nn.Parameter, expected: ShardSpec, owner: str) -> nn.Parameter:
    """``weight`` (a parameter shared with another layer) if it is split as ``expected``."""
    spec = spec_of(weight)
    if spec != expected:
        raise ValueError(f"{owner}: the tied weight has spec {spec}, expected {expected}")
    return weight


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token CE of logits holding classes ``[start, start + valid)`` of a class dimension split
    over ``groups``: the max, then the sum of exps and the target logit are all-reduced over them;
    the backward is local (``softmax - one_hot`` of this block)."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, groups: tuple[AxisGroup, ...], start: int, valid: int
    ) -> torch.Tensor:
        x = logits.float()
        real = torch.arange(x.shape[-1], device=x.device) < valid  # False on padded classes
        top = x.masked_fill(~real, float("-inf")).amax(dim=-1)
        for group in groups:
            comm.all_reduce(top, group, op="max")
        shifted = x - top.unsqueeze(-1)
        exp = shifted.exp().masked_fill(~real, 0.0)
        local = targets - start
        has_target = (local >= 0) & (local < valid)
        index = torch.where(has_target, local, torch.zeros_like(local))
        target_logit = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1).masked_fill(~has_target, 0.0)
        sums = torch.stack([exp.sum(dim=-1), target_logit])  # one all-reduce for both
        for group in groups:
            comm.all_reduce(sums, group)
        ctx.save_for_backward(exp.div_(sums[0].unsqueeze(-1)), index, has_target)
        ctx.logits_dtype = logits.dtype
        return sums[0].log() - sums[1]

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        softmax, index, has_target = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, index.unsqueeze(-1), -has_target.to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def class_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, groups: Sequence[AxisGroup], start: int, valid: int
) -> torch.Tensor:
    """Per-token cross entropy ``[N]`` of ``logits [N, C_local]`` (classes ``[start, start + valid)``
    of a class dimension split over ``groups``; padded classes ignored) against full ``targets [N]``.
    Every vocabulary-parallel loss of every mode is this."""
    loss: torch.Tensor = _VocabParallelCrossEntropy.apply(logits, targets, tuple(groups), start, valid)
    return loss


def pad_dim(x: torch.Tensor, dim: int, multiple: int, value: float = 0.0) -> torch.Tensor:
    """``x`` with dimension ``dim`` padded at the end with ``value`` to a multiple of ``multiple``."""
    dim = dim % x.dim()
    extra = round_up(x.shape[dim], multiple) - x.shape[dim]
    if extra == 0:
        return x
    pad = [0, 0] * (x.dim() - dim - 1) + [0, extra]
    return F.pad(x, pad, value=value)


def sum_grad_over(x: torch.Tensor, *groups: AxisGroup | None) -> torch.Tensor:
    """Identity forward; the gradient all-reduced over each group. For a tensor replicated over
    those groups whose members each compute a share of its gradient (other batch blocks)."""
    for group in groups:
        if group is not None:
            x = comm.copy_forward_all_reduce_backward(x, group)
    return x


def all_reduce_forward_backward(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Sum over ``group`` forward and backward: for a statistic (a row sum of a split hidden
    dimension) that every member then uses on its own block."""
    return comm.copy_forward_all_reduce_backward(comm.all_reduce_forward_copy_backward(x, group), group)
