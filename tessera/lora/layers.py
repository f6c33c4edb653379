"""A low-rank adapter beside a frozen linear layer (Hu et al., 2021): ``y = base(x) + B(A(x)) *
alpha / r``, ``A [r, in]`` and ``B [out, r]`` the only trained weights.

:class:`LoraLinear` wraps ``nn.Linear``, transformers' ``Conv1D`` (weight ``[in, out]``), the
tensor-parallel stand-ins of ``tessera.hf`` and tessera's own tensor-parallel linears (1D
``Linear1D_Col``/``Linear1D_Row``, the grid modes' ``Linear2D``/``Linear2p5D``/``Linear3D``). Its
names are PEFT's (``base_layer``, ``lora_A``, ``lora_B``), so an adapter's keys are the ones PEFT
saves. Under tensor parallelism the adapter is split with its base, whether the base was split
before the adapter was put on (tessera's models, built in their layout) or after
(:meth:`LoraLinear.rebase`, ``tessera.hf``'s policies):

- column-parallel base (weight split on ``out``): ``B`` is split on ``out`` like the base (each
  fused part on its own), ``A`` is whole; the adapter runs on the base's input inside the tensor
  region, whose backward already sums the input's gradient, and ``A``'s gradient (partial on each
  rank: it sees only this rank's outputs) is summed over the tensor group once per backward
  (``r x in``);
- row-parallel base (weight split on ``in``): ``A`` is split on ``in`` like the base, ``B`` is
  whole; ``B(A_k(x_k))`` is added to the base's partial product before its all-reduce (or
  reduce-scatter), which sums the ranks' parts, and ``B``'s gradient is summed over the tensor
  group once per backward (``out x r``);
- grid base (tessera's 2D, 2.5D, 3D linears): ``A`` is cut on ``in`` and ``B`` on ``out`` as
  the activations' hidden dimension (``B`` per fused part), both replicated over the batch
  blocks. ``A_h x_h`` is summed over the hidden groups (an all-reduce of ``r`` elements per
  token forward, and one backward), after which ``B_h`` gives this rank's hidden block of the
  output with no communication; both factors' gradients (partial: each rank saw its batch
  block) are summed over the batch groups once per backward (``r x in/H + out/H x r``, ``H``
  the hidden blocks). Where factors that are the mode's linears (``in -> r``, ``r -> out``)
  move fewer bytes (:func:`grid_linears_move_less`: a 3D layer narrower than ``(4 q - 2) r``,
  2.5D keeping its blocks), they are that instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tessera import comm
from tessera.comm import AxisGroup
from tessera.context.placement import placement_of
from tessera.errors import ConfigError
from tessera.parallel.tensor.common import (
    ShardSpec,
    all_reduce_forward_backward,
    local_range,
    local_shard,
    shard_parameter,
)
from tessera.parallel.tensor.modes import MODES
from tessera.parallel.tensor.tp1d.functional import (
    TENSOR,
    column_parallel_linear,
    gather_last_dim,
    row_parallel_linear,
    split_last_dim,
)
from tessera.parallel.tensor.tp1d.layers import Linear1D_Col, Linear1D_Row
from tessera.parallel.tensor.tp2d.layers import Linear2D
from tessera.parallel.tensor.tp2p5d.layers import Linear2p5D
from tessera.parallel.tensor.tp3d.layers import Linear3D

INITS = ("default", "gaussian", "zeros")

#: tessera's own tensor-parallel linears an adapter follows (these classes exactly: not the
#: vocabulary-parallel heads built on them)
TESSERA_LINEARS: tuple[type[nn.Module], ...] = (Linear1D_Col, Linear1D_Row, Linear2D, Linear2p5D, Linear3D)


def linear_features(layer: nn.Module) -> tuple[int, int, bool] | None:
    """``(in, out, transposed)`` of a linear-like layer (``nn.Linear``, transformers' ``Conv1D``,
    tessera's tensor-parallel linears and ``tessera.hf``'s stand-ins: their full sizes), else None."""
    module: Any = layer
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return module.weight.shape[0], module.weight.shape[1], True
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    if type(module).__name__ in ("ColumnParallel", "RowParallel"):  # tessera.hf's stand-ins
        return module.in_features, module.out_features, bool(module.transposed)
    if type(module) in TESSERA_LINEARS or type(module).__name__ == "QuantizedLinear":
        return module.in_features, module.out_features, False
    return None


def split_of(base: nn.Module) -> tuple[str, int]:
    """How an adapter follows ``base``'s split: ``("column", fused parts)``, ``("row", 1)``,
    ``("grid", fused parts)`` or ``("none", 1)`` (a layer held whole)."""
    module: Any = base
    kind = type(module)
    if kind is Linear1D_Col:
        return "column", module.out_groups
    if kind.__name__ == "ColumnParallel":
        return "column", module.groups
    if kind is Linear1D_Row or kind.__name__ == "RowParallel":
        return "row", 1
    if kind in (Linear2D, Linear2p5D, Linear3D):
        return "grid", module.out_groups
    if type(module).__name__ == "GridLinear":  # tessera.hf's grid stand-in
        return "grid", module.groups
    return "none", 1


def grid_lines(base: nn.Module) -> tuple[tuple[AxisGroup, ...], tuple[AxisGroup, ...]]:
    """``(hidden, batch)``: the groups splitting a grid linear's activations' hidden dimension
    (outermost first, as its ``ShardSpec`` lists them) and its batch."""
    base = getattr(base, "kernel", base)  # tessera.hf's GridLinear: its mode layer's
    if isinstance(base, Linear3D):
        cube = base.cube
        return (cube.output, cube.input), (cube.weight,)
    grid: Any = base.grid
    return (grid.row,), tuple(grid.batch_groups)


def grid_linears_move_less(base: nn.Module, features: int, rank: int) -> bool:
    """Whether the adapter of grid base ``base`` (``in + out = features``) moves fewer bytes as
    two grid linears than cut as the hidden blocks (docs/lora.md: whatever the tokens): in 3D
    when ``in + out < (4 q - 2) r`` (``2 (q-1)/q^3 T (in + out + 2 r)`` against
    ``8 (q-1)/q^2 T r`` per step of ``T`` tokens, equal gradient terms); in 2.5D with
    ``keep_blocks`` over more than one grid (equal activation terms, the gradients' sum over the
    depth on ``1/q^2`` blocks instead of ``1/q``)."""
    kernel: Any = getattr(base, "kernel", base)  # tessera.hf's GridLinear: its mode layer
    if isinstance(kernel, Linear3D):
        return features < (4 * kernel.cube.q - 2) * rank
    return bool(kernel.keep_blocks) and kernel.grid.depth > 1


def summed_gradient(grad: torch.Tensor, groups: tuple[AxisGroup, ...]) -> torch.Tensor:
    """A factor's gradient, partial on each rank of ``groups``, summed over them."""
    grad = grad.clone()
    for group in groups:
        grad = comm.all_reduce(grad, group)
    return grad


