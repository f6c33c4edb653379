"""The chunk memory manager: brings chunk parts to the tier where they are used, making room
by moving others down (device -> host -> disk) as the placement policy picks them.

Every part lives in one place (:mod:`tessera.memory.tiers`); :meth:`ChunkMemory.need` returns
its buffer on the device or the host and holds it there until :meth:`ChunkMemory.done`.
Before anything is counted in a tier the manager makes room: while the tier's free bytes are
too few it asks the policy for a victim among the parts resident there and not held, and moves
it one tier down (a host part whose file is current is simply dropped; another is written by a
background thread and counts as host memory until the write ends). When nothing can move and
no write is in flight, the budget is too small: :class:`~tessera.memory.tiers.BudgetError`.

Working buffers that are not parts (a gathered chunk, a gradient bucket) are counted with
:meth:`ChunkMemory.reserve` / :meth:`ChunkMemory.unreserve` under the same rules.

Each :meth:`need` is one *use*; the sequence of uses of one training step is the trace that the
policies read (which part is needed next, and when each part is needed again) and that the
manager follows to read parts from disk ahead of their use.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from tessera.memory.disk import DiskIO, Transfer
from tessera.memory.tiers import BudgetError, BufferPool, Part, Residence, Tier, TierLedger

_MIB = 2**20
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
        self._separate = device.type != "cpu"  # device and host memory are different memories
        self.device_pool = BufferPool(device)
        self.host_pool = (
            BufferPool(torch.device("cpu"), pin=device.type == "cuda") if self._separate else self.device_pool
        )
        self._transfers: dict[str, Transfer] = {}  # part name -> disk transfer in flight
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
        if tier is Tier.DISK:  # written straight from the caller's values (no host room taken)
            if self.disk is None:
                raise BudgetError(
                    f"{part.name} has no room in memory and there is no disk tier: give gemini.offload_dir"
                )
            source = torch.zeros(part.numel, dtype=part.dtype) if values is None else values.reshape(-1)
            self.disk.write(part.name, source.to("cpu", part.dtype).contiguous()).wait()
            part.file_valid = True
            part.move_to(Residence.DISK)
            return
        self._make_room(tier, part.nbytes, part.name)
        buffer = self._take(tier, part.numel, part.dtype)
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
        self._reap()
        if part.residence is Residence.EMPTY or (not fill and part.residence is Residence.DISK):
            if part.residence is Residence.DISK:
                self._drop_file(part)
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
        self._finish_transfer(part)
        if part.residence is Residence.EMPTY:
            return
        if part.residence is Residence.DISK:
            self._drop_file(part)
            return
        buffer = part.tensor
        tier = part.residence.tier
        part.move_to(Residence.EMPTY)
        part.tensor = None
        if buffer is not None and tier is not None:
            self._give(tier, buffer)
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
        self._reap()
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
        self._reap()
        for tier in (Tier.DEVICE, Tier.HOST):
            self._make_room(tier, 0, "rebalance")

    def settle(self) -> None:
        """Wait for every disk transfer in flight."""
        for name in list(self._transfers):
            self._finish_transfer(self._by_name[name])

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
    def _pool(self, tier: Tier) -> BufferPool:
        return self.device_pool if tier is Tier.DEVICE else self.host_pool

    def _idle_tier(self, tier: Tier) -> Tier:
        """The tier whose budget a pool's idle buffers count in (host memory, where the device
        tier is host memory too)."""
        return tier if self._separate else Tier.HOST

    def _take(self, tier: Tier, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer for a part about to be counted in ``tier``: an idle one of the pool (no longer
        counted as idle) or a new one."""
        pool = self._pool(tier)
        if pool.has(numel, dtype):
            buffer = pool.take(numel, dtype)
            self.ledger.credit(self._idle_tier(tier), buffer.numel() * buffer.element_size(), "idle", "pool take")
            return buffer
        return pool.take(numel, dtype)

    def _give(self, tier: Tier, buffer: torch.Tensor) -> None:
        """A buffer a part no longer uses: kept idle for the next part of its size while the
        budget has room for it (idle buffers count as memory held), else freed."""
        idle = self._idle_tier(tier)
        nbytes = buffer.numel() * buffer.element_size()
        pool = self._pool(tier)
        if pool.room_for(buffer) and self.ledger.free(idle) >= nbytes:
            pool.give(buffer)
            self.ledger.charge(idle, nbytes, "idle", "pool give")

    def _drop_idle(self, tier: Tier) -> bool:
        """Free the idle buffers counted in ``tier``; whether there were any."""
        freed = False
        for pool_tier in (Tier.DEVICE, Tier.HOST):
            pool = self._pool(pool_tier)
            if self._idle_tier(pool_tier) is tier and pool.idle_bytes():
                self.ledger.credit(tier, pool.idle_bytes(), "idle", "pool cleared")
                pool.clear()
                freed = True
        return freed

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
        self._finish_transfer(part)
        if part.residence is Residence.DISK:
            self._read(part).wait()
            self._finish_transfer(part)
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
        if self._separate:
            new = self._take(tier, part.numel, part.dtype)
            new.copy_(old, non_blocking=False)
        else:
            new = old
        part.move_to(Residence.DEVICE if tier is Tier.DEVICE else Residence.HOST)
        part.tensor = new
        if self._separate:
            self._give(Tier.HOST if tier is Tier.DEVICE else Tier.DEVICE, old)

    def _send(self, part: Part, tier: Tier) -> None:
        """Move ``part`` down to ``tier``."""
        if part.residence is Residence.DEVICE:
            self._relocate(part, Tier.HOST)
        if tier is Tier.DISK and part.residence is Residence.HOST:
            self._to_disk(part, wait=False)

    def _to_disk(self, part: Part, wait: bool) -> None:
        if self.disk is None:
            raise BudgetError(
                f"{part.name} must leave host memory but there is no disk tier: give gemini.offload_dir, or raise "
                f"gemini.host_budget (now {_mib(self.ledger.budget[Tier.HOST])})"
            )
        assert part.tensor is not None
        if part.file_valid:
            buffer = part.tensor
            part.move_to(Residence.DISK)
            part.tensor = None
            self._give(Tier.HOST, buffer)
            return
        part.move_to(Residence.WRITING)
        self._transfers[part.name] = self.disk.write(part.name, part.tensor)
        if wait:
            self._finish_transfer(part)

    def _read(self, part: Part, keep_within: float = 0) -> Transfer:
        """Start reading a part on disk into a host buffer (room is made first)."""
        assert self.disk is not None
        self._hold(part)
        try:
            self._make_room(Tier.HOST, part.nbytes, part.name, keep_within)
        finally:
            self._unhold(part)
        buffer = self._take(Tier.HOST, part.numel, part.dtype)
        part.move_to(Residence.READING)
        part.tensor = buffer
        transfer = self.disk.read(part.name, buffer)
        self._transfers[part.name] = transfer
        return transfer

    def _finish_transfer(self, part: Part) -> None:
        """Wait for ``part``'s disk transfer, if one is in flight, and record where it is now."""
        transfer = self._transfers.pop(part.name, None)
        if transfer is None:
            return
        try:
            transfer.wait()
        except BaseException:
            if part.residence is Residence.READING:  # nothing was lost: the file is still there
                buffer, part.tensor = part.tensor, None
                part.move_to(Residence.HOST)
                part.file_valid = True
                part.move_to(Residence.DISK)
                if buffer is not None:
                    self._give(Tier.HOST, buffer)
            elif part.residence is Residence.WRITING:  # the values are still in the host buffer
                part.move_to(Residence.HOST)
            raise
        if part.residence is Residence.READING:
            part.move_to(Residence.HOST)
            part.file_valid = True
        elif part.residence is Residence.WRITING:
            buffer = part.tensor
            part.file_valid = True
            part.move_to(Residence.DISK)
            part.tensor = None
            if buffer is not None:
                self._give(Tier.HOST, buffer)

    def _reap(self) -> None:
        """Record the disk transfers that have finished."""
        for name, transfer in list(self._transfers.items()):
            if transfer.done():
                self._finish_transfer(self._by_name[name])

    def _drop_file(self, part: Part) -> None:
        part.move_to(Residence.EMPTY)
        part.file_valid = False
        if self.disk is not None:
            self.disk.remove(part.name)

    def _make_room(self, tier: Tier, nbytes: int, what: str, keep_within: float = 0) -> None:
        """Move parts out of ``tier`` until it has ``nbytes`` free; parts the trace needs within
        ``keep_within`` uses stay (a prefetch must not push out what comes before it)."""
        if tier is Tier.DISK:
            return
        budget = self.ledger.budget[tier]
        if budget is not None and nbytes > budget:
            raise BudgetError(f"{what} needs {_mib(nbytes)} but gemini's {tier.value} budget is {_mib(budget)}")
        while self.ledger.free(tier) < nbytes:
            if self._drop_idle(tier):
                continue
            if tier is Tier.DEVICE and (self.release_retained() or any(give() for give in self.on_pressure)):
                continue
            candidates = [
                p for p in self.parts
                if p.residence.tier is tier and p.residence not in (Residence.WRITING, Residence.READING)
                and not self.held(p) and (not keep_within or self.next_use(p) > keep_within)
            ]  # fmt: skip
            victim = self.policy.victim(tier, candidates, self) if candidates else None
            if victim is not None:
                self._hold(victim)
                try:
                    self._send(victim, Tier.HOST if tier is Tier.DEVICE else Tier.DISK)
                finally:
                    self._unhold(victim)
                continue
            writing = [self._by_name[n] for n in self._transfers if self._by_name[n].residence is Residence.WRITING]
            if tier is Tier.HOST and writing:
                self._finish_transfer(writing[0])  # its buffer comes free when the write ends
                continue
            reading = [self._by_name[n] for n in self._transfers if self._by_name[n].residence is Residence.READING]
            if tier is Tier.HOST and reading and not keep_within:
                self._finish_transfer(reading[-1])  # read ahead of need: may leave once it has arrived
                continue
            held = sorted((p for p in self.parts if p.residence.tier is tier), key=lambda p: -p.nbytes)
            raise BudgetError(
                f"{what} needs {_mib(nbytes)} in the {tier.value} tier, which holds {_mib(self.ledger.held[tier])} of "
                f"its {_mib(budget)} budget in parts that cannot move now ({', '.join(p.name for p in held[:4])}"
                f"{', ...' if len(held) > 4 else ''}); raise gemini.{tier.value}_budget"
            )

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


def _mib(nbytes: float | None) -> str:
    if nbytes is None:
        return "unbounded"
    return f"{nbytes:.0f} bytes" if nbytes < 2**16 else f"{nbytes / _MIB:.2f} MiB"


def parts_bytes(parts: Iterable[Part]) -> int:
    return sum(p.nbytes for p in parts)


__all__ = ["ChunkMemory", "Policy", "Timeline", "parts_bytes"]
