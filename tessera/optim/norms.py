"""Norms of parameters that are spread over ranks: the one implementation behind clipping,
the fp16 overflow check, LAMB and LARS.

Each tensor's :class:`~tessera.context.placement.Placement` says how it is spread:

- ``shard`` (tensor parallelism): the tensor is a block of a larger parameter split along
  ``split_axes``; its squared norm is summed over each of those axes;
- ``zero`` (ZeRO): the tensor is this data-parallel rank's piece of parameter ``zero.index`` of
  ``zero.count`` parameters flattened and split over the ``data`` axis; squared norms are summed
  over the data axis in one dense vector of ``count`` slots (over the data ranks of one host when
  the pieces are repeated on every host: ``zero.within_host``, hybrid sharding);
- ``stage`` (pipelines): the pipeline rank that counts the parameter in a whole-model norm (a
  tied parameter has gradients on several ranks); whole-model sums add up the stages.

A piece may carry both split kinds (a ZeRO piece of a tensor-parallel block): the data sum comes
first, then the sums over the tensor axes. Replicas (the data axis without ZeRO) hold the same
gradients after reduction and are not summed. An MoE layer's experts are split over the
``expert`` axis, a coordinate of the data axis, and ZeRO shards them over the other coordinate
(``expert_data``): the data sum of their pieces already covers the expert axis, which is then
skipped.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from tessera import comm
from tessera.comm import AxisGroup
from tessera.context import EXPERT_AXES, ParallelContext
from tessera.context.placement import Placement, placement_of


def _axes_left(placement: Placement, summed_over_data: bool) -> tuple[str, ...]:
    """The axes to sum a tensor's squared norm over: its split axes, less, once the data axis
    has summed it (ZeRO pieces), the coordinates of the data axis (module docstring)."""
    axes = placement.split_axes
    return tuple(a for a in axes if a not in EXPERT_AXES) if summed_over_data else axes


def full_ndim(param: torch.Tensor) -> int:
    """Number of dimensions of the whole parameter that ``param`` is (a piece of)."""
    return len(placement_of(param).full_shape(param))


class ZeroLayout(NamedTuple):
    """What the norms of ZeRO pieces need to know of them all, even on a rank passing none:
    the quantities given per piece, the optimizer's parameter slots, and whether the pieces are
    spread over one host's replicas (:attr:`ZeroSlot.within_host`)."""

    quantities: int
    nslots: int
    within_host: bool = False


def zero_layout_of(optimizer: torch.optim.Optimizer, quantities: int) -> ZeroLayout | None:
    """The :class:`ZeroLayout` of ``optimizer``'s ZeRO pieces (any of its tensors), else None."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            zero = placement_of(p).zero
            if zero is not None:
                return ZeroLayout(quantities, zero.count, zero.within_host)
    return None


def pieces_group(ctx: ParallelContext, within_host: bool = False) -> AxisGroup:
    """The ranks over which the squares of ZeRO pieces are summed: every replica, or (hybrid
    sharding, ``within_host``) the replicas of this rank's host, which hold every piece once."""
    return ctx.host_split(ctx.replicas_axis).inside if within_host else ctx.replicas


def mesh_of(tensors: Iterable[torch.Tensor]) -> ParallelContext | None:
    """The context that split ``tensors`` (the first one recorded in a placement), or None when
    every tensor is held whole by every rank (nothing to sum)."""
    for t in tensors:
        mesh = placement_of(t).mesh
        if mesh is not None:
            return mesh
    return None


def local_sq_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Squared 2-norms of ``tensors`` as a 1-D fp32 vector ``[len(tensors)]`` (one foreach kernel)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float32)
    norms = torch._foreach_norm(list(tensors), 2.0, dtype=torch.float32)
    return torch.stack(norms).square()


