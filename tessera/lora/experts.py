"""LoRA adapters on a mixture of experts' projections: each expert's ``w_in``, ``w_gate`` and
``w_out`` gets its own rank-``r`` adapter beside the frozen stacked weights of
:class:`~tessera.nn.moe.GroupedExperts`.

The factors of projection ``p`` are stacked like its weight: ``lora_A.p.weight [experts, r, in]``
and ``lora_B.p.weight [experts, out, r]``, so expert ``e``'s are ``nn.Linear`` weights
(``A[e]``, ``B[e]``, PEFT's shapes) and all experts' adapters run as two batched products over the
``[experts, slots, in]`` buffer the experts already compute on.

Split with the experts. Over the ``expert`` axis both factors are cut on the expert dimension as
the weights are: each rank's experts' adapters live with them, and their gradients are reduced
as experts' (the reduction contract, ``tessera.context.reduction``: summed over the ranks holding
the same experts, not over the expert axis). Over the 1D ``tensor`` axis (each expert's hidden
width split) they follow the projection as :class:`~tessera.lora.layers.LoraLinear` follows a
column- or row-parallel base: ``w_in``/``w_gate`` (split on ``out``) have ``B`` split on ``out``
and ``A`` whole, ``w_out`` (split on ``in``) has ``A`` split on ``in`` and ``B`` whole; the
adapter's term is added to the projection inside the tensor region (before ``w_out``'s sum), and
the whole factor's gradient, partial on each tensor rank, is summed over the tensor group once
per backward (``r x d_model`` per expert and projection). Nothing more moves per token.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from torch import nn

from tessera.context.placement import ShardSpec, placement_of
from tessera.lora.layers import adapter_beside, summed_gradient
from tessera.nn.moe import GroupedExperts
from tessera.parallel.tensor.common import shard_parameter


class ExpertFactor(nn.Module):
    """One factor of every expert's adapter: ``weight [experts, out, in]``;
    ``[experts, slots, in]`` -> ``[experts, slots, out]``."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x, self.weight.transpose(1, 2))


class LoraExperts(nn.Module):
    """``base_layer`` (frozen :class:`GroupedExperts`) with a rank-``rank`` adapter, scaled by
    ``alpha / rank``, on each projection of each expert (module docstring); ``dropout`` and
    ``init`` as :class:`~tessera.lora.layers.LoraLinear`'s."""

    base_layer: GroupedExperts
    rank: int
    alpha: float
    scaling: float
    lora_dropout: nn.Module

    def __init__(
        self, base_layer: GroupedExperts, rank: int, alpha: float, dropout: float = 0.0, init: str = "default"
    ) -> None:
        super().__init__()
        adapter_beside(self, base_layer, rank, alpha, dropout, init)
        self.lora_A, self.lora_B = nn.ModuleDict(), nn.ModuleDict()
        self.enabled = True
        self._tensor = base_layer.tensor
        for name in ("w_in", "w_gate", "w_out"):
            weight = getattr(base_layer, name)
            if weight is not None:
                self._add(name, weight, init)

    def _add(self, name: str, weight: nn.Parameter, init: str) -> None:
        placement = placement_of(weight)
        experts, fan_in, fan_out = placement.full_shape(weight)
        if not 0 < self.rank <= min(fan_in, fan_out):
            raise ValueError(
                f"lora.rank={self.rank} must be between 1 and the experts' smaller dimension "
                f"({name}: in {fan_in}, out {fan_out})"
            )
        a, b = torch.empty(experts, self.rank, fan_in), torch.zeros(experts, fan_out, self.rank)
        for block in a:  # each expert's A as its own nn.Linear(in, r) would draw it
            if init == "default":
                nn.init.kaiming_uniform_(block, a=math.sqrt(5))
            elif init == "gaussian":
                nn.init.normal_(block, std=1 / self.rank)
            else:
                nn.init.zeros_(block)
        spec, ctx = placement.shard, placement.mesh
        if spec is None or ctx is None:
            self.lora_A[name], self.lora_B[name] = ExpertFactor(nn.Parameter(a)), ExpertFactor(nn.Parameter(b))
            return
        expert_axes, in_axes, out_axes = spec.dims
        a_param = shard_parameter(a, ShardSpec(tuple(a.shape), (expert_axes, (), in_axes)), ctx)
        b_param = shard_parameter(b, ShardSpec(tuple(b.shape), (expert_axes, out_axes, ())), ctx)
        self.lora_A[name], self.lora_B[name] = ExpertFactor(a_param), ExpertFactor(b_param)
        if self._tensor is not None:  # the factor held whole over the tensor axis sees this rank's part
            (b_param if in_axes else a_param).register_hook(partial(summed_gradient, groups=(self._tensor,)))

    def factor_shapes(self) -> dict[str, tuple[int, ...]]:
        """The full (single-process) shape of every factor by its key under this module
        (``"lora_A.w_in.weight": (experts, r, in)``, ...)."""
        shapes = {}
        for name, factor in [*(("lora_A." + n, f) for n, f in self.lora_A.items()),
                             *(("lora_B." + n, f) for n, f in self.lora_B.items())]:  # fmt: skip
            weight: Any = factor.weight
            shapes[name + ".weight"] = tuple(placement_of(weight).full_shape(weight))
        return shapes

    def delta(self, name: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """What projection ``name``'s full adapter factors ``a [experts, r, in]`` and
        ``b [experts, out, r]`` add to its stacked weight ``[experts, in, out]``."""
        return torch.bmm(b, a).transpose(1, 2) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[local experts, slots, d_model]`` -> the same (the experts' MLP with the adapters)."""
        return self.base_layer(x, adapter=self._adapter if self.enabled else None)

    def _adapter(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``B A x * alpha / r`` of projection ``name`` for every local expert at once."""
        return self.lora_B[name](self.lora_A[name](self.lora_dropout(x))) * self.scaling

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}, projections={list(self.lora_A)}, enabled={self.enabled}"


def is_adapter_target(module: Any) -> bool:
    """Whether ``module`` is a set of experts LoRA can adapt."""
    return isinstance(module, GroupedExperts)


def adapted_experts(model: nn.Module) -> list[tuple[str, LoraExperts]]:
    """``(name, layer)`` for every set of adapted experts of ``model``."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraExperts)]


__all__ = ["ExpertFactor", "LoraExperts", "adapted_experts", "is_adapter_target"]
