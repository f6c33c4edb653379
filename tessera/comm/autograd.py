"""Autograd wrappers around the collectives, each named by its forward/backward pair.

These are the building blocks of tensor and sequence parallelism: for example a column-parallel
linear layer copies its input into the tensor group (gradients are all-reduced on the way back)
and a row-parallel one all-reduces its output (gradients pass straight through).
"""

from __future__ import annotations

from typing import Any

import torch

from tessera.comm import ops
from tessera.comm.group import AxisGroup
from tessera.comm.ops import Group, resolve


def split_along(x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
    """This member's equal part of ``x`` along ``dim`` (no communication)."""
    if group.size == 1:
        return x
    if x.shape[dim] % group.size != 0:
        raise ValueError(
            f"cannot split dimension {dim} of shape {tuple(x.shape)} into {group.size} equal "
            f"parts for axis '{group.name}'; pad it first"
        )
    return x.chunk(group.size, dim=dim)[group.rank].contiguous()


class _CopyForwardAllReduceBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        ctx.group = group
        # Compiled code copies: an output that aliases an input (here often a weight, leaving a
        # graph before a graph break) is rebuilt as a plain view outside the compiled graph,
        # which would lose this backward's all-reduce.
        return x.clone() if torch.compiler.is_compiling() else x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ops.all_reduce(grad.clone(), ctx.group), None


class _AllReduceForwardCopyBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        return ops.all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _SplitForwardGatherBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return split_along(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ops.all_gather(grad, ctx.group, ctx.dim), None, None


class _GatherForwardSplitBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return ops.all_gather(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return split_along(grad, ctx.group, ctx.dim), None, None


class _AllGatherForwardReduceScatterBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return ops.all_gather(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ops.reduce_scatter(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterForwardAllGatherBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return ops.reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ops.all_gather(grad, ctx.group, ctx.dim), None, None


class _AllToAllForwardAllToAllBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return ops.all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return ops.all_to_all(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


class _BroadcastForwardReduceBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup, src: int) -> torch.Tensor:
        ctx.group, ctx.src = group, src
        return ops.broadcast(x.clone(), group, src)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        summed = ops.reduce(grad.clone(), ctx.group, ctx.src)
        # Only the source's input fed every member's output; the others get no gradient.
        return (summed if ctx.group.rank == ctx.src else torch.zeros_like(grad)), None, None


def copy_forward_all_reduce_backward(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (enters a tensor-parallel region)."""
    g = resolve(group)
    return x if g.size == 1 else _CopyForwardAllReduceBackward.apply(x, g)


def all_reduce_forward_copy_backward(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-reduce (sum) forward; identity backward (leaves a tensor-parallel region)."""
    g = resolve(group)
    return x if g.size == 1 else _AllReduceForwardCopyBackward.apply(x, g)


def split_forward_gather_backward(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Keep this member's part along ``dim`` forward; all-gather the gradient backward."""
    g = resolve(group)
    return x if g.size == 1 else _SplitForwardGatherBackward.apply(x, g, dim)


def gather_forward_split_backward(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """All-gather along ``dim`` forward; keep this member's part of the gradient backward."""
    g = resolve(group)
    return x if g.size == 1 else _GatherForwardSplitBackward.apply(x, g, dim)


def all_gather_forward_reduce_scatter_backward(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """All-gather along ``dim`` forward; reduce-scatter the gradient backward (sequence parallel)."""
    g = resolve(group)
    return x if g.size == 1 else _AllGatherForwardReduceScatterBackward.apply(x, g, dim)


def reduce_scatter_forward_all_gather_backward(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Reduce-scatter along ``dim`` forward; all-gather the gradient backward (sequence parallel)."""
    g = resolve(group)
    return x if g.size == 1 else _ReduceScatterForwardAllGatherBackward.apply(x, g, dim)


def all_to_all_forward_all_to_all_backward(
    x: torch.Tensor, group: Group, scatter_dim: int, gather_dim: int
) -> torch.Tensor:
    """All-to-all forward; the inverse all-to-all backward (Ulysses sequence parallelism)."""
    g = resolve(group)
    return x if g.size == 1 else _AllToAllForwardAllToAllBackward.apply(x, g, scatter_dim, gather_dim)


def broadcast_forward_reduce_backward(x: torch.Tensor, group: Group, src: int = 0) -> torch.Tensor:
    """Broadcast from member ``src`` forward; sum the gradients onto ``src`` backward (SUMMA)."""
    g = resolve(group)
    return x if g.size == 1 else _BroadcastForwardReduceBackward.apply(x, g, src)
