"""The disk tier's transfers: parts written to their files and read back, each in flight in a
background thread of :class:`~tessera.memory.disk.DiskIO`, and the residences a part passes
through on the way (HOST -> WRITING -> DISK, DISK -> READING -> HOST; see
:mod:`tessera.memory.tiers`). A part in flight keeps its host buffer, counted as host memory,
until its transfer is finished here; a failed transfer leaves the part where its values still are."""

from __future__ import annotations

import torch

from tessera.memory.buffers import TierBuffers, mib
from tessera.memory.disk import DiskIO, Transfer
from tessera.memory.tiers import BudgetError, Part, Residence, Tier


class DiskTransfers:
    """The transfers in flight, by part name, in the order they started. ``disk``: the disk
    tier (None: there is none, and a part that must go there is a :class:`BudgetError`);
    ``buffers``: where a host buffer goes when its part leaves memory."""

    def __init__(self, disk: DiskIO | None, buffers: TierBuffers) -> None:
        self.disk = disk
        self.buffers = buffers
        self._in_flight: dict[str, tuple[Part, Transfer]] = {}

    def place(self, part: Part, values: torch.Tensor | None) -> None:
        """Make an empty part on disk: its file written from ``values`` (zeros when None)
        straight from the caller's memory (no host room taken), waiting for the write."""
        if self.disk is None:
            raise BudgetError(f"{part.name} has no room in memory and there is no disk tier: give gemini.offload_dir")
        source = torch.zeros(part.numel, dtype=part.dtype) if values is None else values.reshape(-1)
        self.disk.write(part.name, source.to("cpu", part.dtype).contiguous()).wait()
        part.file_valid = True
        part.move_to(Residence.DISK)

    def write(self, part: Part, wait: bool) -> None:
        """Send a host part to disk: dropped from memory at once when its file is current, else
        written in the background (``wait``: until the write ends)."""
        if self.disk is None:
            raise BudgetError(
                f"{part.name} must leave host memory but there is no disk tier: give gemini.offload_dir, or raise "
                f"gemini.host_budget (now {mib(self.buffers.ledger.budget[Tier.HOST])})"
            )
        assert part.tensor is not None
        if part.file_valid:
            buffer = part.tensor
            part.move_to(Residence.DISK)
            part.tensor = None
            self.buffers.give(Tier.HOST, buffer)
            return
        part.move_to(Residence.WRITING)
        self._in_flight[part.name] = (part, self.disk.write(part.name, part.tensor))
        if wait:
            self.finish(part)

    def read(self, part: Part, buffer: torch.Tensor) -> Transfer:
        """Start reading a part on disk into ``buffer`` (a host buffer whose room was made)."""
        assert self.disk is not None
        part.move_to(Residence.READING)
        part.tensor = buffer
        transfer = self.disk.read(part.name, buffer)
        self._in_flight[part.name] = (part, transfer)
        return transfer

    def finish(self, part: Part) -> None:
        """Wait for ``part``'s disk transfer, if one is in flight, and record where it is now."""
        found = self._in_flight.pop(part.name, None)
        if found is None:
            return
        try:
            found[1].wait()
        except BaseException:
            if part.residence is Residence.READING:  # nothing was lost: the file is still there
                buffer, part.tensor = part.tensor, None
                part.move_to(Residence.HOST)
                part.file_valid = True
                part.move_to(Residence.DISK)
                if buffer is not None:
                    self.buffers.give(Tier.HOST, buffer)
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
                self.buffers.give(Tier.HOST, buffer)

    def reap(self) -> None:
        """Record the disk transfers that have finished."""
        for part, transfer in list(self._in_flight.values()):
            if transfer.done():
                self.finish(part)

    def settle(self) -> None:
        """Wait for every disk transfer in flight."""
        for part, _ in list(self._in_flight.values()):
            self.finish(part)

    def in_flight(self, residence: Residence) -> list[Part]:
        """The parts in flight that are in ``residence`` (WRITING or READING), oldest first."""
        return [part for part, _ in self._in_flight.values() if part.residence is residence]

    def drop_file(self, part: Part) -> None:
        """Forget a part that only its file holds (its values are no longer needed)."""
        part.move_to(Residence.EMPTY)
        part.file_valid = False
        if self.disk is not None:
            self.disk.remove(part.name)
