"""Per-parameter norms of parameters that are spread over ranks.

Layer-wise adaptive optimizers (LAMB, LARS) scale each parameter's update by a ratio of norms of
the WHOLE parameter. When the tensor an optimizer holds is only a piece of the parameter, the
piece's squared norm is summed with the other pieces' over the ranks that hold them. The tensors
say how they are split through attributes:

- ``tessera_sharded_along: tuple[str, ...]`` (tensor parallelism): the tensor is a block of a
  larger parameter split along these mesh axes; the squared norm is summed over each axis.
- ``tessera_zero_slot: tuple[int, int]`` = ``(slot, nslots)`` (ZeRO): the tensor is this
  data-parallel rank's part of parameter ``slot`` of ``nslots`` parameters flattened and split
  over the ``data`` axis; the squared norms are summed over the data axis in one dense vector.
- ``tessera_full_shape: torch.Size``: the whole parameter's shape, for a piece that is 1-D
  (used by the optimizers' default exclusion rule, see :func:`full_ndim`).

A tensor may carry both split attributes (a ZeRO piece of a tensor-parallel block): the data
sum comes first, then the sums over the tensor axes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from tessera import comm
from tessera.context import ParallelContext, get_context, has_context


def full_ndim(param: torch.Tensor) -> int:
    """Number of dimensions of the whole parameter that ``param`` is (a piece of)."""
    return len(getattr(param, "tessera_full_shape", param.shape))


def zero_layout_of(optimizer: torch.optim.Optimizer, quantities: int) -> tuple[int, int] | None:
    """``(quantities, nslots)`` when ``optimizer`` holds ZeRO pieces (any of its tensors), else None."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            slot = getattr(p, "tessera_zero_slot", None)
            if slot is not None:
                return quantities, int(slot[1])
    return None


def resolve_context(ctx: ParallelContext | None) -> ParallelContext | None:
    """``ctx`` if given, else the current tessera context if there is one, else None (local)."""
    if ctx is not None:
        return ctx
    return get_context() if has_context() else None


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
    zero_layout: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Squared 2-norm of the whole parameter that each ``tensors[i]`` is a piece of.

    ``tensors[i]`` is a quantity (weight, update, gradient) of ``params[i]``, with its shape;
    ``params[i]`` carries the split attributes described in the module docstring. Returns a 1-D
    fp32 vector ``[len(tensors)]`` on the tensors' device. With ``ctx`` None it is the local
    squared norms.

    A parameter may be listed several times (one entry per quantity, e.g. weights then updates);
    pass every quantity in one call to pay for one set of all-reduces.

    Collective when ``ctx`` has ranks to sum over: when any rank holds ZeRO pieces, every rank
    of the data group must call it with pieces (a zero-length one will do), the same ``nslots``
    and the same number of quantities per piece; every rank of a tensor group must call it with
    the same set of ``tessera_sharded_along`` tuples (one all-reduce per distinct tuple and
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
        axes = tuple(getattr(p, "tessera_sharded_along", ()))
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
    sq: torch.Tensor, params: Sequence[torch.Tensor], ctx: ParallelContext, layout: tuple[int, int] | None = None
) -> None:
    """Sum, over the data axis and in place, the squared norms of ZeRO pieces (one all-reduce).

    A parameter listed k times (several quantities of it, as LAMB's weights and updates) fills
    k rows of a dense ``[k, nslots]`` matrix: its j-th occurrence goes to row j.
    """
    if ctx.size("data") == 1:
        return
    index: list[int] = []
    rows: list[int] = []
    slots: list[int] = []
    seen: dict[int, int] = defaultdict(int)
    nslots: int | None = layout[1] if layout is not None else None
    for i, p in enumerate(params):
        slot = getattr(p, "tessera_zero_slot", None)
        if slot is None:
            continue
        s, n = int(slot[0]), int(slot[1])
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
    comm.all_reduce(dense, ctx.group("data"))
    sq.index_copy_(0, picked, dense[at])
