"""Mixture of experts: a router sends each token to ``top_k`` of ``num_experts`` MLPs and sums
their outputs weighted by its routing probabilities.

Routing: the router's logits (fp32) give each token a softmax over the experts; it takes the
``top_k`` largest, and with ``top_k > 1`` renormalises their weights to sum to one (Mixtral;
``normalize=False`` keeps the raw probabilities, Switch's top-1 does). Capacity: each expert
takes at most ``ceil(capacity_factor * tokens * top_k / num_experts)`` assignments; the first
choices of all tokens are served before any second choice, and within a choice earlier tokens
first, so an expert over capacity drops the later tokens' assignments (a dropped assignment adds
nothing; a token whose every choice is dropped comes out as zeros, the residual around the
layer carrying it). ``capacity_factor=None``: no token is dropped.

Experts compute grouped: the kept assignments are packed into one ``[experts, slots, d_model]``
buffer (slots: the capacity, or the fullest expert's count without one) and every expert's MLP
runs as a batched matrix product over it, with no Python loop over experts or tokens. Experts
are GELU MLPs or SwiGLU ones (LLaMA/Mixtral).

Expert parallelism (``group``: the ranks the experts are spread over, each holding
``num_experts / size`` of them, consecutive): every rank routes its own tokens and packs its
``[experts, slots, d_model]`` buffer as above; an all-to-all through :mod:`tessera.comm` sends
each expert's slots to the rank holding it (``[local experts, size x slots, d_model]`` there),
the local experts compute, and the inverse all-to-all brings the outputs back (the backward
runs both in reverse). Capacity counts each rank's own tokens, as if the single-process layer
ran on each rank's batch; without a capacity, the slots are the fullest expert's count over the
group (a max all-reduce). The router is replicated; gradients of the local experts come from
every rank's tokens.

Auxiliary losses of the last forward (``MoE.aux_loss``; :func:`auxiliary_loss` sums them over a
model): the load-balancing loss ``num_experts * sum_e f_e * P_e`` (``f_e``: the fraction of the
assignments routed to expert e before capacity, ``P_e``: its mean routing probability; 1 when
balanced) times ``aux_loss_weight``, and the router z-loss ``mean(logsumexp(logits)^2)`` times
``z_loss_weight``. ``MoE.stats`` holds the last forward's tokens per expert (kept) and drops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from tessera import comm

Activation = Literal["gelu", "swiglu"]


@dataclass(frozen=True)
class RoutingStats:
    """One forward's routing: ``tokens_per_expert`` (assignments each expert computed, after
    capacity), ``dropped`` (assignments over capacity), ``capacity`` (slots per expert; None:
    unbounded), ``load_balance`` and ``z_loss`` (the unweighted auxiliary losses)."""

    tokens_per_expert: torch.Tensor
    dropped: int
    capacity: int | None
    load_balance: torch.Tensor
    z_loss: torch.Tensor


class GroupedExperts(nn.Module):
    """``num_experts`` MLPs ``d_model -> ff_dim -> d_model`` held as stacked weights and run as
    batched products over a ``[num_experts, slots, d_model]`` buffer."""

    def __init__(self, num_experts: int, d_model: int, ff_dim: int, activation: Activation = "gelu") -> None:
        super().__init__()
        if activation not in ("gelu", "swiglu"):
            raise ValueError(f"expert activation {activation!r} is not one of gelu, swiglu")
        self.activation = activation
        self.w_in = nn.Parameter(torch.empty(num_experts, d_model, ff_dim))
        self.w_gate = nn.Parameter(torch.empty(num_experts, d_model, ff_dim)) if activation == "swiglu" else None
        self.w_out = nn.Parameter(torch.empty(num_experts, ff_dim, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert as ``nn.Linear`` initialises its weight: uniform in +-1/sqrt(fan_in)."""
        for weight in (self.w_in, self.w_gate, self.w_out):
            if weight is not None:
                bound = 1.0 / math.sqrt(weight.shape[1])
                nn.init.uniform_(weight, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.bmm(x, self.w_in)
        if self.w_gate is not None:
            hidden = F.silu(torch.bmm(x, self.w_gate)) * hidden
        else:
            hidden = F.gelu(hidden)
        return torch.bmm(hidden, self.w_out)


class MoE(nn.Module):
    """A mixture-of-experts MLP: ``[..., d_model] -> [..., d_model]`` (see the module docstring)."""

    def __init__(
        self,
        d_model: int,
        ff_dim: int,
        num_experts: int,
        top_k: int = 2,
        capacity_factor: float | None = 1.25,
        activation: Activation = "swiglu",
        normalize: bool | None = None,
        aux_loss_weight: float = 1e-2,
        z_loss_weight: float = 1e-3,
        group: comm.Group | None = None,
    ) -> None:
        super().__init__()
        if num_experts < 1 or not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: top_k={top_k} must be between 1 and num_experts={num_experts}")
        self.group = comm.resolve(group) if group is not None else None
        ranks = self.group.size if self.group is not None else 1
        if num_experts % ranks:
            raise ValueError(f"MoE: num_experts={num_experts} does not split over {ranks} expert-parallel ranks")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"MoE: capacity_factor={capacity_factor} must be positive (None: no drops)")
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.normalize = top_k > 1 if normalize is None else normalize
        self.aux_loss_weight, self.z_loss_weight = aux_loss_weight, z_loss_weight
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts // ranks, d_model, ff_dim, activation)
        self.aux_loss: torch.Tensor | None = None
        self.stats: RoutingStats | None = None

    def capacity(self, tokens: int) -> int | None:
        """Slots per expert for ``tokens`` tokens (None: unbounded)."""
        if self.capacity_factor is None:
            return None
        return max(1, math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logits [T, E] fp32, probabilities [T, E], weights [T, k], experts [T, k])`` of the
        tokens ``x`` [T, d]."""
        logits = self.router(x).float()
        probs = logits.softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, probs, weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        count, e, k = tokens.shape[0], self.num_experts, self.top_k
        logits, probs, weights, experts = self.route(tokens)
        # assignments in serving order: every token's first choice, then every second choice
        chosen = experts.t().reshape(-1)
        token = torch.arange(count, device=x.device).repeat(k)
        weight = weights.t().reshape(-1)
        one_hot = F.one_hot(chosen, e)
        position = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1) - 1  # place in its expert's queue
        routed = one_hot.sum(dim=0)
        capacity = self.capacity(count)
        slots = capacity if capacity is not None else self._fullest(routed)
        kept = position < slots
        slot = (chosen * slots + position)[kept]
        buffer = tokens.new_zeros(e * slots, shape[-1]).index_copy(0, slot, tokens[token[kept]])
        out = self._compute(buffer.view(e, slots, shape[-1])).reshape(e * slots, shape[-1])
        combined = out[slot] * weight[kept].unsqueeze(-1).to(out.dtype)
        y = tokens.new_zeros(count, shape[-1]).index_add(0, token[kept], combined)
        load_balance = e * (routed.float() / (count * k) * probs.mean(dim=0)).sum()
        z_loss = torch.logsumexp(logits, dim=-1).square().mean()
        self.aux_loss = self.aux_loss_weight * load_balance + self.z_loss_weight * z_loss
        per_expert = F.one_hot(chosen[kept], e).sum(dim=0)
        self.stats = RoutingStats(per_expert.detach(), int((~kept).sum()), capacity, load_balance.detach(),
                                  z_loss.detach())  # fmt: skip
        return y.view(shape)

    def _fullest(self, routed: torch.Tensor) -> int:
        """The most assignments any expert got here, or on any rank of the expert group."""
        most = routed.max().reshape(1)
        if self.group is not None and self.group.size > 1:
            most = comm.all_reduce(most.clone(), self.group, op="max")
        return max(1, int(most))

    def _compute(self, buffer: torch.Tensor) -> torch.Tensor:
        """The experts' outputs for ``buffer`` [experts, slots, d]: here, or on the ranks that hold
        them (all-to-all there and back)."""
        if self.group is None or self.group.size == 1:
            return self.experts(buffer)
        here = comm.all_to_all_forward_all_to_all_backward(buffer, self.group, 0, 1)  # [local, size*slots, d]
        return comm.all_to_all_forward_all_to_all_backward(self.experts(here), self.group, 1, 0)


def auxiliary_loss(model: nn.Module) -> torch.Tensor | None:
    """The sum of the auxiliary losses of ``model``'s MoE layers from their last forward (None:
    no MoE layer ran). Add it to the training loss."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoE) and m.aux_loss is not None]
    if not losses:
        return None
    total = losses[0]
    for loss in losses[1:]:
        total = total + loss
    return total


__all__ = ["GroupedExperts", "MoE", "RoutingStats", "auxiliary_loss"]
