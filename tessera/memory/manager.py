"""The chunk memory manager: brings chunk parts to the tier where they are used, making room
by moving others down (device -> host -> disk) as the placement policy picks them.

Every part lives in one place (:mod:`tessera.memory.tiers`); :meth:`ChunkMemory.need` returns
its buffer on the device or the host and holds it there until :meth:`ChunkMemory.done`.
Before anything is counted in a tier the manager makes room: while the tier's free bytes are
too few it asks the policy for a victim among the parts resident there and not held, and moves
it one tier down (a host part whose file is current is simply dropped; another is written by a
background thread and counts as host memory until the write ends). When nothing can move and
no write is in flight, the budget is too small: :class:`~tessera.memory.tiers.BudgetError`.
Making room is :mod:`tessera.memory.eviction`; the disk transfers and the residences they pass
through are :mod:`tessera.memory.transfers`; the idle buffers kept for reuse are
:mod:`tessera.memory.buffers`.

Working buffers that are not parts (a gathered chunk, a gradient bucket) are counted with
:meth:`ChunkMemory.reserve` / :meth:`ChunkMemory.unreserve` under the same rules.

Each :meth:`need` is one *use*; the sequence of uses of one training step is the trace that the
policies read (which part is needed next, and when each part is needed again) and that the
manager follows to read parts from disk ahead of their use (:mod:`tessera.memory.timeline`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from tessera.memory.buffers import TierBuffers
from tessera.memory.disk import DiskIO, Transfer
from tessera.memory.eviction import make_room
from tessera.memory.tiers import BudgetError, Part, Residence, Tier, TierLedger
from tessera.memory.timeline import Timeline
from tessera.memory.transfers import DiskTransfers

_ORDER = {Tier.DEVICE: 0, Tier.HOST: 1, Tier.DISK: 2}


class Policy(Protocol):
    """Where parts go (see :mod:`tessera.memory.placement`)."""

    name: str

    def initial(self, part: Part, memory: ChunkMemory) -> Tier:
        """The tier a new part starts in."""

    def home(self, part: Part) -> Tier | None:
        """The tier a part returns to after use (None: it stays where it is until evicted)."""

    def victim(self, tier: Tier, candidates: Sequence[Part], memory: ChunkMemory) -> Part | None:
        """Which of ``candidates`` (resident in ``tier``, not held) moves down to make room."""


class ChunkMemory:
    """The parts of every chunk on this rank and the tiers they occupy.

    ``device``: the accelerator (or the CPU, whose memory then plays the device tier);
    ``ledger``: the byte counts and budgets; ``policy``: placement and eviction; ``disk``: the
    disk tier (None: parts never leave memory); ``prefetch``: how many uses ahead parts on disk
    are read in the background.
    """

    def __init__(
        self, device: torch.device, ledger: TierLedger, policy: Policy, disk: DiskIO | None = None, prefetch: int = 4
    ) -> None:
        self.device = device
        self.ledger = ledger
        self.policy = policy
        self.disk = disk
        self.prefetch_depth = prefetch
        self.parts: list[Part] = []
        self._by_name: dict[str, Part] = {}
        self._held: Counter[str] = Counter()
        self.buffers = TierBuffers(device, ledger)
        self.transfers = DiskTransfers(disk, self.buffers)
        self._last_use: dict[str, int] = {}
        self.uses = 0  # uses since the manager was made
        self.recording: list[str] | None = None  # uses being traced
        self.timeline: Timeline | None = None
        self.cursor = 0  # position in the timeline of the latest use
        self._untraced = 0
        # gathered chunks a training forward pass let go of, kept for its backward while the
        # device has room (released first, oldest first, when room is needed)
        self.retaining = False
        self._retained: dict[int, Any] = {}
        # callables that free some device working memory (a reduction in flight finishing and
        # giving its bucket back); each returns whether it freed anything
        self.on_pressure: list[Callable[[], bool]] = []

    # ---- parts ---------------------------------------------------------------------------
    def add(self, part: Part) -> Part:
        if part.name in self._by_name:
            raise ValueError(f"{part.name} is already managed")
        self.parts.append(part)
        self._by_name[part.name] = part
        return part

    def part(self, name: str) -> Part:
        return self._by_name[name]

    def place(self, part: Part, tier: Tier, values: torch.Tensor | None = None) -> None:
        """Give an empty part a buffer in ``tier`` (zeros, or a copy of ``values``); a part
        placed on disk is written there (through a host buffer)."""
        if tier is Tier.DISK:
            self.transfers.place(part, values)
            return
        self._make_room(tier, part.nbytes, part.name)
        buffer = self.buffers.take(tier, part.numel, part.dtype)
        if values is None:
            buffer.zero_()
        else:
            buffer.copy_(values.reshape(-1))
        part.move_to(Residence.DEVICE if tier is Tier.DEVICE else Residence.HOST)
        part.tensor = buffer
        part.file_valid = False

    def need(self, part: Part, tier: Tier, *, fill: bool = True) -> torch.Tensor:
        """``part``'s buffer in ``tier`` (DEVICE or HOST), held there until :meth:`done`.
        An empty part gets zeros. ``fill=False``: the caller overwrites every value, so a part
        on disk is not read (its file is dropped)."""
        if tier is Tier.DISK:
            raise ValueError("parts are used on the device or the host, not on disk")
        self._use(part)
        self.transfers.reap()
        if part.residence is Residence.EMPTY or (not fill and part.residence is Residence.DISK):
            if part.residence is Residence.DISK:
                self.transfers.drop_file(part)
            self.place(part, tier)
        else:
            self._bring(part, tier)
        self._hold(part)
        self._prefetch_ahead()
        assert part.tensor is not None
        return part.tensor

    def done(self, part: Part) -> None:
        """Stop holding ``part``; the policy may send it back to its home tier."""
        self._unhold(part)
        if self._held[part.name] > 0:
            return
        home = self.policy.home(part)
        tier = part.residence.tier
        if home is None or tier is None or tier is home or part.residence is Residence.DISK:
            return
        if _ORDER[home] > _ORDER[tier]:
            self._send(part, home)
        elif home is not Tier.DISK:
            self._bring(part, home)

    def dirty(self, part: Part) -> None:
        """``part``'s values changed: its file (if any) is out of date."""
        part.file_valid = False

    def drop(self, part: Part) -> None:
        """Free ``part``'s buffer and file (its values are no longer needed)."""
        self.transfers.finish(part)
        if part.residence is Residence.EMPTY:
            return
        if part.residence is Residence.DISK:
            self.transfers.drop_file(part)
            return
        buffer = part.tensor
        tier = part.residence.tier
        part.move_to(Residence.EMPTY)
        part.tensor = None
        if buffer is not None and tier is not None:
            self.buffers.give(tier, buffer)
        if part.file_valid and self.disk is not None:
            self.disk.remove(part.name)
        part.file_valid = False

    def demote(self, part: Part) -> bool:
        """Move ``part`` from the device to host memory (room is made there as for any move)
        when it is on the device and not in use; whether it moved."""
        if part.residence is not Residence.DEVICE or self.held(part):
            return False
        self._hold(part)
        try:
            self._send(part, Tier.HOST)
        finally:
            self._unhold(part)
        return True

    def reserve(self, tier: Tier, nbytes: int, kind: str, what: str) -> None:
        """Count a working buffer of ``nbytes`` in ``tier`` (room is made first)."""
        self.transfers.reap()
        self._make_room(tier, nbytes, what)
        self.ledger.charge(tier, nbytes, kind, what)

    def unreserve(self, tier: Tier, nbytes: int, kind: str, what: str) -> None:
        self.ledger.credit(tier, nbytes, kind, what)

    def retain(self, chunk: Any) -> None:
        """Keep ``chunk`` (a gathered chunk with ``release()``) until room is needed."""
        self._retained[id(chunk)] = chunk

    def forget_retained(self, chunk: Any) -> None:
        self._retained.pop(id(chunk), None)

    def release_retained(self) -> bool:
        """Release the oldest retained chunk; whether there was one."""
        if not self._retained:
            return False
        key = next(iter(self._retained))
        chunk = self._retained.pop(key)
        retaining, self.retaining = self.retaining, False
        try:
            chunk.release()
        finally:
            self.retaining = retaining
        return True

    def rebalance(self) -> None:
        """Move parts down until every tier is within its budget again (after a block that
        lifted the budgets)."""
        self.transfers.reap()
        for tier in (Tier.DEVICE, Tier.HOST):
            self._make_room(tier, 0, "rebalance")

    def settle(self) -> None:
        """Wait for every disk transfer in flight."""
        self.transfers.settle()

    def close(self) -> None:
        self.settle()
        if self.disk is not None:
            self.disk.close()

    # ---- the trace -----------------------------------------------------------------------
    def start_trace(self) -> None:
        self.recording = []

    def stop_trace(self) -> list[str]:
        uses, self.recording = self.recording or [], None
        self.timeline = Timeline(uses)
        self.cursor = -1
        return uses

    def next_use(self, part: Part) -> float:
        """Uses until ``part`` is needed again, from the trace (inf without one, or never)."""
        if self.timeline is None:
            return float("inf")
        return self.timeline.next_use(part.name, self.cursor)

    def last_use(self, part: Part) -> int:
        return self._last_use.get(part.name, -1)

    @contextmanager
    def untraced(self) -> Iterator[None]:
        """Uses inside the block are not part of training (a checkpoint, materialisation): the
        trace does not record them and the position in the trace stays."""
        self._untraced += 1
        try:
            yield
        finally:
            self._untraced -= 1

    def _use(self, part: Part) -> None:
        if self._untraced:
            return
        self.uses += 1
        self._last_use[part.name] = self.uses
        if self.recording is not None:
            self.recording.append(part.name)
        if self.timeline is not None:
            self.cursor = self.timeline.locate(part.name, self.cursor)

    # ---- moving parts --------------------------------------------------------------------
    def _hold(self, part: Part) -> None:
        self._held[part.name] += 1

    def _unhold(self, part: Part) -> None:
        if self._held[part.name] <= 0:
            raise RuntimeError(f"{part.name} was released more often than it was needed")
        self._held[part.name] -= 1

    def held(self, part: Part) -> bool:
        return self._held[part.name] > 0

    def _bring(self, part: Part, tier: Tier) -> None:
        """Move a part that has values up to ``tier`` (DEVICE or HOST), or down from DEVICE."""
        self.transfers.finish(part)
        if part.residence is Residence.DISK:
            self._read(part).wait()
            self.transfers.finish(part)
        if part.residence.tier is tier:
            return
        self._hold(part)  # not a victim of the room made for it
        try:
            self._relocate(part, tier)
        finally:
            self._unhold(part)

    def _relocate(self, part: Part, tier: Tier) -> None:
        """DEVICE <-> HOST: a copy between memories, or a relabelling where they are one."""
        self._make_room(tier, part.nbytes, part.name)
        old = part.tensor
        assert old is not None
        if self.buffers.separate:
            new = self.buffers.take(tier, part.numel, part.dtype)
            new.copy_(old, non_blocking=False)
        else:
            new = old
        part.move_to(Residence.DEVICE if tier is Tier.DEVICE else Residence.HOST)
        part.tensor = new
        if self.buffers.separate:
            self.buffers.give(Tier.HOST if tier is Tier.DEVICE else Tier.DEVICE, old)

    def _send(self, part: Part, tier: Tier) -> None:
        """Move ``part`` down to ``tier``."""
        if part.residence is Residence.DEVICE:
            self._relocate(part, Tier.HOST)
        if tier is Tier.DISK and part.residence is Residence.HOST:
            self.transfers.write(part, wait=False)

    def _read(self, part: Part, keep_within: float = 0) -> Transfer:
        """Start reading a part on disk into a host buffer (room is made first)."""
        self._hold(part)
        try:
            self._make_room(Tier.HOST, part.nbytes, part.name, keep_within)
        finally:
            self._unhold(part)
        return self.transfers.read(part, self.buffers.take(Tier.HOST, part.numel, part.dtype))

    def _make_room(self, tier: Tier, nbytes: int, what: str, keep_within: float = 0) -> None:
        """Move parts out of ``tier`` until it has ``nbytes`` free (:func:`~tessera.memory.eviction.make_room`)."""
        make_room(self, tier, nbytes, what, keep_within)

    def pick_victim(self, tier: Tier, candidates: Sequence[Part]) -> Part | None:
        """The part of ``candidates`` (resident in ``tier``, not held) the policy moves down."""
        return self.policy.victim(tier, candidates, self)

    def evict(self, part: Part, tier: Tier) -> None:
        """Move ``part`` from ``tier`` one tier down (held meanwhile: not a victim of the room
        made for it)."""
        self._hold(part)
        try:
            self._send(part, Tier.HOST if tier is Tier.DEVICE else Tier.DISK)
        finally:
            self._unhold(part)

    def _prefetch_ahead(self) -> None:
        """Start reading the parts on disk that the trace says come next (no further than
        ``prefetch`` uses ahead), while host memory has room for them and for every part the
        trace needs before them, counting only what parts needed later can give up."""
        if self.timeline is None or self.disk is None or not self.timeline.period:
            return
        coming = 0  # host bytes the uses before this one will take
        for step in range(1, self.prefetch_depth + 1):
            part = self._by_name.get(self.timeline.uses[(self.cursor + step) % self.timeline.period])
            if part is None or part.residence not in (Residence.DISK, Residence.EMPTY):
                continue
            coming += part.nbytes
            if part.residence is Residence.EMPTY:
                continue
            later = sum(
                p.nbytes for p in self.parts
                if p.residence is Residence.HOST and not self.held(p) and self.next_use(p) > step
            )  # fmt: skip
            if self.ledger.free(Tier.HOST) + later < coming:
                return
            try:
                self._read(part, keep_within=step)
            except BudgetError:  # the policy would not move what the room needs: read it when used
                return

    # ---- reports -------------------------------------------------------------------------
    def bytes_by_tier(self) -> dict[str, int]:
        out = {t.value: 0 for t in Tier}
        for p in self.parts:
            tier = p.residence.tier
            if tier is not None:
                out[tier.value] += p.nbytes
        return out

    def tiers_used(self) -> set[Tier]:
        return {p.residence.tier for p in self.parts if p.residence.tier is not None}


def parts_bytes(parts: Iterable[Part]) -> int:
    return sum(p.nbytes for p in parts)


__all__ = ["ChunkMemory", "Policy", "Timeline", "parts_bytes"]