def whole_sq_norms(
    tensors: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    ctx: ParallelContext | None,
    zero_layout: ZeroLayout | tuple[int, int] | None = None,
) -> torch.Tensor:
    """Squared 2-norm of the whole parameter that each ``tensors[i]`` is a piece of.

    ``tensors[i]`` is a quantity (weight, update, gradient) of ``params[i]``, with its shape;
    ``params[i]``'s placement says how it is split (module docstring). Returns a 1-D fp32 vector
    ``[len(tensors)]`` on the tensors' device. Sums run over the groups of ``ctx``; with ``ctx``
    None it is the local squared norms.

    A parameter may be listed several times (one entry per quantity, e.g. weights then updates);
    pass every quantity in one call to pay for one set of all-reduces.

    Collective when ``ctx`` has ranks to sum over: when any rank holds ZeRO pieces, every rank
    of the data group must call it with pieces (a zero-length one will do), the same ``nslots``
    and the same number of quantities per piece; every rank of a tensor group must call it with
    the same set of split-axes tuples (one all-reduce per distinct tuple and
    axis, in sorted order). ``zero_layout = (quantities per piece, nslots)``, when the caller
    knows it holds ZeRO pieces, makes the data all-reduce happen even when this rank passes
    none (its pieces were all excluded, say), so that it still meets the other ranks.
    """
    if len(tensors) != len(params):
        raise ValueError(f"whole_sq_norms: {len(tensors)} tensors for {len(params)} parameters")
    sq = local_sq_norms(tensors)
    if ctx is None:
        return sq
    _sum_zero_pieces(sq, params, ctx, zero_layout)
    by_axes: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for i, p in enumerate(params):
        placement = placement_of(p)
        axes = _axes_left(placement, summed_over_data=placement.zero is not None)
        if axes and any(ctx.size(a) > 1 for a in axes):
            by_axes[axes].append(i)
    for axes, index in sorted(by_axes.items()):
        rows = torch.tensor(index, device=sq.device)
        part = sq.index_select(0, rows)
        for axis in axes:
            comm.all_reduce(part, ctx.group(axis))
        sq.index_copy_(0, rows, part)
    return sq


def _sum_zero_pieces(
    sq: torch.Tensor,
    params: Sequence[torch.Tensor],
    ctx: ParallelContext,
    layout: ZeroLayout | tuple[int, int] | None = None,
) -> None:
    """Sum, over the data axis and in place, the squared norms of ZeRO pieces (one all-reduce).

    A parameter listed k times (several quantities of it, as LAMB's weights and updates) fills
    k rows of a dense ``[k, nslots]`` matrix: its j-th occurrence goes to row j.
    """
    if ctx.replicas.size == 1:
        return
    index: list[int] = []
    rows: list[int] = []
    slots: list[int] = []
    seen: dict[int, int] = defaultdict(int)
    nslots: int | None = layout[1] if layout is not None else None
    within_host = isinstance(layout, ZeroLayout) and layout.within_host
    for i, p in enumerate(params):
        zero = placement_of(p).zero
        if zero is None:
            continue
        within_host = within_host or zero.within_host  # one optimizer's pieces: all alike
        s, n = zero.index, zero.count
        if nslots is None:
            nslots = n
        elif n != nslots:
            raise ValueError(f"ZeRO pieces disagree on the number of slots: {nslots} and {n}")
        if not 0 <= s < n:
            raise ValueError(f"ZeRO slot {s} out of range for {n} slots")
        index.append(i)
        rows.append(seen[id(p)])
        seen[id(p)] += 1
        slots.append(s)
    if nslots is None:
        return
    height = layout[0] if layout is not None else max(rows) + 1
    at = (
        torch.tensor(rows, dtype=torch.long, device=sq.device),
        torch.tensor(slots, dtype=torch.long, device=sq.device),
    )
    picked = torch.tensor(index, dtype=torch.long, device=sq.device)
    dense = torch.zeros(height, nslots, dtype=torch.float32, device=sq.device)
    dense.index_put_(at, sq.index_select(0, picked), accumulate=True)  # two pieces of one slot add up
    comm.all_reduce(dense, pieces_group(ctx, within_host))
    sq.index_copy_(0, picked, dense[at])


def _stage_sum(parts: dict[tuple[str, ...], torch.Tensor], ctx: ParallelContext, device: torch.device) -> torch.Tensor:
    """The whole-model sum of squares from per-split-kind partial sums: each part summed over
    the axes that split its parameters (sorted, the same order on every rank), then all parts
    added and summed over the pipeline stages."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for axes, part in sorted(parts.items()):
        for axis in axes:
            comm.all_reduce(part, ctx.group(axis))
        total = total + part
    comm.all_reduce(total, ctx.group("pipeline"))
    return total


def grad_squares(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Squared 2-norms of ``grads`` as a 1-D fp32 vector (the squares every gradient norm adds up)."""
    return torch.stack([n.float() for n in torch._foreach_norm(list(grads), 2.0)]).pow(2)