QUANTIZED_SPLIT = (
    "a quantized frozen base cannot be split by tensor parallelism (its codes are blocks of the "
    "whole weight); layouts that train it: data parallelism, ZeRO 1-3 and Gemini (parallel.tensor.size=1)"
)


def adapter_beside(module: Any, base_layer: nn.Module, rank: int, alpha: float, dropout: float, init: str) -> None:
    """What every adapter module sets first: ``base_layer`` frozen, the rank, alpha and scaling
    ``alpha / rank``, the dropout on the adapter's input (``init`` checked)."""
    if init not in INITS:
        raise ValueError(f"lora.init={init!r}: expected one of {', '.join(INITS)}")
    module.base_layer = base_layer
    for p in base_layer.parameters():
        p.requires_grad_(False)
    module.rank, module.alpha, module.scaling = rank, alpha, alpha / rank
    module.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()


class LoraLinear(nn.Module):
    """``base_layer`` (frozen) plus a rank-``rank`` adapter scaled by ``alpha / rank``;
    ``dropout`` on the adapter's input; ``init``: ``"default"`` (``A`` Kaiming-uniform as
    ``nn.Linear`` initialises, ``B`` zero: the model starts unchanged, as PEFT's default),
    ``"gaussian"`` (``A`` normal with std ``1/rank``, ``B`` zero) or ``"zeros"``."""

    base_layer: nn.Module
    rank: int
    alpha: float
    scaling: float
    lora_dropout: nn.Module

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
        adapter_beside(self, base_layer, rank, alpha, dropout, init)
        self.lora_A = nn.Linear(self.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False)
        self.enabled = True
        # how the adapter is split with its base: "none", "column", "row", "grid" (hidden blocks) or
        # "grid-linear" (its factors the grid mode's linears, where they move less)
        self.split = "none"
        self._group: Any = None  # the tensor group, once split in 1D
        self._hidden: tuple[AxisGroup, ...] = ()  # the groups splitting the activations' hidden dimension (grid)
        with torch.no_grad():
            if init == "default":
                nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
            elif init == "gaussian":
                nn.init.normal_(self.lora_A.weight, std=1 / rank)
            else:
                nn.init.zeros_(self.lora_A.weight)
            nn.init.zeros_(self.lora_B.weight)
        if split_of(base_layer)[0] != "none":  # built split (tessera's models): every rank drew the full factors
            self._follow(base_layer)

    # ---- splitting with the base -----------------------------------------------------------------
    def rebase(self, make: Callable[[nn.Module], nn.Module]) -> dict[int, torch.Tensor]:
        """The base becomes ``make(base)`` (its tensor-parallel stand-in, holding its ``ctx``)
        and the adapter is split with it (module docstring). Returns the adapter's replaced
        parameters (old id -> new), for the optimizer to follow (the caller records the base's)."""
        if type(self.base_layer).__name__ == "QuantizedLinear":
            raise ConfigError(QUANTIZED_SPLIT)
        return self._follow(make(self.base_layer))

    def _follow(self, base: nn.Module) -> dict[int, torch.Tensor]:
        """Make ``base`` (split over its ``ctx``) this layer's base and split the full factors
        with it (module docstring); old factor parameter id -> new."""
        kind, groups = split_of(base)
        ctx: Any = getattr(getattr(base, "kernel", base), "ctx", None)  # a GridLinear's is its kernel's
        if kind == "none" or ctx is None:
            raise TypeError(f"LoRA adapters do not follow a base split as {type(base).__name__}")
        self.base_layer, self.split = base, kind
        a_shape, b_shape = (self.rank, self.in_features), (self.out_features, self.rank)
        if kind == "grid" and grid_linears_move_less(base, self.in_features + self.out_features, self.rank):
            self.split = "grid-linear"
            return self._grid_linear_factors(ctx, groups)
        if kind == "grid":  # both cut as the activations' hidden blocks; each sees its batch block
            self._hidden, batch = grid_lines(base)
            axes = tuple(g.name for g in self._hidden)
            specs = {"lora_A": ShardSpec(a_shape, ((), axes)), "lora_B": ShardSpec(b_shape, (axes, ()), (groups, 1))}
            summed = {"lora_A": batch, "lora_B": batch}
        else:
            self._group = ctx.group(TENSOR)
            if kind == "column":  # B split on out as the base (each fused part on its own); A whole
                specs = {"lora_B": ShardSpec(b_shape, ((TENSOR,), ()), (groups, 1))}
            else:  # row: A split on in as the base; B whole
                specs = {"lora_A": ShardSpec(a_shape, ((), (TENSOR,)))}
            # the whole factor's gradient is partial on each rank (it sees this rank's part)
            summed = {"lora_B" if kind == "row" else "lora_A": (self._group,)}
        replaced: dict[int, torch.Tensor] = {}
        for name, spec in specs.items():
            factor = getattr(self, name)
            old = factor.weight
            factor.weight = shard_parameter(old, spec, ctx)
            replaced[id(old)] = factor.weight
        for name, over in summed.items():
            getattr(self, name).weight.register_hook(partial(summed_gradient, groups=over))
        return replaced

    def _grid_linear_factors(self, ctx: Any, groups: int) -> dict[int, torch.Tensor]:
        """``A`` and ``B`` as the grid mode's linears (``in -> r``, ``r -> out`` with the base's
        fused parts), holding their blocks of the full factors; their layers sum the gradients."""
        replaced: dict[int, torch.Tensor] = {}
        for name, (fan_in, fan_out, parts) in {
            "lora_A": (self.in_features, self.rank, 1),
            "lora_B": (self.rank, self.out_features, groups),
        }.items():
            old = getattr(self, name).weight
            layer = MODES[ctx.dims.tensor_mode].linear(fan_in, fan_out, False, out_groups=parts, ctx=ctx)
            weight: Any = layer.weight
            spec = placement_of(weight).shard
            assert spec is not None
            with torch.no_grad():
                weight.copy_(local_shard(old.detach(), spec, ctx))
            setattr(self, name, layer)
            replaced[id(old)] = weight
        return replaced

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not self.enabled:
            return self.base_layer(x, *args, **kwargs)
        if self.split == "row":
            return self._row_forward(x)
        if self.split == "column" and type(self.base_layer) is Linear1D_Col:
            return self._column_forward(x)
        if self.split == "grid":
            return self.base_layer(x, *args, **kwargs) + self._grid_adapter(x)
        return self.base_layer(x, *args, **kwargs) + self._adapter(x)

    def _adapter(self, x: torch.Tensor) -> torch.Tensor:
        """``B A x * alpha / r`` through the factor modules (so that hooks on them run: ZeRO-3
        gathers their chunks), PEFT's order of operations."""
        return self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def _grid_adapter(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter on a grid base: ``A``'s block times this rank's hidden block of ``x``,
        summed over the hidden groups (``[..., r]`` whole: forward and backward, ``r`` elements
        per token each), then ``B``'s block gives this rank's hidden block of the output."""
        u = self.lora_A(self.lora_dropout(x))
        for group in self._hidden:
            u = all_reduce_forward_backward(u, group)
        return self.lora_B(u) * self.scaling

    def _column_forward(self, x: torch.Tensor) -> torch.Tensor:
        """tessera's column-parallel base (which enters the tensor region itself) with the
        adapter on its input inside the region."""
        base: Any = self.base_layer
        y = column_parallel_linear(
            x, base.weight, base.bias, self._group, sequence_parallel=base.sequence_parallel, adapter=self._adapter
        )
        return gather_last_dim(y, self._group, self.out_features, base.out_groups) if base.gather_output else y

    def _row_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The row-parallel base's arithmetic with the adapter's part added before the sum."""
        base: Any = self.base_layer
        group = self._group
        if not getattr(base, "input_is_parallel", True):  # tessera's Linear1D_Row fed a whole input
            x = split_last_dim(x, group)
        _, valid = local_range(self.in_features, group.size, group.rank)
        width = self.lora_A.weight.shape[1]  # this rank's block of A, padded as the base's

        def adapter(x: torch.Tensor) -> torch.Tensor:  # padding columns: zeros for A's block
            return self._adapter(F.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x)

        weight = base.weight.t() if getattr(base, "transposed", False) else base.weight
        return row_parallel_linear(
            x, weight, base.bias, group, valid_in=valid, sequence_parallel=base.sequence_parallel, adapter=adapter
        )

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}, split={self.split}, enabled={self.enabled}"


__all__ = [
    "INITS",
    "QUANTIZED_SPLIT",
    "TESSERA_LINEARS",
    "LoraLinear",
    "grid_lines",
    "grid_linears_move_less",
    "linear_features",
    "split_of",
    "summed_gradient",
]
