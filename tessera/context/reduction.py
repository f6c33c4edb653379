"""The reduction contract: which ranks a parameter's gradient is summed over, and what the sum is
divided by, so that every rank ends with the gradient single-process training would have. Every
strategy that brings gradients together (DDP, one all-reduce at the step, the sharded optimizer)
and the walk-through in ``docs/architecture.md`` ask :func:`gradient_reduction`; none picks an
axis by hand.

The rule, from the context and the parameter's placement record:

- a parameter every replica holds (the usual case): summed over ``ctx.replicas``, the data axis
  times the sequence axis when the sequence is split (those ranks run the same weights on the
  other tokens of the same samples), and divided by its size: the replicas' average;
- an MoE layer's expert (split over the ``expert`` axis, so the ranks of that axis hold other
  experts): the all-to-all's backward already summed, on the rank holding it, the gradient from
  the tokens of every rank of its expert group; summed once more over the ranks holding the same
  experts (``ctx.expert_replicas``) it has every replica's tokens once, so it is divided by all
  the replicas (``ctx.replicas.size``), not by its own group's size.

Averaging over ``ctx.group("data")`` instead is silently wrong under sequence parallelism (the
sequence ranks' halves of each sample never meet) and under expert parallelism (other experts'
gradients are mixed in). The other axes are not part of it: a tensor-parallel layer makes its
replicated weights' gradients whole on every tensor rank itself, and a pipeline stage sums a tied
parameter's gradient over the stages that hold it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tessera import comm
from tessera.comm import AxisGroup
from tessera.context.placement import Placement, divide, placement_of

if TYPE_CHECKING:
    from tessera.context.context import ParallelContext

# The axis an MoE layer spreads its experts over (a split of the data axis).
_EXPERT_AXIS = "expert"


@dataclass(frozen=True)
class Reduction:
    """A gradient's reduction: the sum over the ranks of ``group``, divided by ``divide_by``.
    Two parameters with equal reductions can share one collective (``group`` compares by
    identity: a context hands out one object per group)."""

    group: AxisGroup
    divide_by: int

    @property
    def after_average(self) -> int:
        """What the group's average (``op="avg"``, which divides by ``group.size``) is still to be
        divided by: 1 for a parameter every replica holds, the expert axis's size for an expert."""
        return divide(self.divide_by, self.group.size, "Reduction: divide_by over the group's size")

    def all_reduce(self, grads: list[torch.Tensor]) -> None:
        """Reduce ``grads`` in place as one flat buffer (one collective over ``group``; every
        member passes tensors of the same shapes)."""
        if self.divide_by == 1:
            return  # one replica: already the single-process gradient
        if self.after_average == 1:
            comm.all_reduce_flat(grads, self.group, op="avg")  # summed, then divided by the group
        else:
            comm.all_reduce_flat(grads, self.group, divide_by=self.divide_by)  # divided, then summed


def gradient_reduction(ctx: ParallelContext, param: torch.Tensor | Placement | None = None) -> Reduction:
    """How the gradient of ``param`` (a parameter, or its placement record; None: a parameter
    every replica holds whole) is reduced in ``ctx`` (module docstring)."""
    if param is None:
        placement = Placement()
    else:
        placement = param if isinstance(param, Placement) else placement_of(param)
    replicas = ctx.replicas
    if _EXPERT_AXIS in placement.split_axes:
        return Reduction(ctx.expert_replicas, replicas.size)
    return Reduction(replicas, replicas.size)


def params_by_reduction(
    params: Iterable[torch.Tensor], ctx: ParallelContext
) -> list[tuple[Reduction, list[torch.Tensor]]]:
    """``params`` grouped by their gradient's reduction, each group in the order given and the
    groups in the order first met: the same on every rank for the same model, so that ranks
    issue their collectives in the same order."""
    found: dict[Reduction, list[torch.Tensor]] = {}
    for p in params:
        found.setdefault(gradient_reduction(ctx, p), []).append(p)
    return list(found.items())


def reduce_gradients_of(params: Iterable[torch.Tensor], ctx: ParallelContext) -> None:
    """Make the gradients of ``params`` (those that have one) what single-process training
    would hold: one flat all-reduce per reduction (collective over each reduction's group)."""
    for reduction, same in params_by_reduction(params, ctx):
        reduction.all_reduce([p.grad for p in same if p.grad is not None])
