"""The registry of tensor-parallel modes: one :class:`~tessera.parallel.tensor.mode.TensorMode`
per ``parallel.tensor.mode``, and the single-rank mode for a tensor group of one rank.

``tessera.nn`` dispatches through :func:`mode_of`; the names are the ones
``tessera.context.dims.TENSOR_MODES`` validates (a unit test keeps the two equal).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from tessera.context import ParallelContext
from tessera.parallel.tensor.mode import TensorMode
from tessera.parallel.tensor.plain import SINGLE_RANK
from tessera.parallel.tensor.tp1d import MODE_1D
from tessera.parallel.tensor.tp2d import MODE_2D
from tessera.parallel.tensor.tp2p5d import MODE_2P5D
from tessera.parallel.tensor.tp3d import MODE_3D

__all__ = ["MODES", "SINGLE_RANK", "TensorMode", "mode_of"]

MODES: Mapping[str, TensorMode] = MappingProxyType({m.name: m for m in (MODE_1D, MODE_2D, MODE_2P5D, MODE_3D)})


def mode_of(ctx: ParallelContext | None) -> TensorMode:
    """The mode whose layers ``ctx`` runs: its ``tensor_mode``, or :data:`SINGLE_RANK` (plain torch
    layers) without a context or with a tensor group of one rank."""
    if ctx is None or ctx.size("tensor") == 1:
        return SINGLE_RANK
    return MODES[ctx.dims.tensor_mode]
