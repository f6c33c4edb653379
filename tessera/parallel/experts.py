"""Gradients of parameters spread over the ``expert`` axis (an MoE layer's experts).

The data axis averages every other parameter's gradient. An expert's is different: the rank that
holds it already received, through the all-to-all's backward, the gradient from the tokens of
every rank of its expert group, so summing once more over the ranks that hold the *same* experts
(``ctx.expert_replicas``: ``expert_data``, times ``sequence`` when split) and dividing by all the
replicas (``ctx.replicas``) gives the single-process average. The training strategies keep these
parameters out of their data-axis reduction (DDP ignores them) and call :func:`reduce_expert_gradients`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tessera import comm
from tessera.context import ParallelContext
from tessera.context.placement import placement_of

EXPERT_AXIS = "expert"


def is_expert(param: torch.Tensor) -> bool:
    """Whether ``param`` is split over the expert axis (each expert-group rank holds other experts)."""
    return EXPERT_AXIS in placement_of(param).split_axes


def expert_parameter_names(module: nn.Module) -> list[str]:
    """The names (as ``named_parameters`` gives them) of ``module``'s expert parameters."""
    return [name for name, p in module.named_parameters() if is_expert(p)]


def reduce_expert_gradients(params: Iterable[torch.Tensor], ctx: ParallelContext) -> None:
    """Make the gradients of the expert parameters among ``params`` the single-process average
    (module docstring): one flat all-reduce over ``ctx.expert_replicas``. Collective over that
    group; every rank passes its experts (the same shapes across the group)."""
    grads = [p.grad for p in params if is_expert(p) and p.grad is not None]
    comm.all_reduce_flat(grads, ctx.expert_replicas, divide_by=ctx.replicas.size)  # divides alone on one rank
