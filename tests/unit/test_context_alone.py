"""``ParallelContext.alone``: a context of this process by itself, made without any process group
and without touching the current context (tests/dist/test_rlhf_rollout.py uses it on each rank
of a running 2-rank job)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tessera import comm
from tessera.context import BASE_AXES, EXPERT_AXES, ParallelContext, ParallelDims, get_context, has_context, set_context


def test_a_context_alone_has_every_axis_of_one_rank():
    assert not dist.is_initialized()
    ctx = ParallelContext.alone("cpu", seed=7)
    assert (ctx.rank, ctx.world_size, ctx.backend, ctx.device) == (0, 1, None, torch.device("cpu"))
    assert ctx.dims == ParallelDims(world_size=1)
    for axis in (*BASE_AXES, *EXPERT_AXES, "world"):
        group = ctx.group(axis)
        assert (group.ranks, group.rank, group.pg, ctx.size(axis)) == ((0,), 0, None, 1), axis
    assert ctx.replicas.size == ctx.expert_replicas.size == 1
    assert ctx.side_group("writer").pg is None
    assert ctx.rng.base_seed == 7
    x = torch.arange(4.0)
    assert comm.all_reduce(x.clone(), ctx.group("world")).equal(x)  # a single-rank collective returns at once
    assert repr(ctx) == "ParallelContext(rank=0/1, single rank, mode=1d)"


def test_a_context_alone_is_the_one_a_single_process_layout_builds():
    built = ParallelContext(ParallelDims(world_size=1), device=torch.device("cpu"), seed=3)
    alone = ParallelContext.alone(torch.device("cpu"), seed=3)
    for axis in (*BASE_AXES, *EXPERT_AXES, "world"):
        a, b = alone.group(axis), built.group(axis)
        assert (a.name, a.ranks, a.rank, a.pg) == (b.name, b.ranks, b.rank, b.pg)
    assert alone.coordinates == built.coordinates
    assert alone.rng.seed_for("data", "tensor") == built.rng.seed_for("data", "tensor")


def test_a_context_alone_does_not_become_the_current_one():
    previous = get_context() if has_context() else None
    current = ParallelContext(ParallelDims(world_size=1))
    set_context(current)
    try:
        alone = ParallelContext.alone()
        assert get_context() is current and alone is not current
    finally:
        set_context(previous)
