"""Parameters spread over the ``expert`` axis (an MoE layer's experts).

How their gradients are reduced is the reduction contract's (``tessera.context.reduction``):
the rank that holds an expert already received, through the all-to-all's backward, the gradient
from the tokens of every rank of its expert group, so its gradient is summed over the ranks that
hold the *same* experts (``ctx.expert_replicas``) and divided by all the replicas.
"""

from __future__ import annotations

import torch

from tessera.context.placement import placement_of

EXPERT_AXIS = "expert"


def is_expert(param: torch.Tensor) -> bool:
    """Whether ``param`` is split over the expert axis (each expert-group rank holds other experts)."""
    return EXPERT_AXIS in placement_of(param).split_axes
