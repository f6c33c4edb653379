"""``ParallelContext.on_ranks`` in one process without torch.distributed: the refusals it makes
before any group exists, and the one-rank context it builds over rank 0 (the job's only rank).
tests/dist/test_context_subsets.py runs contexts over parts of a 4-rank job."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tessera.context import BASE_AXES, ParallelContext, ParallelDims


def test_bad_rank_lists_are_refused_naming_the_ranks():
    assert not dist.is_initialized()
    two = ParallelDims(world_size=2, data=2)
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] appear more than once in \[1, 1\]"):
        ParallelContext.on_ranks([1, 1], two)
    with pytest.raises(ValueError, match=r"3 rank\(s\) \[0, 1, 2\] given for a layout of world size 2"):
        ParallelContext.on_ranks([0, 1, 2], two)
    with pytest.raises(ValueError, match="needs torch.distributed initialized"):
        ParallelContext.on_ranks([0, 1], two)
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] are outside the job's 1 rank\(s\) 0..0"):
        ParallelContext.on_ranks([1], ParallelDims(world_size=1))
    with pytest.raises(ValueError, match="must be integers"):
        ParallelContext.on_ranks([0.0], ParallelDims(world_size=1))  # type: ignore[list-item]


def test_a_context_on_every_rank_is_the_whole_job_one():
    dims = ParallelDims(world_size=1)
    on = ParallelContext.on_ranks(range(1), dims, device="cpu", seed=3, side_groups=["writer"])
    whole = ParallelContext(dims, device=torch.device("cpu"), seed=3)
    assert on is not None
    assert (on.rank, on.global_rank, on.job_ranks, on.world_size) == (0, 0, (0,), 1)
    assert whole.job_ranks == (0,) and whole.global_rank == 0
    for axis in (*BASE_AXES, "world"):
        a, b = on.group(axis), whole.group(axis)
        assert (a.name, a.ranks, a.rank, a.pg) == (b.name, b.ranks, b.rank, b.pg)
    assert on.coordinates == whole.coordinates
    assert on.rng.seed_for("data", "tensor") == whole.rng.seed_for("data", "tensor")
    assert on.side_group("writer").ranks == (0,) and on.side_group("writer").pg is None
    assert on.side_group("other").pg is None  # the whole job's side groups may still come later
    assert repr(on) == repr(whole) == "ParallelContext(rank=0/1, single rank, mode=1d)"


def test_a_context_alone_names_this_process_in_the_job():
    ctx = ParallelContext.alone()
    assert (ctx.rank, ctx.global_rank, ctx.job_ranks) == (0, 0, (0,))
    assert ctx.ranks("world") == [0]
