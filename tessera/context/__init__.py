"""Layer 2: the parallel layout (``ParallelDims``), the layout rules (``rules.py``: which axes,
modes, schedules and strategies combine), its process groups (``ParallelContext``) and per-axis
random streams.

``ParallelDims`` and its checks need no torch; the rest loads on first use (PEP 562), so the
command line can validate a layout before torch is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tessera.context.dims import (
    BASE_AXES,
    EXPERT_AXES,
    TENSOR_MODES,
    ParallelDims,
    check_tensor_layout,
    group_table,
    group_tables,
    integer_root,
)
from tessera.context.rules import RULES, Combination, Rule, check_combination

_LAZY: dict[str, str] = {
    "ParallelContext": "tessera.context.context",
    "get_context": "tessera.context.context",
    "has_context": "tessera.context.context",
    "set_context": "tessera.context.context",
    "RNGStreams": "tessera.context.rng",
    "seed_all": "tessera.context.rng",
}

if TYPE_CHECKING:
    from tessera.context.context import ParallelContext, get_context, has_context, set_context
    from tessera.context.rng import RNGStreams, seed_all


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tessera.context' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "BASE_AXES",
    "EXPERT_AXES",
    "RULES",
    "TENSOR_MODES",
    "Combination",
    "ParallelContext",
    "ParallelDims",
    "RNGStreams",
    "Rule",
    "check_combination",
    "check_tensor_layout",
    "get_context",
    "group_table",
    "group_tables",
    "has_context",
    "integer_root",
    "seed_all",
    "set_context",
]
