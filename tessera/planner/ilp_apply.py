"""Applying an operator-level plan (:mod:`tessera.planner.ilp`) to a module on one rank.

:func:`apply_operator_plan` traces the module again and rewrites its graph: every Linear and
LayerNorm that the plan splits becomes its shard (:class:`PlannedLinear`, :class:`PlannedLayerNorm`;
split weights carry their :class:`~tessera.context.placement.ShardSpec`, so that
``tessera.checkpoint.full_state_dict`` gathers them under the single-process keys), a
:class:`Reshard` module is inserted after each producer whose output its consumers need in another
layout (the collectives of ``tessera.comm``'s autograd wrappers), the size arguments of a
view/reshape of a split tensor become the local sizes (the head count of an attention block
divided by the ranks), size queries of a split tensor answer the global size, and a mean over a
split dimension is scaled into its share of the partial sum.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from tessera import comm
from tessera.comm import AxisGroup
from tessera.context import ParallelContext
from tessera.context.placement import ShardSpec, divide
from tessera.parallel.tensor.common import shard_parameter
from tessera.planner.ilp_ops import Need, Sharding, arg
from tessera.planner.ilp_plan import OperatorPlan
from tessera.planner.ilp_trace import is_size_query, target_name

__all__ = ["PlannedLayerNorm", "PlannedLinear", "Reshard", "apply_operator_plan", "keep_on_first", "reshard"]


class _KeepOnFirst(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        return x.clone() if group.rank == 0 else torch.zeros_like(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def keep_on_first(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Replicated -> partial sums without communication: the first member keeps ``x``, the others
    hold zeros. The gradient of a partial sum is whole on every member, which is the replicated
    input's gradient as it is (identity backward)."""
    return x if group.size == 1 else _KeepOnFirst.apply(x, group)


def reshard(x: torch.Tensor, source: Sharding, need: Need, group: AxisGroup) -> torch.Tensor:
    """Convert ``x`` from layout ``source`` to what a consumer needs (the table of ``conversion``
    in :mod:`tessera.planner.ilp`): forward and backward collectives through ``tessera.comm``."""
    target = need.layout
    if source.kind == "R":
        if target.kind == "S":
            return comm.split_forward_gather_backward(x, group, target.dim)
        if target.kind == "P":
            return keep_on_first(x, group)
        return comm.copy_forward_all_reduce_backward(x, group) if need.partial_grad else x
    if source.kind == "S":
        if target.kind == "R":
            if need.partial_grad:
                return comm.all_gather_forward_reduce_scatter_backward(x, group, source.dim)
            return comm.gather_forward_split_backward(x, group, source.dim)
        if target.kind == "S" and target.dim != source.dim:
            return comm.all_to_all_forward_all_to_all_backward(x, group, target.dim, source.dim)
        if target.kind == "S":
            return x
        raise ValueError(f"no conversion from {source} to {need}")
    if target.kind == "R":
        whole = comm.all_reduce_forward_copy_backward(x, group)
        return comm.copy_forward_all_reduce_backward(whole, group) if need.partial_grad else whole
    if target.kind == "S":
        return comm.reduce_scatter_forward_all_gather_backward(x, group, target.dim)
    return x


class Reshard(nn.Module):
    """One conversion of the plan, inserted between a producer and its consumers."""

    def __init__(self, source: Sharding, need: Need, group: AxisGroup) -> None:
        super().__init__()
        self.source, self.need, self.group = source, need, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reshard(x, self.source, self.need, self.group)

    def extra_repr(self) -> str:
        return f"{self.source} -> {self.need}, axis={self.group.name!r}"


