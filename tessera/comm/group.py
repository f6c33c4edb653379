"""``AxisGroup``: a process group together with the name of the mesh axis it spans."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True, eq=False)
class AxisGroup:
    """The ranks of one group along a named axis, as seen from one member.

    ``pg`` is None when the group has one rank: every collective on it is then a no-op.
    ``ranks`` are global ranks in ascending order and ``rank`` is this rank's index in them.
    """

    name: str
    ranks: tuple[int, ...]
    rank: int
    pg: dist.ProcessGroup | None

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def global_rank(self) -> int:
        return self.ranks[self.rank]

    def global_rank_of(self, index: int) -> int:
        """Global rank of the member at position ``index`` of this group."""
        return self.ranks[index]

    def __repr__(self) -> str:
        return f"AxisGroup({self.name!r}, ranks={list(self.ranks)}, rank={self.rank})"


def single_rank_group(name: str, global_rank: int = 0) -> AxisGroup:
    """A group of one rank: collectives on it return at once."""
    return AxisGroup(name=name, ranks=(global_rank,), rank=0, pg=None)
