"""Layer 2: the parallel layout (``ParallelDims``), its process groups (``ParallelContext``)
and per-axis random streams."""

from tessera.context.context import ParallelContext, get_context, has_context, set_context
from tessera.context.dims import (
    BASE_AXES,
    TENSOR_MODES,
    ParallelDims,
    check_tensor_layout,
    group_table,
    group_tables,
    integer_root,
)
from tessera.context.rng import RNGStreams, seed_all

__all__ = [
    "BASE_AXES",
    "TENSOR_MODES",
    "ParallelContext",
    "ParallelDims",
    "RNGStreams",
    "check_tensor_layout",
    "get_context",
    "group_table",
    "group_tables",
    "has_context",
    "integer_root",
    "seed_all",
    "set_context",
]