class PlannedLinear(nn.Module):
    """A Linear under one of the plan's strategies, holding ``weight`` and ``bias`` under the
    Linear's names: "column" (rows of both split: [out/n, in]), "row" (columns split: [out, in/n];
    the bias, whole, is added by the first member only so that the partial sums add it once) or
    "split(d)" (both whole; their gradients, partial sums of the local rows, all-reduced)."""

    def __init__(self, source: nn.Linear, strategy: str, ctx: ParallelContext, axis: str) -> None:
        super().__init__()
        self.strategy, self.group = strategy, ctx.group(axis)
        n, (out_f, in_f) = self.group.size, source.weight.shape
        self.in_features, self.out_features = in_f, out_f
        self.weight: torch.Tensor
        self.bias: torch.Tensor | None
        if strategy == "column":
            divide(out_f, n, f"{strategy} Linear's out_features")
            self.weight = shard_parameter(source.weight, ShardSpec((out_f, in_f), ((axis,), ())), ctx)
            bias = source.bias
            self.bias = None if bias is None else shard_parameter(bias, ShardSpec((out_f,), ((axis,),)), ctx)
        elif strategy == "row":
            divide(in_f, n, f"{strategy} Linear's in_features")
            self.weight = shard_parameter(source.weight, ShardSpec((out_f, in_f), ((), (axis,))), ctx)
            self.bias = source.bias
        else:
            self.weight, self.bias = source.weight, source.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.strategy == "column":
            return F.linear(x, self.weight, self.bias)
        if self.strategy == "row":
            return F.linear(x, self.weight, None if self.bias is None else keep_on_first(self.bias, self.group))
        weight = comm.copy_forward_all_reduce_backward(self.weight, self.group)
        bias = None if self.bias is None else comm.copy_forward_all_reduce_backward(self.bias, self.group)
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, strategy={self.strategy}, axis={self.group.name!r}"


class PlannedLayerNorm(nn.Module):
    """A LayerNorm on split rows: the weight and bias whole, their gradients all-reduced."""

    def __init__(self, source: nn.LayerNorm, ctx: ParallelContext, axis: str) -> None:
        super().__init__()
        self.normalized_shape, self.eps, self.group = tuple(source.normalized_shape), source.eps, ctx.group(axis)
        self.weight, self.bias = source.weight, source.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else comm.copy_forward_all_reduce_backward(self.weight, self.group)
        bias = None if self.bias is None else comm.copy_forward_all_reduce_backward(self.bias, self.group)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


def global_shape(x: torch.Tensor, dim: int, parts: int) -> torch.Size:
    """The shape of the whole tensor whose ``dim`` is split ``parts`` ways, ``x`` this rank's part."""
    shape = list(x.shape)
    shape[dim] *= parts
    return torch.Size(shape)


def global_size(x: torch.Tensor, dim: int, parts: int, which: int | None = None) -> torch.Size | int:
    """``x.size(which)`` of the whole tensor (see :func:`global_shape`)."""
    shape = global_shape(x, dim, parts)
    return shape if which is None else shape[which]


def _set_submodule(gm: fx.GraphModule, target: str, module: nn.Module) -> None:
    # fx made fresh parents for nested targets: the user's module is not changed
    parent, _, leaf = target.rpartition(".")
    setattr(gm.get_submodule(parent) if parent else gm, leaf, module)


def _check_graph(gm: fx.GraphModule, plan: OperatorPlan) -> None:
    got = tuple((node.name, node.op, target_name(node)) for node in gm.graph.nodes)
    if got == plan.signature:
        return
    for mine, theirs in zip(got, plan.signature, strict=False):
        if mine != theirs:
            raise ValueError(
                f"the module traces to another graph than the plan's: node {mine} where the plan has {theirs}"
            )
    raise ValueError(f"the module traces to {len(got)} nodes, the plan's graph has {len(plan.signature)}")


def local_shape(shape: Sequence[int], dim: int, parts: int) -> tuple[int, ...]:
    """``shape`` (a whole tensor's) with dimension ``dim`` divided into ``parts``: a rank's part."""
    out = list(shape)
    out[dim] = divide(out[dim], parts, f"size {dim} of the split tensor")
    return tuple(out)


