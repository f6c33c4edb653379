"""One entry for a family's layout in any tensor mode: :func:`apply_layout` rewrites the model
by 1D (:func:`~tessera.hf.decoder.apply_1d`) or by the grid modes
(:func:`~tessera.hf.grid.apply_grid`); :func:`heads_rule` checks that attention heads split
into whole heads per rank."""

from __future__ import annotations

from typing import Any

from torch import nn

from tessera.context import ParallelContext
from tessera.hf.decoder import Layout, apply_1d
from tessera.hf.grid import apply_grid, head_parts

__all__ = ["MODES", "apply_layout", "cross_attention_rule", "heads_rule"]

MODES = ("1d", "2d", "2.5d", "3d")


def apply_layout(model: Any, ctx: ParallelContext, layout: Layout) -> dict[int, nn.Parameter]:
    """Rewrite ``model`` for ``ctx``'s tensor mode; old parameter id -> new parameter."""
    if ctx.dims.tensor_mode == "1d":
        return apply_1d(model, ctx, layout)
    return apply_grid(model, ctx, layout)


def heads_rule(ctx: ParallelContext, **counts: int) -> list[str]:
    """The rule that each count (``num_attention_heads=12``, ...) splits into whole parts: by the
    tensor size in 1D, by the hidden dimension's blocks in a grid mode; broken rules as messages."""
    parts = head_parts(ctx)
    mode = ctx.dims.tensor_mode
    by = (
        f"the tensor size ({parts})"
        if mode == "1d"
        else f"the {parts} blocks tensor mode {mode!r} splits the hidden dimension into"
    )
    return [f"{name} ({count}) must be divisible by {by}" for name, count in counts.items() if count % parts]


def cross_attention_rule(config: Any) -> list[str]:
    """A decoder with cross-attention (``add_cross_attention=True``) has no policy: as a message."""
    if getattr(config, "add_cross_attention", False):
        return ["cross-attention (add_cross_attention=True) has no tensor-parallel policy"]
    return []
