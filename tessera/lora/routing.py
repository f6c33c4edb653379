"""Many LoRA adapters over one frozen base, chosen per token: what multi-adapter serving needs
(S-LoRA, Sheng et al., 2023; vLLM's LoRA). One step's batch mixes sequences of different
adapters and of the base alone; each adapted layer computes its base once for every token and
adds to each token the delta of its own adapter, ``B_i A_i x * scaling_i``.

- :class:`AdapterRouting`: which adapter each token of the step uses (``-1``: none), as the
  groups of token rows per adapter, made once per step and read by every routed layer of the
  model (one object, given to each layer when it is made);
- :func:`routed_delta`: the functional core, the deltas of ``[N, in]`` tokens by group
  (``None`` when no token here has an adapter);
- :class:`RoutedLoraLinear`: a base layer (``nn.Linear``, ``Conv1D``, their 1D tensor-parallel
  stand-ins, int8-quantized or not) with any number of adapters, of any ranks, each adapter
  present only in the layers it targets. Under 1D tensor parallelism the factors are split as
  :class:`~tessera.lora.layers.LoraLinear` splits them (``B`` on ``out`` under a
  column-parallel base; ``A`` on ``in`` under a row-parallel one, its partial delta added to the
  base's partial product before the one all-reduce), so routing adds no collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

NO_ADAPTER = -1
SPLITS = ("none", "column", "row")

Factors = tuple[torch.Tensor, torch.Tensor, float]  # A [r, in], B [out, r], scaling


class AdapterRouting:
    """The adapter of each token of a step, grouped: ``groups`` is a list of ``(adapter, rows)``,
    ``rows`` the flat token indices (``[S * T]`` order) that use ``adapter``, or None when every
    token does. ``count`` adapters exist (indices ``0 .. count-1``)."""

    def __init__(self, count: int, device: torch.device | str = "cpu") -> None:
        self.count, self.device = count, torch.device(device)
        self.tokens = 0
        self.groups: list[tuple[int, torch.Tensor | None]] = []

    def route(self, per_sequence: Sequence[int], width: int) -> None:
        """The step's sequences ``s`` use adapter ``per_sequence[s]`` (``-1``: none) for each of
        their ``width`` tokens (a step's ``[S, T]`` batch, rows ``s * T .. s * T + T - 1``)."""
        ids = np.asarray(per_sequence, dtype=np.int64).reshape(-1)
        bad = ids[(ids < NO_ADAPTER) | (ids >= self.count)]
        if bad.size:
            raise ValueError(
                f"adapter {int(bad[0])} does not exist: {self.count} adapters (0..{self.count - 1}, -1: none)"
            )
        self.tokens = int(ids.size) * width
        self.groups = []
        for adapter in np.unique(ids[ids != NO_ADAPTER]).tolist():
            sequences = np.flatnonzero(ids == adapter)
            if sequences.size == ids.size:
                self.groups.append((adapter, None))
                continue
            rows = (sequences[:, None] * width + np.arange(width)).reshape(-1)
            self.groups.append((adapter, torch.from_numpy(rows).to(self.device)))

    def clear(self) -> None:
        """No adapter for anything (the base alone)."""
        self.tokens, self.groups = 0, []


def routed_delta(
    x: torch.Tensor, groups: Sequence[tuple[int, torch.Tensor | None]], factors: dict[int, Factors]
) -> torch.Tensor | None:
    """``x [N, in]`` -> ``[N, out]``: row ``n`` gets ``B_a A_a x_n * scaling_a`` of its group's
    adapter ``a`` (groups whose adapter has no factors here get nothing), zeros elsewhere; None
    when no group has factors here. Each group's rows are gathered once and go through its two
    small matmuls (PEFT's order: ``A`` first)."""
    delta: torch.Tensor | None = None
    for adapter, rows in groups:
        if adapter not in factors:
            continue
        a, b, scaling = factors[adapter]
        if rows is None:  # every token: no gather
            part = F.linear(F.linear(x, a), b) * scaling
            delta = part if delta is None else delta + part
            continue
        part = F.linear(F.linear(x.index_select(0, rows), a), b) * scaling
        if delta is None:
            delta = x.new_zeros(x.shape[0], b.shape[0])
        delta.index_add_(0, rows, part)
    return delta


class RoutedLoraLinear(nn.Module):
    """``base_layer`` plus the adapters :meth:`add` gives it, each token's delta chosen by
    ``routing``. ``split``: how the factors are split with a tensor-parallel base (``"none"``,
    ``"column"``: ``B`` holds this rank's outputs; ``"row"``: ``A`` holds this rank's valid
    inputs and the base takes the delta as its ``adapter``). The base stays as it is, so its
    own hooks (int8 weights dequantized at each call) keep working."""

    def __init__(self, base_layer: nn.Module, routing: AdapterRouting, split: str = "none") -> None:
        super().__init__()
        if split not in SPLITS:
            raise ValueError(f"split={split!r}: expected one of {', '.join(SPLITS)}")
        self.base_layer, self.routing, self.split = base_layer, routing, split
        self.factors: dict[int, Factors] = {}

    def add(self, adapter: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        """Adapter ``adapter``'s factors on this rank: ``a [r, in_here]``, ``b [out_here, r]``."""
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"adapter {adapter}: A {tuple(a.shape)} and B {tuple(b.shape)} are not [r, in] and [out, r]"
            )
        self.factors[adapter] = (a, b, float(scaling))

    def _delta(self, x: torch.Tensor) -> torch.Tensor | None:
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] != self.routing.tokens:
            raise RuntimeError(
                f"the adapter routing is for {self.routing.tokens} tokens, the layer got {flat.shape[0]}: "
                "route each step's batch before running the model"
            )
        delta = routed_delta(flat, self.routing.groups, self.factors)
        return None if delta is None else delta.view(*x.shape[:-1], delta.shape[-1])

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.split == "row":  # added to the base's partial product, before its all-reduce
            used = any(adapter in self.factors for adapter, _ in self.routing.groups)
            return self.base_layer(x, *args, adapter=self._delta if used else None, **kwargs)
        y = self.base_layer(x, *args, **kwargs)
        delta = self._delta(x)
        return y if delta is None else y + delta

    def extra_repr(self) -> str:
        ranks = {adapter: a.shape[0] for adapter, (a, _, _) in sorted(self.factors.items())}
        return f"split={self.split}, ranks={ranks}"


__all__ = ["NO_ADAPTER", "AdapterRouting", "RoutedLoraLinear", "routed_delta"]