def _local_sizes(node: fx.Node, dim: int, n: int) -> None:
    """Divide the size argument of output dimension ``dim`` of a view/reshape by ``n``."""
    shape_arg = node.args[1] if len(node.args) == 2 else None
    if isinstance(shape_arg, fx.Node):  # x.view(y.shape): a whole torch.Size
        with node.graph.inserting_before(node):
            local = node.graph.call_function(local_shape, (shape_arg, dim, n))
        node.args = (node.args[0], local)
        return
    if isinstance(shape_arg, (tuple, list)):  # x.view((b, s, h)), torch.reshape(x, (b, s, h))
        sizes, rebuild = list(shape_arg), lambda s: (node.args[0], tuple(s))
    else:  # x.view(b, s, h)
        sizes, rebuild = list(node.args[1:]), lambda s: (node.args[0], *s)
    size = sizes[dim]
    if isinstance(size, int):
        if size != -1:
            sizes[dim] = divide(size, n, f"node '{node.name}': size {dim} of the split tensor")
    elif isinstance(size, fx.Node):
        with node.graph.inserting_before(node):
            sizes[dim] = node.graph.call_function(operator.floordiv, (size, n))
    else:
        raise ValueError(f"node '{node.name}': cannot make size argument {size!r} local")
    node.args = rebuild(sizes)


def _scale_after(node: fx.Node, factor: float) -> None:
    """Multiply ``node``'s output by ``factor`` for every user."""
    users = list(node.users)
    with node.graph.inserting_after(node):
        scaled = node.graph.call_function(operator.mul, (node, factor))
    for user in users:
        user.replace_input_with(node, scaled)


def apply_operator_plan(
    module: nn.Module, plan: OperatorPlan, ctx: ParallelContext, axis: str = "tensor"
) -> fx.GraphModule:
    """``module`` (traced again; it must give the plan's graph) as this rank runs it under
    ``plan`` over ``ctx``'s ``axis``. Its inputs are the full tensors on every rank of the axis,
    its outputs the full results. The module returned shares the parameters the plan keeps whole
    with ``module``; split ones are this rank's blocks, tagged for ``full_state_dict``."""
    group = ctx.group(axis)
    if group.size != plan.tensor_size:
        raise ValueError(f"the plan is for {plan.tensor_size} ranks, axis {axis!r} has {group.size}")
    gm = fx.symbolic_trace(module)
    _check_graph(gm, plan)
    n = plan.tensor_size
    nodes = {node.name: node for node in gm.graph.nodes}

    for choice in plan.choices.values():
        node = nodes[choice.name]
        if choice.kind == "linear" and choice.strategy != "replicate":
            source = gm.get_submodule(str(node.target))
            assert isinstance(source, nn.Linear)
            _set_submodule(gm, str(node.target), PlannedLinear(source, choice.strategy, ctx, axis))
        elif choice.kind == "layer_norm" and choice.strategy != "replicate":
            norm = gm.get_submodule(str(node.target))
            assert isinstance(norm, nn.LayerNorm)
            _set_submodule(gm, str(node.target), PlannedLayerNorm(norm, ctx, axis))
        elif choice.kind == "view" and choice.output.kind == "S" and node.target in ("view", "reshape", torch.reshape):
            _local_sizes(node, choice.output.dim, n)

    for node in list(gm.graph.nodes):  # size queries answer for the whole tensor
        src = node.args[0] if node.args else None
        if not (is_size_query(node) and isinstance(src, fx.Node) and src.name in plan.choices):
            continue
        lay = plan.layout(src.name)
        if lay.kind != "S" or node.target in ("dim", "ndim", "dtype") or node.args[1:2] in (("ndim",), ("dtype",)):
            continue
        which = arg(node, 1, "dim") if node.op == "call_method" else None
        with gm.graph.inserting_after(node):
            query = gm.graph.call_function(global_size, (src, lay.dim, n, which))
        node.replace_all_uses_with(query)
        gm.graph.erase_node(node)

    for i, r in enumerate(plan.reshards):
        producer = nodes[r.producer]
        name = f"_reshard_{i}"
        gm.add_submodule(name, Reshard(r.source, r.need, group))
        with gm.graph.inserting_after(producer):
            converted = gm.graph.call_module(name, (producer,))
        for consumer in r.consumers:
            nodes[consumer].replace_input_with(producer, converted)

    for choice in plan.choices.values():  # after the reshards: a scale comes before them
        node = nodes[choice.name]
        mean = node.target in ("mean", torch.mean) and choice.strategy.endswith("->P")
        mse = choice.kind == "mse_loss" and choice.output.kind == "P" and arg(node, 4, "reduction", "mean") == "mean"
        if mean or mse:
            _scale_after(node, 1.0 / n)

    gm.graph.lint()
    gm.recompile()
    return gm
