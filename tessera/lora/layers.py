"""A low-rank adapter beside a frozen linear layer (Hu et al., 2021): ``y = base(x) + B(A(x)) *
alpha / r``, ``A [r, in]`` and ``B [out, r]`` the only trained weights.

:class:`LoraLinear` wraps ``nn.Linear``, transformers' ``Conv1D`` (weight ``[in, out]``) and their
tensor-parallel stand-ins. Its names are PEFT's (``base_layer``, ``lora_A``, ``lora_B``), so an
adapter's keys are the ones PEFT saves. Under tensor parallelism (:meth:`LoraLinear.rebase`) the
adapter is split with its base so that it adds no collective per token:

- column-parallel base (weight split on ``out``): ``B`` is split on ``out`` like the base, ``A``
  is whole; the adapter runs on the base's input inside the tensor region, whose backward
  already sums the input's gradient, and ``A``'s gradient (partial on each rank: it sees only
  this rank's outputs) is summed over the tensor group once per backward (``r x in``);
- row-parallel base (weight split on ``in``): ``A`` is split on ``in`` like the base, ``B`` is
  whole; ``B(A_k(x_k))`` is added to the base's partial product before its all-reduce (or
  reduce-scatter), which sums the ranks' parts, and ``B``'s gradient is summed over the tensor
  group once per backward (``out x r``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tessera import comm
from tessera.errors import ConfigError
from tessera.parallel.tensor.common import ShardSpec, local_range, shard_parameter
from tessera.parallel.tensor.tp1d.functional import TENSOR, row_parallel_linear

INITS = ("default", "gaussian", "zeros")


def linear_features(layer: nn.Module) -> tuple[int, int, bool] | None:
    """``(in, out, transposed)`` of a linear-like layer (``nn.Linear``, transformers' ``Conv1D``,
    tessera's tensor-parallel linears: their full sizes), else None."""
    module: Any = layer
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return module.weight.shape[0], module.weight.shape[1], True
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    if type(module).__name__ in ("ColumnParallel", "RowParallel"):  # tessera.hf's stand-ins
        return module.in_features, module.out_features, bool(module.transposed)
    if type(module).__name__ == "QuantizedLinear":
        return module.in_features, module.out_features, False
    return None


class LoraLinear(nn.Module):
    """``base_layer`` (frozen) plus a rank-``rank`` adapter scaled by ``alpha / rank``;
    ``dropout`` on the adapter's input; ``init``: ``"default"`` (``A`` Kaiming-uniform as
    ``nn.Linear`` initialises, ``B`` zero: the model starts unchanged, as PEFT's default),
    ``"gaussian"`` (``A`` normal with std ``1/rank``, ``B`` zero) or ``"zeros"``."""

    def __init__(
        self, base_layer: nn.Module, rank: int, alpha: float, dropout: float = 0.0, init: str = "default"
    ) -> None:
        super().__init__()
        features = linear_features(base_layer)
        if features is None:
            raise TypeError(f"{type(base_layer).__name__} is not a linear layer LoRA can adapt")
        self.in_features, self.out_features, self.transposed = features  # transposed: a Conv1D base
        if not 0 < rank <= min(self.in_features, self.out_features):
            raise ValueError(
                f"lora.rank={rank} must be between 1 and the layer's smaller dimension "
                f"(in {self.in_features}, out {self.out_features})"
            )
        if init not in INITS:
            raise ValueError(f"lora.init={init!r}: expected one of {', '.join(INITS)}")
        self.base_layer = base_layer
        for p in base_layer.parameters():
            p.requires_grad_(False)
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.lora_dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.Linear(self.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False)
        self.enabled = True
        self.split = "none"  # how the adapter is split over the tensor group: "none", "column", "row"
        self._group: Any = None  # the tensor group, once split
        with torch.no_grad():
            if init == "default":
                nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
            elif init == "gaussian":
                nn.init.normal_(self.lora_A.weight, std=1 / rank)
            else:
                nn.init.zeros_(self.lora_A.weight)
            nn.init.zeros_(self.lora_B.weight)

    # ---- splitting with the base -----------------------------------------------------------------
    def rebase(self, make: Callable[[nn.Module], nn.Module]) -> dict[int, torch.Tensor]:
        """The base becomes ``make(base)`` (its tensor-parallel stand-in, holding its ``ctx``)
        and the adapter is split with it (module docstring). Returns the adapter's replaced
        parameters (old id -> new), for the optimizer to follow (the caller records the base's)."""
        if type(self.base_layer).__name__ == "QuantizedLinear":
            raise ConfigError(
                "a quantized frozen base cannot be split by tensor parallelism (its codes are blocks of the "
                "whole weight); layouts that train it: data parallelism, ZeRO 1-3 and Gemini (parallel.tensor.size=1)"
            )
        new_base = make(self.base_layer)
        kind = type(new_base).__name__
        ctx: Any = new_base.ctx
        if kind == "ColumnParallel":  # B split on out as the base (each fused part on its own); A whole
            split, whole = self.lora_B, self.lora_A
            groups: Any = new_base.groups
            spec = ShardSpec((self.out_features, self.rank), ((TENSOR,), ()), (groups, 1))
        elif kind == "RowParallel":  # A split on in as the base; B whole
            split, whole = self.lora_A, self.lora_B
            spec = ShardSpec((self.rank, self.in_features), ((), (TENSOR,)))
        else:
            raise TypeError(f"LoRA adapters do not yet follow a base split as {kind}")
        old = split.weight
        split.weight = shard_parameter(old, spec, ctx)
        self.split = "column" if kind == "ColumnParallel" else "row"
        self.base_layer, self._group = new_base, ctx.group(TENSOR)
        # the whole factor's gradient is partial on each rank (it sees this rank's part): summed
        whole.weight.register_hook(self._summed)
        return {id(old): split.weight}

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not self.enabled:
            return self.base_layer(x, *args, **kwargs)
        if self.split == "row":
            return self._row_forward(x)
        return self.base_layer(x, *args, **kwargs) + self._adapter(x)

    def _adapter(self, x: torch.Tensor) -> torch.Tensor:
        """``B A x * alpha / r`` through the factor modules (so that hooks on them run: ZeRO-3
        gathers their chunks), PEFT's order of operations."""
        return self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def _summed(self, grad: torch.Tensor) -> torch.Tensor:
        """A factor's gradient, partial on each tensor rank, summed over the group."""
        return comm.all_reduce(grad.clone(), self._group)

    def _row_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The row-parallel base's arithmetic with the adapter's part added before the sum."""
        base: Any = self.base_layer
        group = self._group
        _, valid = local_range(self.in_features, group.size, group.rank)
        width = self.lora_A.weight.shape[1]  # this rank's block of A, padded as the base's

        def adapter(x: torch.Tensor) -> torch.Tensor:  # padding columns: zeros for A's block
            return self._adapter(F.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x)

        weight = base.weight.t() if base.transposed else base.weight
        return row_parallel_linear(
            x, weight, base.bias, group, valid_in=valid, sequence_parallel=base.sequence_parallel, adapter=adapter
        )

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}, split={self.split}, enabled={self.enabled}"


__all__ = ["INITS", "LoraLinear", "linear_features"]
