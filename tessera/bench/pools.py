"""Where a benchmark's ranks run: a pool started for the measurement and closed after it (what
``tessera bench`` does), or a pool of the caller's :class:`~tessera.testing.PoolSet`, left
running for the caller's next use (the test suite's: its processes start once per session).

Memory rows measured in a caller's pool come from processes that ran other work before, so they
only show that the rows are made, not what the benchmark's fresh processes would measure."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tessera.testing import PoolSet, RankPool


@contextmanager
def rank_pool(world_size: int, pools: PoolSet | None = None) -> Iterator[RankPool]:
    """A pool of ``world_size`` ranks: ``pools``' (left running), or without ``pools`` a fresh one,
    closed on exit."""
    if pools is not None:
        yield pools.get(world_size)
        return
    from tessera.testing import RankPool

    pool = RankPool(world_size)
    try:
        yield pool
    finally:
        pool.close()


__all__ = ["rank_pool"]
