"""Memory tiers for chunked model state: where each part of a chunk lives, what may move where,
and the ledger that counts the bytes of every tier against its budget.

A chunk of the Gemini memory manager holds, for this rank's shard of a group of parameters,
several *parts*: the parameters in the compute dtype, the fp32 gradients, and the optimizer's
states (with the fp32 masters). Each part is one flat tensor and lives in one place at a time:

    EMPTY ──> DEVICE <──> HOST ──> WRITING ──> DISK ──> READING ──> HOST
    EMPTY ──> DISK   (made on disk: written from the caller's buffer before the move)
                          HOST ──> DISK   (a clean copy: the file already holds these values)
                       WRITING ──> HOST   (the write finished and the buffer is kept)
    any resident place ──> EMPTY  (dropped: gradients after the step)

DEVICE, HOST, WRITING and READING hold a buffer in memory (WRITING and READING count as host
memory until the transfer ends); DISK holds only the part's file. Every move goes through
:meth:`Part.move_to`, which refuses a move the table does not list and updates the
:class:`TierLedger`. The ledger refuses to count more bytes in a tier than its budget allows:
the manager must make room first, so an overrun is a bug, never a silent excess.

On a machine without an accelerator the device tier is host memory counted against the device
budget (moves between DEVICE and HOST only relabel the buffer); the disk tier is real.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from tessera.errors import BudgetError, OffloadError, TesseraError


class Tier(enum.Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


class Residence(enum.Enum):
    EMPTY = "empty"  # no payload (gradients before a backward pass, after the step)
    DEVICE = "device"
    HOST = "host"
    WRITING = "writing"  # a host buffer on its way to the part's file
    DISK = "disk"  # only the file holds the values
    READING = "reading"  # the file on its way into a host buffer

    @property
    def tier(self) -> Tier | None:
        """The tier whose bytes the part counts in (None: it holds nothing)."""
        return _TIER_OF[self]


_TIER_OF = {
    Residence.EMPTY: None,
    Residence.DEVICE: Tier.DEVICE,
    Residence.HOST: Tier.HOST,
    Residence.WRITING: Tier.HOST,
    Residence.DISK: Tier.DISK,
    Residence.READING: Tier.HOST,
}

LEGAL_MOVES: dict[Residence, frozenset[Residence]] = {
    Residence.EMPTY: frozenset({Residence.DEVICE, Residence.HOST, Residence.DISK}),
    Residence.DEVICE: frozenset({Residence.HOST, Residence.EMPTY}),
    Residence.HOST: frozenset({Residence.DEVICE, Residence.WRITING, Residence.DISK, Residence.EMPTY}),
    Residence.WRITING: frozenset({Residence.DISK, Residence.HOST}),
    Residence.DISK: frozenset({Residence.READING, Residence.EMPTY}),
    Residence.READING: frozenset({Residence.HOST}),
}


class IllegalMove(TesseraError, RuntimeError):
    """A part was asked to move between two places the table does not link."""


class BudgetExceeded(TesseraError, RuntimeError):
    """Bytes were counted in a tier beyond its budget (the manager did not make room first)."""


@dataclass(slots=True)
class Sample:
    """The ledger after one move: what moved and the bytes each tier held then."""

    what: str
    device: int
    host: int
    disk: int


class TierLedger:
    """Bytes held per tier, against the device and host budgets (None: unbounded), with the
    peak of each tier and, when ``keep_samples``, a sample after every change."""

    def __init__(self, device_budget: int | None, host_budget: int | None, keep_samples: bool = False) -> None:
        self.budget = {Tier.DEVICE: device_budget, Tier.HOST: host_budget, Tier.DISK: None}
        self.held: dict[Tier, int] = defaultdict(int)
        self.peak: dict[Tier, int] = defaultdict(int)
        self.by_kind: dict[tuple[Tier, str], int] = defaultdict(int)
        self.samples: list[Sample] | None = [] if keep_samples else None
        self._lifted = 0

    def free(self, tier: Tier) -> float:
        """Bytes the tier may still take (infinite without a budget)."""
        budget = self.budget[tier]
        return float("inf") if budget is None else budget - self.held[tier]

    def charge(self, tier: Tier, nbytes: int, kind: str, what: str) -> None:
        """Count ``nbytes`` more in ``tier``; raises BudgetExceeded past its budget."""
        budget = self.budget[tier]
        if budget is not None and self.held[tier] + nbytes > budget:
            raise BudgetExceeded(
                f"{what}: {nbytes} bytes more in the {tier.value} tier would hold {self.held[tier] + nbytes} "
                f"of a {budget}-byte budget"
            )
        self.held[tier] += nbytes
        self.by_kind[(tier, kind)] += nbytes
        self.peak[tier] = max(self.peak[tier], self.held[tier])
        self._sample(what)

    def credit(self, tier: Tier, nbytes: int, kind: str, what: str) -> None:
        """Count ``nbytes`` fewer in ``tier``."""
        self.held[tier] -= nbytes
        self.by_kind[(tier, kind)] -= nbytes
        if self.held[tier] < 0 or self.by_kind[(tier, kind)] < 0:
            raise RuntimeError(f"{what}: the {tier.value} tier's ledger went below zero")
        self._sample(what)

    @contextmanager
    def lifted(self) -> Iterator[None]:
        """No budgets and no samples inside the block (for what is whole by definition, such as
        a full state dict); the bytes are still counted."""
        budget, self.budget = dict(self.budget), dict.fromkeys(Tier)
        self._lifted += 1
        try:
            yield
        finally:
            self._lifted -= 1
            self.budget = budget

    def _sample(self, what: str) -> None:
        if self.samples is not None and not self._lifted:
            self.samples.append(Sample(what, self.held[Tier.DEVICE], self.held[Tier.HOST], self.held[Tier.DISK]))

    def summary(self) -> dict[str, int]:
        """Bytes held and peak per tier, for reports."""
        out: dict[str, int] = {}
        for tier in Tier:
            out[f"{tier.value}_bytes"] = self.held[tier]
            out[f"{tier.value}_peak_bytes"] = self.peak[tier]
        return out


class BufferPool:
    """Flat buffers of a few fixed sizes, reused instead of freed: parts of equal size take
    turns in the same memory, so moving chunks in and out does not fragment the heap (on CPU
    the resident size would otherwise creep above what is alive). The manager counts the idle
    buffers in its ledger and frees them first when a tier needs room."""

    def __init__(self, device: torch.device, pin: bool = False, keep: int = 1) -> None:
        self.device = device
        self.pin = pin
        self.keep = keep  # free buffers kept per size (the rest go back to the allocator)
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = defaultdict(list)

    def has(self, numel: int, dtype: torch.dtype) -> bool:
        return bool(self._free.get((numel, dtype)))

    def room_for(self, buffer: torch.Tensor) -> bool:
        return len(self._free[(buffer.numel(), buffer.dtype)]) < self.keep

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        free = self._free.get((numel, dtype))
        if free:
            return free.pop()
        return torch.empty(numel, dtype=dtype, device=self.device, pin_memory=self.pin)

    def give(self, buffer: torch.Tensor) -> None:
        """Keep ``buffer`` for reuse (the caller checked :meth:`room_for`)."""
        self._free[(buffer.numel(), buffer.dtype)].append(buffer)

    def idle_bytes(self) -> int:
        """Bytes of the free buffers kept for reuse."""
        return sum(b.numel() * b.element_size() for bs in self._free.values() for b in bs)

    def clear(self) -> None:
        self._free.clear()


class Part:
    """One flat tensor of a chunk's model state (``kind``: ``"params"``, ``"grads"``,
    ``"states"``) and where it lives. ``tensor`` is its buffer while resident in memory, None
    otherwise; ``file_valid``: the part's file holds its current values (a clean copy)."""

    __slots__ = ("chunk", "dtype", "file_valid", "kind", "ledger", "name", "numel", "pending", "residence", "tensor")

    def __init__(self, chunk: int, kind: str, numel: int, dtype: torch.dtype, ledger: TierLedger) -> None:
        self.chunk = chunk
        self.kind = kind
        self.name = f"chunk{chunk}.{kind}"
        self.numel = numel
        self.dtype = dtype
        self.ledger = ledger
        self.residence = Residence.EMPTY
        self.tensor: torch.Tensor | None = None
        self.file_valid = False
        self.pending: Callable[[], None] | None = None  # waits for the disk transfer in flight

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def move_to(self, new: Residence) -> None:
        """Record a move (the caller moves the bytes); refuses moves the table does not list
        and counts the part's bytes in the new tier (which must have room) before leaving the old."""
        old = self.residence
        if new not in LEGAL_MOVES[old]:
            raise IllegalMove(f"{self.name}: {old.value} -> {new.value} is not a legal move")
        if new is Residence.DISK and old in (Residence.HOST, Residence.EMPTY) and not self.file_valid:
            raise IllegalMove(f"{self.name}: host -> disk without writing, but the file is out of date")
        before, after = old.tier, new.tier
        if after is not None and after is not before:
            self.ledger.charge(after, self.nbytes, self.kind, f"{self.name} {old.value}->{new.value}")
        if before is not None and before is not after:
            self.ledger.credit(before, self.nbytes, self.kind, f"{self.name} {old.value}->{new.value}")
        self.residence = new

    def __repr__(self) -> str:
        return f"Part({self.name}, {self.residence.value}, {self.nbytes} B)"


__all__ = [
    "LEGAL_MOVES",
    "BudgetError",
    "BudgetExceeded",
    "BufferPool",
    "IllegalMove",
    "OffloadError",
    "Part",
    "Residence",
    "Sample",
    "Tier",
    "TierLedger",
]
