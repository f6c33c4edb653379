"""Collectives on flat buffers that the caller owns, for sharded model state (ZeRO, chunks).

``all_gather_into`` and ``reduce_scatter_into`` write into preallocated 1-D buffers instead of
returning new tensors, and may run asynchronously (``async_op=True`` returns a :class:`Pending`
to wait on), so that a gather of the next chunk or the reduction of a finished gradient bucket
overlaps compute. Both are recorded in the comm ledger like every other collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tessera.comm.ledger import record
from tessera.comm.ops import Group, Pending, _enter, _nbytes, _wait, resolve
from tessera.comm.progress import Entered


def _check_flat(full: torch.Tensor, shard: torch.Tensor, size: int, what: str) -> None:
    if full.dim() != 1 or shard.dim() != 1 or not full.is_contiguous() or not shard.is_contiguous():
        raise ValueError(
            f"{what} takes contiguous 1-D buffers; got shapes {tuple(full.shape)} and {tuple(shard.shape)}"
        )
    if full.numel() != size * shard.numel():
        raise ValueError(
            f"{what}: the full buffer has {full.numel()} elements, not group size {size} x shard {shard.numel()}"
        )
    if full.dtype != shard.dtype:
        raise ValueError(f"{what}: dtypes differ ({full.dtype} and {shard.dtype})")


def all_gather_into(full: torch.Tensor, shard: torch.Tensor, group: Group, async_op: bool = False) -> Pending:
    """Every member's ``shard`` [n] concatenated into ``full`` [P*n], in member order."""
    g = resolve(group)
    _check_flat(full, shard, g.size, "all_gather_into")
    if g.size == 1:
        if full.data_ptr() != shard.data_ptr():
            full.copy_(shard)
        return Pending(None, "all_gather", g, full)
    record("all_gather", g.name, g.size, _nbytes(full))
    entered = _enter("all_gather", g)
    work = dist.all_gather_single(full, shard, g.pg, async_op=True)
    pending = Pending(work, "all_gather", g, full, entered)
    if not async_op:
        pending.wait()
    return pending


def reduce_scatter_into(
    shard: torch.Tensor, full: torch.Tensor, group: Group, op: str = "sum", async_op: bool = False
) -> Pending:
    """The sum (or average, ``op="avg"``) over members of ``full`` [P*n]; this member's part
    [n] is written into ``shard``. With ``async_op`` the average's division happens at ``wait``."""
    g = resolve(group)
    _check_flat(full, shard, g.size, "reduce_scatter_into")
    if op not in ("sum", "avg"):
        raise ValueError(f"reduce_scatter_into: op {op!r} is not sum or avg")
    if g.size == 1:
        shard.copy_(full)
        return Pending(None, "reduce_scatter", g, shard)
    record("reduce_scatter", g.name, g.size, _nbytes(full))
    entered = _enter("reduce_scatter", g)
    work = dist.reduce_scatter_single(shard, full, dist.ReduceOp.SUM, g.pg, async_op=True)
    pending = _Scaled(work, g, shard, 1.0 / g.size if op == "avg" else None, entered)
    if not async_op:
        pending.wait()
    return pending


class _Scaled(Pending):
    """A pending reduce-scatter whose result is divided once it has arrived (for averages)."""

    def __init__(
        self, work: object, group: object, result: torch.Tensor, factor: float | None, entered: Entered
    ) -> None:
        super().__init__(work, "reduce_scatter", group, result, entered)  # type: ignore[arg-type]
        self._factor = factor

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            _wait(self._work, self._op, self._group, self._entered)
            self._work = None
            if self._factor is not None:
                self._result.mul_(self._factor)
        return self._result