def add_slot_squares(per_slot: torch.Tensor, index: Sequence[int], grads: Sequence[torch.Tensor]) -> None:
    """Add the squared 2-norm of ``grads[k]`` to ``per_slot[index[k]]``."""
    if grads:
        per_slot.index_add_(0, torch.tensor(index, device=per_slot.device), grad_squares(grads).to(per_slot.device))


def global_grad_norm(
    params: Iterable[torch.Tensor],
    ctx: ParallelContext | None = None,
    *,
    zero_slots: Sequence[Placement] | None = None,
    zero_group: AxisGroup | None = None,
) -> torch.Tensor:
    """The 2-norm of the whole model's gradient (a 0-dim fp32 tensor on ``ctx``'s device), each
    whole parameter counted once, however its gradient is spread over the ranks.

    ``params``: the tensors whose ``.grad`` make up the gradient on this rank. Without
    ``zero_slots`` they are (blocks of) the model's parameters, each counted on the pipeline
    stage that owns it. With ``zero_slots`` they are ZeRO pieces and ``zero_slots[i]`` is the
    placement of the model's parameter ``i`` (the same list on every data rank): the per-slot
    squares are summed over the data axis first (over ``zero_group``, the ranks the pieces are
    spread over, when given: one host's replicas under hybrid sharding), so that a rank whose
    pieces are all padding still makes the same collectives. Collective over every axis of ``ctx``.
    """
    params = list(params)
    if ctx is None:
        ctx = mesh_of(params)
    device = ctx.device if ctx is not None else torch.device("cpu")
    parts: dict[tuple[str, ...], torch.Tensor] = {}
    if zero_slots is None:
        stage = ctx.local_rank("pipeline") if ctx is not None else 0
        by_axes: dict[tuple[str, ...], list[torch.Tensor]] = defaultdict(list)
        for p in params:
            placement = placement_of(p)
            if p.grad is not None and placement.counted_on(stage):
                by_axes[placement.split_axes].append(p.grad)
        parts = {axes: grad_squares(grads).sum() for axes, grads in by_axes.items()}
    else:
        if ctx is None:
            raise ValueError("global_grad_norm over ZeRO pieces needs the context they are spread over")
        per_slot = torch.zeros(len(zero_slots), dtype=torch.float32, device=device)
        pieces = [p for p in params if p.grad is not None]
        index = [placement_of(p).zero.index for p in pieces]  # type: ignore[union-attr]
        add_slot_squares(per_slot, index, [p.grad for p in pieces])  # type: ignore[misc]
        return norm_from_slot_squares(per_slot, zero_slots, ctx, over=zero_group)
    if ctx is None:
        total = torch.zeros((), dtype=torch.float32, device=device)
        for _, part in sorted(parts.items()):
            total = total + part
        return total.sqrt()
    return _stage_sum(parts, ctx, device).sqrt()


def norm_from_slot_squares(
    per_slot: torch.Tensor, zero_slots: Sequence[Placement], ctx: ParallelContext, over: AxisGroup | None = None
) -> torch.Tensor:
    """The whole model's 2-norm from this data rank's squared norms of its pieces, summed per
    parameter slot (``per_slot[i]``: parameter ``i``, placed by ``zero_slots[i]``; the same
    slots on every data rank) over ``over``, the ranks the pieces are spread over (default:
    every replica). Collective over every axis of ``ctx``; ``per_slot`` is not changed."""
    per_slot = per_slot.clone()
    comm.all_reduce(per_slot, over if over is not None else ctx.replicas)
    stage = ctx.local_rank("pipeline")
    members: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for i, placement in enumerate(zero_slots):
        if placement.counted_on(stage):
            members[_axes_left(placement, summed_over_data=True)].append(i)
    parts = {axes: per_slot[index].sum() for axes, index in members.items()}
    return _stage_sum(parts, ctx, per_slot.device).sqrt()
