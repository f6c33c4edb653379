"""Making room in a tier: before anything is counted in a tier, what it holds is let go, in this
order, until the tier's free bytes suffice: idle buffers; on the device, a retained gathered
chunk or a reduction in flight that gives its bucket back; a part the placement policy picks
among those resident and not held, moved one tier down; in host memory, a write in flight
(its buffer comes free when it ends) or a read made ahead of need. When nothing can go, the
budget is too small: :class:`~tessera.memory.tiers.BudgetError`, naming what is held."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from tessera.memory.buffers import TierBuffers, mib
from tessera.memory.tiers import BudgetError, Part, Residence, Tier, TierLedger
from tessera.memory.transfers import DiskTransfers


class Room(Protocol):
    """What making room reads and moves of the memory manager
    (:class:`~tessera.memory.manager.ChunkMemory`)."""

    ledger: TierLedger
    buffers: TierBuffers
    transfers: DiskTransfers
    parts: list[Part]
    on_pressure: list[Callable[[], bool]]

    def held(self, part: Part) -> bool: ...

    def next_use(self, part: Part) -> float: ...

    def release_retained(self) -> bool: ...

    def pick_victim(self, tier: Tier, candidates: Sequence[Part]) -> Part | None: ...

    def evict(self, part: Part, tier: Tier) -> None: ...


def make_room(memory: Room, tier: Tier, nbytes: int, what: str, keep_within: float = 0) -> None:
    """Move parts out of ``tier`` until it has ``nbytes`` free; parts the trace needs within
    ``keep_within`` uses stay (a prefetch must not push out what comes before it). ``what``
    names the need in the error."""
    if tier is Tier.DISK:
        return
    ledger = memory.ledger
    budget = ledger.budget[tier]
    if budget is not None and nbytes > budget:
        raise BudgetError(f"{what} needs {mib(nbytes)} but gemini's {tier.value} budget is {mib(budget)}")
    while ledger.free(tier) < nbytes:
        if memory.buffers.drop_idle(tier):
            continue
        if tier is Tier.DEVICE and (memory.release_retained() or any(give() for give in memory.on_pressure)):
            continue
        candidates = [
            p for p in memory.parts
            if p.residence.tier is tier and p.residence not in (Residence.WRITING, Residence.READING)
            and not memory.held(p) and (not keep_within or memory.next_use(p) > keep_within)
        ]  # fmt: skip
        victim = memory.pick_victim(tier, candidates) if candidates else None
        if victim is not None:
            memory.evict(victim, tier)
            continue
        writing = memory.transfers.in_flight(Residence.WRITING)
        if tier is Tier.HOST and writing:
            memory.transfers.finish(writing[0])  # its buffer comes free when the write ends
            continue
        reading = memory.transfers.in_flight(Residence.READING)
        if tier is Tier.HOST and reading and not keep_within:
            memory.transfers.finish(reading[-1])  # read ahead of need: may leave once it has arrived
            continue
        raise _stuck(memory, tier, nbytes, what)


def _stuck(memory: Room, tier: Tier, nbytes: int, what: str) -> BudgetError:
    """The error when nothing in ``tier`` can move: what it holds, largest first."""
    held = sorted((p for p in memory.parts if p.residence.tier is tier), key=lambda p: -p.nbytes)
    return BudgetError(
        f"{what} needs {mib(nbytes)} in the {tier.value} tier, which holds {mib(memory.ledger.held[tier])} of "
        f"its {mib(memory.ledger.budget[tier])} budget in parts that cannot move now ({', '.join(p.name for p in held[:4])}"
        f"{', ...' if len(held) > 4 else ''}); raise gemini.{tier.value}_budget"
    )
