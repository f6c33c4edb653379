"""A chunk whose shard is a managed part: gathering it first brings the shard to the device
(from host memory or disk), and the gathered buffer is counted in the device tier."""

from __future__ import annotations

import torch

from tessera import comm
from tessera.comm import Pending
from tessera.memory.chunks import Chunk, ChunkState, IllegalTransition
from tessera.memory.manager import ChunkMemory
from tessera.memory.tiers import BudgetError, Part, Tier


class _EmptyFor(dict[torch.device, torch.Tensor]):
    """An empty tensor per device: what a managed shard, or a piece of it, views while its part
    is not held."""

    def __missing__(self, device: torch.device) -> torch.Tensor:
        value = self[device] = torch.empty(0, device=device)
        return value


EMPTY_FOR = _EmptyFor()
_NOTHING = EMPTY_FOR[torch.device("cpu")]


class TieredChunk(Chunk):
    """A :class:`~tessera.memory.chunks.Chunk` of the Gemini store. Until :meth:`manage` is
    called it behaves as a plain chunk (the store fills it); after, its shard is ``part``, held
    on the device only while a gather uses it, and its full buffer is counted in the device
    tier while gathered. A prefetching gather (``async_op``) that finds no room is skipped: the
    chunk is gathered when it is needed."""

    memory: ChunkMemory | None = None
    part: Part | None = None
    _counted = False
    retainable = True  # may stay gathered after use while the device has room (not a base kept off it)

    def manage(self, memory: ChunkMemory, part: Part) -> None:
        if self.state is not ChunkState.SHARDED:
            raise IllegalTransition(f"chunk {self.index}: managed while {self.state.value}")
        self.memory, self.part = memory, part
        self.shard = _NOTHING

    @property
    def counted(self) -> bool:
        """Whether the gathered buffer is held (and counted in the device tier) now."""
        return self._counted

    @property
    def full_bytes(self) -> int:
        return self.padded_numel * self.full.element_size()

    def gather(self, async_op: bool = False) -> None:
        memory, part = self.memory, self.part
        if memory is None or part is None or self.state is not ChunkState.SHARDED:
            if memory is not None:
                memory.forget_retained(self)  # in use again: no longer free to let go
            super().gather(async_op)
            return
        try:
            memory.reserve(Tier.DEVICE, self.full_bytes, "gathered", f"chunk{self.index} gathered")
        except BudgetError:
            if async_op:
                return  # a prefetch: gathered when needed
            raise
        self._counted = True
        self.shard = memory.need(part, Tier.DEVICE)
        super().gather(async_op=True)
        if not async_op:
            self.wait()

    def wait(self) -> None:
        was_gathering = self.state is ChunkState.GATHERING
        super().wait()
        if was_gathering and self.memory is not None and self.part is not None:
            self.memory.done(self.part)
            self.shard = _NOTHING

    def release(self) -> None:
        memory = self.memory
        if memory is not None and memory.retaining and self.retainable and self.state is ChunkState.GATHERED:
            memory.retain(self)  # kept gathered for the backward pass while the device has room
            return
        if memory is not None:
            memory.forget_retained(self)
        was_held = self.state is not ChunkState.SHARDED and not self.keep_full
        super().release()
        if was_held and self._counted and self.memory is not None:
            self._counted = False
            self.memory.unreserve(Tier.DEVICE, self.full_bytes, "gathered", f"chunk{self.index} released")

    def scatter_from_full(self) -> None:
        """New values were written into the gathered buffer: this member's part takes them."""
        memory, part = self.memory, self.part
        if memory is None or part is None:
            super().scatter_from_full()
            return
        if self.state is not ChunkState.GATHERED:
            raise IllegalTransition(f"chunk {self.index}: cannot take a shard while {self.state.value}")
        lo, hi = self.shard_range
        shard = memory.need(part, Tier.DEVICE, fill=False)
        shard.copy_(self.full[lo:hi])
        memory.dirty(part)
        memory.done(part)

    def refresh_full(self, async_op: bool = False) -> Pending | None:
        """A chunk still gathered (kept while the device had room) takes every member's new
        shard, so that the next forward pass needs no gather for it: the returned gather is in
        flight, :meth:`refreshed` after it. Nothing for a chunk not gathered."""
        memory, part = self.memory, self.part
        if memory is None or part is None or self.state is not ChunkState.GATHERED:
            return None
        memory.forget_retained(self)  # not let go while its gather is in flight
        shard = memory.need(part, Tier.DEVICE)
        return comm.all_gather_into(self.full, shard, self.group, async_op=True)

    def refreshed(self) -> None:
        """The gather of :meth:`refresh_full` arrived: the shard's part may go, and the chunk is
        kept gathered until room is needed."""
        assert self.memory is not None and self.part is not None
        self.memory.done(self.part)
        self.memory.retain(self)

    def held_bytes(self) -> int:
        full = self.full.untyped_storage().nbytes()
        part = self.part
        return full + (part.nbytes if part is not None and part.tensor is not None else 0)


__all__ = ["TieredChunk"]
