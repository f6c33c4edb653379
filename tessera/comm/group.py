"""``AxisGroup``: a process group together with the name of the mesh axis it spans; and the
release of process groups at shutdown.

A gloo process group runs its collectives on worker threads of its own, which are joined only
when the group is freed. ``tessera.shutdown()`` therefore makes every holder let go of its
process groups (:func:`release_process_groups`) before torch destroys them: the threads are then
joined while Python still runs. A group that outlived the interpreter instead would leave a
thread that, releasing its last collective's tensors, needs the GIL after Python started to
finalize, and the process would abort ("terminate called without an active exception").
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

# torch.distributed.nn's functions take ``group=group.WORLD`` as a default argument, so that the
# module, when first imported after the world group started (DDP imports it on first use), keeps
# that group alive for good. Imported now, before any group exists, the default is None.
import torch.distributed.nn  # noqa: F401

# Every AxisGroup built over a process group, and other objects that keep one (a DDP module),
# each with the function that makes it let go; weak, so that they still die with their owners.
_attached: weakref.WeakSet[AxisGroup] = weakref.WeakSet()
_holders: weakref.WeakKeyDictionary[Any, Callable[[Any], None]] = weakref.WeakKeyDictionary()
_by_key: weakref.WeakValueDictionary[str, AxisGroup] = weakref.WeakValueDictionary()


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
    #: names the group where no Python object can go (a compiled graph's collective ops)
    key: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", f"{self.name}:{id(self):x}")
        _by_key[self.key] = self
        if self.pg is not None:
            _attached.add(self)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def global_rank(self) -> int:
        return self.ranks[self.rank]

    @property
    def closed(self) -> bool:
        """Whether the group spans several ranks but has let go of its process group
        (after ``tessera.shutdown()``): collectives on it fail."""
        return self.pg is None and len(self.ranks) > 1

    def global_rank_of(self, index: int) -> int:
        """Global rank of the member at position ``index`` of this group."""
        return self.ranks[index]

    def __repr__(self) -> str:
        return f"AxisGroup({self.name!r}, ranks={list(self.ranks)}, rank={self.rank})"


def group_by_key(key: str) -> AxisGroup:
    """The living group whose ``key`` this is."""
    group = _by_key.get(key)
    if group is None:
        raise RuntimeError(f"no process group named {key!r} is alive (a compiled graph outlived its groups?)")
    return group


def single_rank_group(name: str, global_rank: int = 0) -> AxisGroup:
    """A group of one rank: collectives on it return at once."""
    return AxisGroup(name=name, ranks=(global_rank,), rank=0, pg=None)


def hold_process_group(owner: Any, release: Callable[[Any], None]) -> None:
    """Record that ``owner`` (a torch object such as a DDP module) keeps a process group that
    an AxisGroup gave it; :func:`release_process_groups` calls ``release(owner)`` to make it let
    go. ``owner`` is held weakly."""
    _holders[owner] = release


def release_process_groups() -> list[dist.ProcessGroup]:
    """Detach every AxisGroup from its process group (every holder of the AxisGroup then sees it
    closed) and make the recorded holders let go. Returns the distinct process groups that were
    attached, for the caller to check that they are freed once torch lets go of them too."""
    groups: dict[int, dist.ProcessGroup] = {}
    for group in list(_attached):
        assert group.pg is not None
        groups.setdefault(id(group.pg), group.pg)
        object.__setattr__(group, "pg", None)  # frozen for users; closing is the one change
    _attached.clear()
    for owner, release in list(_holders.items()):
        release(owner)
    _holders.clear()
    return list(groups.values())
