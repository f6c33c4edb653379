"""Gemini's state made resident for a checkpoint or a deferred model's values: the chunks'
masters and optimizer states brought into host memory (all of them for a checkpoint's save or
load, a group at a time for filling a deferred model), viewed by the optimizer's pieces and
state as training views them, and put back under the budgets after."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from tessera.memory.chunks import Chunk
from tessera.memory.manager import ChunkMemory
from tessera.memory.tiered_chunk import EMPTY_FOR, TieredChunk
from tessera.memory.tiers import Part, Residence, Tier, TierLedger
from tessera.optim.streams import StreamStates
from tessera.zero.sharded import ShardedOptimizer


class Residency:
    """The checkpoint and filling side of :class:`~tessera.gemini.tiered.TieredResidence`
    (a mixin over its chunks, parts, pieces and optimizer)."""

    sharded: ShardedOptimizer
    memory: ChunkMemory
    ledger: TierLedger
    chunks: list[TieredChunk]
    streams: list[str]
    separate_master: bool
    _parts: list[dict[str, Part]]
    states: StreamStates
    _resident: bool
    policy_host_reserve: int
    frozen_chunks: list[TieredChunk]
    _frozen_held: dict[int, torch.Tensor]

    def _masters(self, parts: dict[str, Part]) -> Part:
        """The part the optimizer steps: the fp32 masters, or in fp32 the parameters."""
        return parts["master" if self.separate_master else "params"]

    def _view_masters(self, index: int, where: Tier, fill: bool = True) -> torch.Tensor:
        """Chunk ``index``'s masters held in ``where`` and viewed by its pieces (the caller is done)."""
        master = self.memory.need(self._masters(self._parts[index]), where, fill=fill)
        for piece, _, a, b in self.sharded.pieces[index]:
            piece.data = master[a:b]
        return master

    def _empty_pieces(self, index: int) -> None:
        """Chunk ``index``'s pieces view nothing again (between steps)."""
        for piece, _, _, _ in self.sharded.pieces[index]:
            piece.data, piece.grad = EMPTY_FOR[piece.device], None

    @contextmanager
    def resident(self) -> Iterator[None]:
        """Every chunk's masters and optimizer states in host memory, the pieces viewing the
        masters and the optimizer's state viewing the states parts, for a checkpoint's save or
        load (or a deferred model's materialisation) inside the block. The rank's whole shard
        passes through host memory for it, budgets lifted; after the block the states the
        optimizer was given (a load) go into the parts, and parts move back under the budgets."""
        if self._resident:
            yield
            return
        self._resident = True
        held: list[Part] = []
        try:
            with self.ledger.lifted(), self.memory.untraced():
                for chunk, parts in zip(self.chunks, self._parts):
                    self._view_masters(chunk.index, Tier.HOST)
                    held.append(self._masters(parts))
                    if "states" in parts and parts["states"].residence is not Residence.EMPTY:
                        states = self.memory.need(parts["states"], Tier.HOST)
                        held.append(parts["states"])
                        held_states = [(piece, a, b) for piece, _, a, b in self.sharded.pieces[chunk.index]]
                        self.states.bind(held_states, states, chunk.shard_numel)
                for chunk in self.frozen_chunks:
                    assert chunk.part is not None
                    self._frozen_held[id(chunk)] = self.memory.need(chunk.part, Tier.HOST)
                    held.append(chunk.part)
                try:
                    yield
                finally:
                    for chunk, parts in zip(self.chunks, self._parts):
                        self._take_states(chunk, parts)
                    for part in held:
                        self.memory.done(part)
        finally:
            self._resident = False
            self._frozen_held.clear()
        self.memory.rebalance()

    def groups(self) -> list[list[int]]:
        """Chunk indices in runs whose masters (and, with bf16/fp16, parameters) that are not in
        memory yet fit together in the host room left, less what parts passing through need."""
        unbounded = self.ledger.budget[Tier.HOST] is None
        room = float("inf") if unbounded else max(1.0, self.ledger.free(Tier.HOST) - self.policy_host_reserve)
        out: list[list[int]] = [[]]
        used = 0.0
        kinds = ("params", "master") if self.separate_master else ("params",)
        for chunk, parts in zip(self.chunks, self._parts):
            size = sum(parts[k].nbytes for k in kinds if parts[k].tensor is None)  # in memory already: no room
            if out[-1] and used + size > room:
                out.append([])
                used = 0.0
            out[-1].append(chunk.index)
            used += size
        return out

    @contextmanager
    def filling(self, indices: list[int]) -> Iterator[list[tuple[str, nn.Parameter, nn.Parameter, int, int]]]:
        """The pieces of the chunks ``indices``, viewing their masters in host memory, to be
        written whole inside the block (a deferred model's values); after it the parameters
        follow the masters and the parts go where the budgets let them."""
        taken: list[Part] = []
        with self.memory.untraced():
            try:
                for i in indices:
                    part = self._masters(self._parts[i])
                    where = Tier.DEVICE if part.residence is Residence.DEVICE else Tier.HOST
                    # as packed: a tensor made before (a LoRA adapter beside a deferred base) keeps its
                    # values, the deferred ones' ranges and the padding are zeros until filled
                    self._view_masters(i, where)
                    taken.append(part)
                chosen = set(indices)
                slot_of = self.sharded._slot_of
                yield [p for p in self.sharded.held_pieces() if slot_of[id(p[1])][0].index in chosen]
                for i in indices:
                    self._fresh_values(self._parts[i])
            finally:
                for i in indices:
                    self._empty_pieces(i)
                for part in taken:
                    self.memory.done(part)

    def _fresh_values(self, parts: dict[str, Part]) -> None:
        """New values reached a chunk's masters (held in memory): their file is out of date, and
        with bf16/fp16 the parameters follow."""
        master_part = self._masters(parts)
        self.memory.dirty(master_part)
        if self.separate_master:
            master = self.memory.need(master_part, Tier.HOST)
            params = self.memory.need(parts["params"], Tier.HOST, fill=False)
            params.copy_(master)
            self.memory.dirty(parts["params"])
            self.memory.done(parts["params"])
            self.memory.done(master_part)

    def _take_states(self, chunk: TieredChunk, parts: dict[str, Part]) -> None:
        """After a resident block: the optimizer's states of ``chunk``'s pieces into its states
        part (a load replaced them), its scalars kept; the pieces emptied again."""
        held = [(piece, a, b) for piece, _, a, b in self.sharded.pieces[chunk.index]]
        if self.streams and any(self.sharded.optimizer.state.get(piece) for piece, _, _ in held):
            part = parts["states"]
            states = self.memory.need(part, Tier.HOST, fill=part.residence is not Residence.EMPTY)
            self.states.unbind(held, states, chunk.shard_numel)
            self.memory.dirty(part)
            self.memory.done(part)
        else:
            self.states.unbind(held, None, chunk.shard_numel)
        self._empty_pieces(chunk.index)

    def masters_loaded(self) -> None:
        """New values reached the masters inside :meth:`resident` (a checkpoint loaded); a no-op
        after :meth:`filling`, which has already made the parameters follow."""
        if not self._resident:
            return
        with self.memory.untraced():
            for parts in self._parts:
                self._fresh_values(parts)
            for chunk in self.frozen_chunks:  # their files are out of date
                assert chunk.part is not None
                self.memory.dirty(chunk.part)

    def frozen_shard(self, chunk: Chunk) -> torch.Tensor:
        """A frozen chunk's shard, in host memory inside :meth:`resident` or :meth:`frozen_filling`."""
        shard = self._frozen_held.get(id(chunk))
        if shard is None:
            raise RuntimeError(f"frozen chunk {chunk.index}: its shard is read inside a checkpoint session")
        return shard

    @contextmanager
    def frozen_filling(self, chunk: TieredChunk) -> Iterator[None]:
        """A frozen chunk's shard in host memory inside the block, to be written whole (a
        deferred model's values); its part takes them after."""
        part = chunk.part
        assert part is not None
        with self.memory.untraced():
            self._frozen_held[id(chunk)] = self.memory.need(part, Tier.HOST, fill=False)
            try:
                yield
            finally:
                del self._frozen_held[id(chunk)]
                self.memory.dirty(part)
                self.memory.done(part)
