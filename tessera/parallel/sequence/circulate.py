"""Blocks travelling around the sequence axis as a ring (member r sends to r + 1 and receives
from r - 1), the transport of the ring modes.

- :func:`circulate`: every member's block visits every member once, its own first (N - 1 hops);
  the next block is already travelling while the current one is used.
- :func:`circulate_reduce`: the backward companion. The blocks travel again, each member
  contributes to the gradient of every block it sees, and the contributions are summed on the
  way and delivered to the block's home: the blocks make N - 1 hops and so do the sums (a sum
  starts at the member after the block's home, which keeps its own contribution).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tessera import comm
from tessera.comm import Group, P2POp, Pending

Blocks = tuple[torch.Tensor, ...]


def _shift(blocks: Blocks, group: Group, size: int, rank: int) -> tuple[Blocks, list[Pending]]:
    """Start sending ``blocks`` to the next member and receiving the previous member's."""
    received = tuple(torch.empty_like(b) for b in blocks)
    ops = []
    for block, into in zip(blocks, received, strict=True):
        ops += [P2POp("send", block, group, (rank + 1) % size), P2POp("recv", into, group, (rank - 1) % size)]
    return received, comm.batch_p2p(ops, async_op=True)


def _wait(pending: Sequence[Pending]) -> None:
    for p in pending:
        p.wait()


def circulate(blocks: Blocks, group: Group, visit: Callable[[int, Blocks], None]) -> None:
    """Call ``visit(origin, blocks_of_origin)`` for every member's ``blocks`` (contiguous
    tensors of equal shapes on every member), this member's own first, then r - 1, r - 2, ..."""
    g = comm.resolve(group)
    size, rank = g.size, g.rank
    for step in range(size):
        travelling: tuple[Blocks, list[Pending]] | None = None
        if step < size - 1:
            travelling = _shift(blocks, g, size, rank)
        visit((rank - step) % size, blocks)
        if travelling is not None:
            blocks, pending = travelling
            _wait(pending)


def circulate_reduce(blocks: Blocks, group: Group, contribute: Callable[[int, Blocks], torch.Tensor]) -> torch.Tensor:
    """Sum over members of ``contribute(origin, blocks_of_origin)`` for this member's blocks.
    Every member calls ``contribute`` once for every member's blocks (its own first); each
    returns this member's contribution (a tensor of one shape on every member) to the gradient
    of the visiting blocks, and the sums arrive home."""
    g = comm.resolve(group)
    size, rank = g.size, g.rank
    travelling = _shift(blocks, g, size, rank) if size > 1 else None
    own = contribute(rank, blocks)
    arriving: tuple[Blocks, list[Pending]] | None = None
    for step in range(1, size):
        assert travelling is not None
        blocks, pending = travelling
        _wait(pending)
        travelling = _shift(blocks, g, size, rank) if step < size - 1 else None
        part = contribute((rank - step) % size, blocks)
        if arriving is not None:
            (partial,), pending = arriving
            _wait(pending)
            part = partial.add_(part)
        arriving = _shift((part.contiguous(),), g, size, rank)  # on to the next member (home, at the last step)
    if arriving is None:
        return own
    (home,), pending = arriving
    _wait(pending)
    return home.add_(own)


__all__ = ["circulate", "circulate_reduce"]
