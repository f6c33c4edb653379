"""The trace of one training step: the uses of the memory manager's parts, in order, and where
each part appears in it, so the policies and the reads ahead know which part is needed next
and when each is needed again. The step repeats: positions wrap around its end."""

from __future__ import annotations

import bisect
from collections.abc import Sequence


class Timeline:
    """The uses of one training step, in order (the trace), and where each part appears in it."""

    def __init__(self, uses: Sequence[str]) -> None:
        self.uses = list(uses)
        self.period = len(self.uses)
        self.positions: dict[str, list[int]] = {}
        for i, name in enumerate(self.uses):
            self.positions.setdefault(name, []).append(i)

    def next_use(self, name: str, cursor: int) -> float:
        """How many uses from ``cursor`` until ``name`` is used again (inf: never)."""
        where = self.positions.get(name)
        if not where:
            return float("inf")
        i = bisect.bisect_right(where, cursor)
        if i < len(where):
            return where[i] - cursor
        return where[0] + self.period - cursor

    def locate(self, name: str, cursor: int) -> int:
        """The position of this use of ``name``: its first position after ``cursor`` (wrapping)."""
        where = self.positions.get(name)
        if not where:
            return cursor
        i = bisect.bisect_right(where, cursor)
        return where[i] if i < len(where) else where[0]
