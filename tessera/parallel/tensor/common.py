"""Building blocks shared by every tensor-parallel mode: how a full tensor maps onto shards.

A :class:`ShardSpec` says, for each dimension of a parameter (or activation), which mesh axes
split it. A dimension split by axes ``(a, b)`` is cut into ``size(a) * size(b)`` equal blocks
(after zero-padding it to a multiple of that count, or of ``pad_to[d]`` where given), and the
rank holds block ``index(a) * size(b) + index(b)``. A dimension may hold ``groups`` fused parts
(the q, k and v projections of attention, say): each part is padded and split on its own, so
every rank holds its block of every part, side by side.

Parameters made by :func:`shard_parameter` carry their spec (``param.tessera_shard``) and the
axes that split them (``param.tessera_sharded_along``), which is all that
``tessera.checkpoint.full_state_dict`` and the global gradient norm need.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tessera import comm
from tessera.comm import AxisGroup
from tessera.context import ParallelContext


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator / denominator``, which must be exact."""
    if numerator % denominator != 0:
        raise ValueError(f"{what}: {numerator} is not divisible by {denominator}")
    return numerator // denominator


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class ShardSpec:
    """How a tensor of ``full_shape`` is split: ``dims[d]`` are the axes splitting dimension ``d``
    (outermost first; empty: not split), ``groups[d]`` the fused parts of dimension ``d``, and
    ``pad_to[d]`` (0: the number of parts) the multiple each part of a split dimension is
    zero-padded to; it must be a multiple of the number of parts (3D pads a dimension split q
    ways to a multiple of q^2, so that its blocks are unions of another dimension's q^2 blocks)."""

    full_shape: tuple[int, ...]
    dims: tuple[tuple[str, ...], ...]
    groups: tuple[int, ...] = ()
    pad_to: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.dims) != len(self.full_shape):
            raise ValueError(f"ShardSpec: {len(self.dims)} dim entries for shape {self.full_shape}")
        if not self.groups:
            object.__setattr__(self, "groups", (1,) * len(self.full_shape))
        if not self.pad_to:
            object.__setattr__(self, "pad_to", (0,) * len(self.full_shape))
        for size, g in zip(self.full_shape, self.groups, strict=True):
            divide(size, g, "ShardSpec: fused parts of a dimension")
        if len(self.pad_to) != len(self.full_shape):
            raise ValueError(f"ShardSpec: {len(self.pad_to)} pad_to entries for shape {self.full_shape}")
        for axes, multiple in zip(self.dims, self.pad_to, strict=True):
            if multiple < 0 or (multiple and not axes):
                raise ValueError(f"ShardSpec: pad_to {self.pad_to} must be >= 0, and 0 on dimensions not split")

    @property
    def axes(self) -> tuple[str, ...]:
        """Every axis that splits some dimension."""
        return tuple(dict.fromkeys(a for axes in self.dims for a in axes))

    def parts(self, dim: int, ctx: ParallelContext) -> int:
        return math.prod(ctx.size(a) for a in self.dims[dim])

    def index(self, dim: int, ctx: ParallelContext) -> int:
        index = 0
        for axis in self.dims[dim]:
            index = index * ctx.size(axis) + ctx.local_rank(axis)
        return index

    def multiple(self, dim: int, ctx: ParallelContext) -> int:
        """What each part of dimension ``dim`` is padded to a multiple of."""
        parts = self.parts(dim, ctx)
        multiple = self.pad_to[dim] or parts
        divide(multiple, parts, f"ShardSpec: pad_to of dimension {dim}")
        return multiple

    def padded_size(self, dim: int, ctx: ParallelContext) -> int:
        per_group = self.full_shape[dim] // self.groups[dim]
        return self.groups[dim] * round_up(per_group, self.multiple(dim, ctx))

    def local_shape(self, ctx: ParallelContext) -> tuple[int, ...]:
        return tuple(self.padded_size(d, ctx) // self.parts(d, ctx) for d in range(len(self.full_shape)))


def local_shard(full: torch.Tensor, spec: ShardSpec, ctx: ParallelContext) -> torch.Tensor:
    """This rank's block of ``full`` (zero-padded where a dimension does not divide)."""
    if tuple(full.shape) != spec.full_shape:
        raise ValueError(f"tensor of shape {tuple(full.shape)} does not match its spec {spec.full_shape}")
    out = full
    for dim, axes in enumerate(spec.dims):
        if not axes:
            continue
        parts, index, groups = spec.parts(dim, ctx), spec.index(dim, ctx), spec.groups[dim]
        per_group = out.shape[dim] // groups
        padded = round_up(per_group, spec.multiple(dim, ctx))
        grouped = out.unflatten(dim, (groups, per_group))
        if padded != per_group:
            pad_shape = list(grouped.shape)
            pad_shape[dim + 1] = padded - per_group
            grouped = torch.cat([grouped, grouped.new_zeros(pad_shape)], dim=dim + 1)
        block = padded // parts
        out = grouped.narrow(dim + 1, index * block, block).flatten(dim, dim + 1)
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
    param.tessera_shard = spec  # type: ignore[attr-defined]
    param.tessera_sharded_along = spec.axes  # type: ignore[attr-defined]
    return param


def sharded_zeros_like_spec(spec: ShardSpec, ctx: ParallelContext, dtype: torch.dtype | None = None) -> nn.Parameter:
    """An all-zero sharded parameter (biases)."""
    return shard_parameter(torch.zeros(spec.full_shape, dtype=dtype), spec, ctx)


def spec_of(tensor: torch.Tensor) -> ShardSpec | None:
    return getattr(tensor, "tessera_shard", None)


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
