"""The job's ranks and the process groups over them, as :class:`~tessera.context.context.
ParallelContext` makes them: torch.distributed's world (or this process alone), the group tables
of a layout as job ranks, and the checks of the ranks a context over part of the job is given."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch.distributed as dist

from tessera.context.dims import AxisSpec, ParallelDims, group_table


def job_world() -> int:
    """Ranks in the job: torch.distributed's world, or this process alone."""
    return dist.get_world_size() if dist.is_initialized() else 1


def job_rank() -> int:
    """This process's rank in the job."""
    return dist.get_rank() if dist.is_initialized() else 0


def job_table(dims: ParallelDims, job_ranks: tuple[int, ...], axis: AxisSpec) -> list[tuple[int, ...]]:
    """The groups along ``axis`` as job ranks: the context's rank ``i`` is job rank ``job_ranks[i]``."""
    return [tuple(job_ranks[i] for i in members) for members in group_table(dims, axis)]


def process_group(members: tuple[int, ...]) -> dist.ProcessGroup | None:
    """A new process group over the job ranks ``members`` (the job's own when they are all of it).
    Collective over the whole job: torch makes every rank take part, members or not."""
    if len(members) == job_world():
        return dist.group.WORLD
    return dist.new_group(list(members))


def side_process_group(job_ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
    """A gloo process group over ``job_ranks`` of its own (collective over the whole job)."""
    return dist.new_group(list(job_ranks), backend="gloo") if len(job_ranks) > 1 else None


def check_ranks(ranks: Sequence[int], dims: ParallelDims) -> tuple[int, ...]:
    """``ranks`` as a tuple of job ranks, after the checks :meth:`ParallelContext.on_ranks` makes."""
    try:
        chosen = tuple(operator.index(r) for r in ranks)  # ints, numpy's included
    except TypeError:
        raise ValueError(f"on_ranks: ranks must be integers, got {list(ranks)}") from None
    repeated = sorted({r for r in chosen if chosen.count(r) > 1})
    if repeated:
        raise ValueError(f"on_ranks: rank(s) {repeated} appear more than once in {list(chosen)}")
    if len(chosen) != dims.world_size:
        raise ValueError(
            f"on_ranks: {len(chosen)} rank(s) {list(chosen)} given for a layout of world size {dims.world_size}"
        )
    if len(chosen) > 1 and not dist.is_initialized():
        raise ValueError(
            f"on_ranks: a context over {len(chosen)} ranks needs torch.distributed initialized "
            "(tessera.launch...); without it the job is this process alone"
        )
    world = job_world()
    outside = [r for r in chosen if not 0 <= r < world]
    if outside:
        raise ValueError(f"on_ranks: rank(s) {outside} are outside the job's {world} rank(s) 0..{world - 1}")
    if list(chosen) != sorted(chosen):
        raise ValueError(
            f"on_ranks: give the ranks in ascending order, got {list(chosen)} "
            "(the context's rank i is the i-th of them, as torch numbers a group's members)"
        )
    return chosen
