"""tessera's collectives inside ``torch.compile``d code: each one a registered custom op.

Dynamo cannot trace a process group's in-place, asynchronous calls (nor the ledger, the
watchdog and the progress numbering around them): left alone, every collective inside a
compiled block would break its graph in two. Instead, while dynamo traces, the functions of
:mod:`tessera.comm.ops` hand each collective to an op of the ``tessera`` library registered
here. A compiled graph holds it as one opaque node with a fake implementation (the output's
shape, for tracing) and calls it at run time with real tensors; its implementation is the
eager collective itself, so the ledger records every call and the watchdog guards every wait,
compiled or not (contract 12: "every collective stays counted").

Groups cross the graph boundary by their ``key`` (custom ops take no Python objects).
"""

from __future__ import annotations

import torch

from tessera import graph_breaks
from tessera.comm import ops
from tessera.comm.group import AxisGroup
from tessera.comm.group import group_by_key as _group

# ---- the ops: eager collectives inside, functional (a new output) outside ----------------------


@torch.library.custom_op("tessera::all_reduce", mutates_args=())
def _all_reduce(x: torch.Tensor, group: str, op: str) -> torch.Tensor:
    return ops.all_reduce(x.clone(), _group(group), op)


@_all_reduce.register_fake
def _(x: torch.Tensor, group: str, op: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("tessera::all_gather", mutates_args=())
def _all_gather(x: torch.Tensor, group: str, dim: int) -> torch.Tensor:
    return ops.all_gather(x, _group(group), dim).contiguous()


@_all_gather.register_fake
def _(x: torch.Tensor, group: str, dim: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] *= _group(group).size
    return x.new_empty(shape)


@torch.library.custom_op("tessera::reduce_scatter", mutates_args=())
def _reduce_scatter(x: torch.Tensor, group: str, dim: int, op: str) -> torch.Tensor:
    return ops.reduce_scatter(x, _group(group), dim, op).contiguous()


@_reduce_scatter.register_fake
def _(x: torch.Tensor, group: str, dim: int, op: str) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] //= _group(group).size
    return x.new_empty(shape)


@torch.library.custom_op("tessera::all_to_all", mutates_args=())
def _all_to_all(x: torch.Tensor, group: str, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    return ops.all_to_all(x, _group(group), scatter_dim, gather_dim).contiguous()


@_all_to_all.register_fake
def _(x: torch.Tensor, group: str, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    shape = list(x.shape)
    size = _group(group).size
    shape[scatter_dim] //= size
    shape[gather_dim] *= size
    return x.new_empty(shape)


@torch.library.custom_op("tessera::broadcast", mutates_args=())
def _broadcast(x: torch.Tensor, group: str, src: int) -> torch.Tensor:
    return ops.broadcast(x.clone(), _group(group), src)


@_broadcast.register_fake
def _(x: torch.Tensor, group: str, src: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("tessera::reduce", mutates_args=())
def _reduce(x: torch.Tensor, group: str, dst: int, op: str) -> torch.Tensor:
    return ops.reduce(x.clone(), _group(group), dst, op)


@_reduce.register_fake
def _(x: torch.Tensor, group: str, dst: int, op: str) -> torch.Tensor:
    return torch.empty_like(x)


# Every member must call every collective, in the same order: compiled graphs may neither drop one
# whose output a member does not use (a reduce's non-destination) nor move one past another.
def _ordered(op: torch._ops.OpOverload) -> None:
    # torch's effect registry (public in torch.library since 2.7; its first home before)
    from torch._higher_order_ops import effects

    register = getattr(torch.library, "_register_effectful_op", None) or effects._register_effectful_op
    register(op, effects._EffectType.ORDERED)


for _op in (_all_reduce, _all_gather, _reduce_scatter, _all_to_all, _broadcast, _reduce):
    _ordered(_op._opoverload)


# ---- what ops.py calls while dynamo traces ------------------------------------------------------


def all_reduce(tensor: torch.Tensor, group: AxisGroup, op: str) -> torch.Tensor:
    # ops.all_reduce reduces in place: the traced form copies the result back (functionalised)
    return tensor.copy_(_all_reduce(tensor, group.key, op))


def all_gather(tensor: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
    return _all_gather(tensor, group.key, dim)


def reduce_scatter(tensor: torch.Tensor, group: AxisGroup, dim: int, op: str) -> torch.Tensor:
    return _reduce_scatter(tensor, group.key, dim, op)


def all_to_all(tensor: torch.Tensor, group: AxisGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    return _all_to_all(tensor, group.key, scatter_dim, gather_dim)


def broadcast(tensor: torch.Tensor, group: AxisGroup, src: int) -> torch.Tensor:
    received = _broadcast(tensor, group.key, src)
    # the source's tensor keeps its value: not written to (autograd may have saved it)
    return received if group.rank == src else tensor.copy_(received)


def reduce(tensor: torch.Tensor, group: AxisGroup, dst: int, op: str) -> torch.Tensor:
    return tensor.copy_(_reduce(tensor, group.key, dst, op))


graph_breaks.install()  # the collectives without a traced form: deliberate breaks
ops.use_while_tracing(
    all_reduce=all_reduce,
    all_gather=all_gather,
    reduce_scatter=reduce_scatter,
    all_to_all=all_to_all,
    broadcast=broadcast,
    reduce=reduce,
)
