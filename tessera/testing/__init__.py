"""Helpers for testing parallel code: rank pools, cached layouts inside them, and tolerances for
comparing a result computed two ways."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any, overload

import torch
import torch.distributed as dist

from tessera.config import load_config, parallel_dims
from tessera.context import ParallelContext, ParallelDims
from tessera.context import hosts as host_map
from tessera.session import set_session
from tessera.testing.draws import (
    Draw,
    assert_draws_clear,
    greedy_draws,
    recorded_draws,
    recorded_routes,
    route_draws,
)
from tessera.testing.pool import PoolSet, RankFailure, RankPool, free_port
from tessera.testing.tolerance import tolerance, within

# (job ranks, or None for the whole job; layout; device; the job's hosts as discovered) -> the
# context, None on a rank outside. A context keeps the hosts it was built under (its groups by
# host follow them), so a test that simulates hosts (``hosts.discover(hostname=...)``) gets its own.
_ContextKey = tuple[tuple[int, ...] | None, ParallelDims, torch.device, tuple[int, ...] | None]
_contexts: dict[_ContextKey, ParallelContext | None] = {}


@overload
def use_layout(
    *,
    data: int | None = None,
    pipeline: int = 1,
    sequence: int = 1,
    tensor: int = 1,
    mode: str = "1d",
    depth: int = 1,
    sequence_parallel: bool | None = None,
    keep_blocks: bool | None = None,
    sequence_mode: str | None = None,
    expert: int = 1,
    seed: int = 42,
    config: Any = None,
    device: str | torch.device = "cpu",
    ranks: None = None,
) -> ParallelContext: ...


@overload
def use_layout(
    *,
    data: int | None = None,
    pipeline: int = 1,
    sequence: int = 1,
    tensor: int = 1,
    mode: str = "1d",
    depth: int = 1,
    sequence_parallel: bool | None = None,
    keep_blocks: bool | None = None,
    sequence_mode: str | None = None,
    expert: int = 1,
    seed: int = 42,
    config: Any = None,
    device: str | torch.device = "cpu",
    ranks: Sequence[int],
) -> ParallelContext | None: ...


def use_layout(
    *,
    data: int | None = None,
    pipeline: int = 1,
    sequence: int = 1,
    tensor: int = 1,
    mode: str = "1d",
    depth: int = 1,
    sequence_parallel: bool | None = None,
    keep_blocks: bool | None = None,
    sequence_mode: str | None = None,
    expert: int = 1,
    seed: int = 42,
    config: Any = None,
    device: str | torch.device = "cpu",
    ranks: Sequence[int] | None = None,
) -> ParallelContext | None:
    """Make a context for this layout current on this rank (built once per pool, then reused).

    Collective the first time: every rank of the pool must ask for the same layout (a context
    is cached per layout and per hosts map, :func:`tessera.context.hosts.discover`). With
    ``config`` (anything ``load_config`` takes) that config becomes the current run's, as after
    ``tessera.launch``; its ``parallel`` section must describe the same layout.
    ``sequence_parallel``, ``keep_blocks`` and ``sequence_mode`` left None are the config's
    (False, False and "ring" without one).
    ``device`` is where the context puts models and batches (``tessera.launch`` picks the
    rank's GPU under NCCL); one process can thus train on ``"cuda:0"`` without a process group.

    ``ranks`` puts the layout on those ranks of the pool alone
    (:meth:`ParallelContext.on_ranks`): the layout, and the config's ``parallel`` section, are
    then of a world of ``len(ranks)``. Every rank of the pool still calls it; the others get
    None, and their current context and config stay as they were.
    """
    chosen = tuple(ranks) if ranks is not None else None
    world = len(chosen) if chosen is not None else dist.get_world_size() if dist.is_initialized() else 1
    cfg = load_config(config) if config is not None else None
    if sequence_parallel is None:  # taken from the config when it has one
        sequence_parallel = cfg is not None and cfg.parallel.tensor.sequence_parallel
    if keep_blocks is None:
        keep_blocks = cfg is not None and cfg.parallel.tensor.keep_blocks
    if sequence_mode is None:
        sequence_mode = cfg.parallel.sequence.mode if cfg is not None else "ring"
    dims = ParallelDims(
        world, data, pipeline, sequence, tensor, mode, depth, sequence_parallel, keep_blocks, sequence_mode, expert
    )
    if cfg is not None and parallel_dims(cfg, world) != dims:  # on every rank, before any collective
        raise ValueError(f"config layout {parallel_dims(cfg, world)} differs from the requested {dims}")
    # the same process groups whatever the layers' options
    groups_key = dataclasses.replace(dims, sequence_parallel=False, keep_blocks=False, sequence_mode="ring")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (chosen, groups_key, device, host_map.host_of())
    if key not in _contexts:
        if chosen is None:
            _contexts[key] = ParallelContext(groups_key, device=device, seed=seed)
        else:
            _contexts[key] = ParallelContext.on_ranks(chosen, groups_key, device=device, seed=seed)
    ctx = _contexts[key]
    if ctx is None:  # a rank outside ``ranks``
        return None
    if dims != groups_key:
        ctx = copy.copy(ctx)
        ctx.dims = dims
    set_session(ctx, cfg)  # tessera.initialize reads the config from the session
    return ctx


__all__ = [
    "Draw",
    "PoolSet",
    "RankFailure",
    "RankPool",
    "assert_draws_clear",
    "free_port",
    "greedy_draws",
    "recorded_draws",
    "recorded_routes",
    "route_draws",
    "tolerance",
    "use_layout",
    "within",
]
