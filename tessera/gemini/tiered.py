"""Gemini's residence: every chunk's parts placed on the device, in host memory or on disk, and
each chunk stepped where its parts live.

Per chunk (this rank's shard of a group of parameters) the memory manager holds up to four
parts: ``params`` (the compute dtype), ``master`` (fp32 masters, with bf16/fp16 only; in fp32 the
parameters are the masters), ``grads`` (fp32, while a step is being accumulated) and ``states``
(the optimizer's per-element states, one stream of the shard's size each: Adam's two moments,
LARS's momentum). A forward or backward pass gathers a chunk on the device (its params part
comes up from wherever it is); the reduced shard of a chunk's gradients is added to its grads part.

The step walks the chunks in order and steps each *where it lives*: on the device when its
states are there, else in host memory (parts on disk are read ahead in the background and
written back after). The user's optimizer does the arithmetic: for one chunk at a time its
parameter groups hold that chunk's pieces (views into the masters, with their gradients) and
its state holds views into the states part, so any optimizer whose state is per-element tensors
(SGD, Adam, AdamW, tessera's LAMB and LARS) steps exactly as it would unsharded. Gradient
scaling (fp16 unscaling, clipping) is applied to each chunk's gradients when it is stepped, and
the gradient norm comes from per-parameter squares taken as the gradients arrive.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from tessera import comm
from tessera.comm import Pending
from tessera.errors import ConfigError
from tessera.gemini.options import GeminiOptions
from tessera.gemini.residence import Residency
from tessera.memory.budgets import check_budgets, working_set
from tessera.memory.chunks import Chunk
from tessera.memory.disk import DiskIO
from tessera.memory.manager import ChunkMemory
from tessera.memory.placement import AutoPolicy, StaticPolicy
from tessera.memory.report import map_large_allocations, parts_by_kind, tiered_report, trim_heap
from tessera.memory.search import search_chunk_numel
from tessera.memory.tiered_chunk import EMPTY_FOR, TieredChunk
from tessera.memory.tiers import Part, Residence, Tier, TierLedger
from tessera.optim.norms import norm_from_slot_squares
from tessera.optim.streams import StreamStates, step_only
from tessera.zero.frozen import FrozenStore
from tessera.zero.sharded import Residence as ShardResidence
from tessera.zero.sharded import ShardedOptimizer


class TieredResidence(Residency, ShardResidence):
    """Parts placed over the tiers per ``options`` (see the module docstring)."""

    chunk_type = TieredChunk

    def __init__(self, options: GeminiOptions) -> None:
        self.options = options
        self.ledger = TierLedger(options.device_budget, options.host_budget, keep_samples=options.keep_samples)
        self.tight_heap = options.map_large_buffers or (
            options.map_large_buffers is None and options.host_budget is not None
        )  # freed memory goes back to the system at once (mappings, heap trims)
        self.policy: StaticPolicy | AutoPolicy = (
            StaticPolicy(options.params_offload, options.optimizer_offload)
            if options.placement == "static"
            else AutoPolicy()
        )
        self._parts: list[dict[str, Part]] = []
        self.frozen_chunks: list[TieredChunk] = []
        self._frozen_held: dict[int, torch.Tensor] = {}  # inside resident(): each frozen chunk's shard
        self._factors: list[torch.Tensor] = []
        self._resident = False

    # ---- construction ------------------------------------------------------------------------
    def plan(self, sharded: ShardedOptimizer, numels: list[int], labels: list[int], sizes: list[int]) -> int:
        """The optimizer's state streams and the memory; the chunk capacity (``gemini.chunk_mb``,
        else the one that wastes least); then fail now, naming the smallest budgets that would
        work, when one chunk and the largest layer's working set cannot fit
        (``tessera.memory.budgets``). The policy keeps that room."""
        self.sharded = sharded
        self.separate_master = sharded.param_dtype != torch.float32
        self.states = StreamStates(sharded.optimizer)  # the optimizer's per-element states: in the states parts
        self.streams = self.states.streams
        if self.tight_heap:
            map_large_allocations()  # freed buffers go back to the system: the resident set follows the ledger
        options, ctx = self.options, sharded.ctx
        disk = DiskIO(options.offload_dir, ctx.rank) if options.offload_dir is not None else None
        self.memory = ChunkMemory(ctx.device, self.ledger, self.policy, disk, prefetch=options.prefetch)
        self.memory.on_pressure.append(sharded.finish_oldest)
        self._slot_sq = torch.zeros(len(numels), dtype=torch.float32, device=ctx.device)
        if options.chunk_mb is None:
            chunk_numel = search_chunk_numel(numels, labels, sharded.group.size).capacity
        else:
            chunk_numel = sharded.elements_in(options.chunk_mb)
        fp32 = len(self.streams) + int(self.separate_master) + 1  # states, masters, gradients
        need = working_set(numels, labels, sizes, chunk_numel, sharded.element_size, fp32, disk is not None)
        check_budgets(need, options.device_budget, options.host_budget, disk)
        self.policy_host_reserve = need.host  # host room kept for parts passing through
        self.policy.configure(need, options.device_budget, options.host_budget)
        return chunk_numel

    def attach(self) -> None:
        self.chunks: list[TieredChunk] = self.sharded.chunks  # type: ignore[assignment]
        for chunk in self.chunks:
            self._parts.append(self._make_parts(chunk))

    def _make_parts(self, chunk: TieredChunk) -> dict[str, Part]:
        """The chunk's parts, its parameters (and fp32 masters) placed by the policy."""
        n, fp32 = chunk.shard_numel, torch.float32
        sizes = {"params": (n, self.sharded.param_dtype), "master": (n, fp32), "grads": (n, fp32)}
        sizes["states"] = (n * len(self.streams), fp32)
        kinds = [k for k in sizes if (k != "master" or self.separate_master) and (k != "states" or self.streams)]
        parts = {k: self.memory.add(Part(chunk.index, k, *sizes[k], self.ledger)) for k in kinds}
        for kind in ("params", "master") if self.separate_master else ("params",):  # placed with their values
            self.memory.place(
                parts[kind], self.policy.initial(parts[kind], self.memory), chunk.shard.to(sizes[kind][1])
            )
        chunk.manage(self.memory, parts["params"])
        return parts

    def attach_frozen(self, frozen: FrozenStore) -> None:
        """Each frozen chunk's shard becomes a ``frozen`` part, placed in ``options.frozen_tier``
        (or as the policy places parameters) and brought to the device only while gathered."""
        tier = {"device": Tier.DEVICE, "host": Tier.HOST, "disk": Tier.DISK}.get(self.options.frozen_tier)
        if tier is Tier.DISK and self.memory.disk is None:
            raise ConfigError("gemini.frozen_tier='disk' needs the disk tier: give gemini.offload_dir")
        self.frozen_chunks = frozen.chunks  # type: ignore[assignment]
        for chunk in self.frozen_chunks:
            part = self.memory.add(Part(chunk.index, "frozen", chunk.shard_numel, chunk.shard.dtype, self.ledger))
            if tier is not None:
                self.policy.pinned[part.name] = tier
                chunk.retainable = tier is Tier.DEVICE  # kept off the device: streamed in for each use
            self.memory.place(part, self.policy.initial(part, self.memory), chunk.shard)
            chunk.manage(self.memory, part)

    def piece_data(self, chunk: Chunk, start: int, end: int) -> torch.Tensor:
        return EMPTY_FOR[self.sharded.ctx.device]  # the pieces view their masters while stepped

    # ---- gradients ---------------------------------------------------------------------------
    def bucket_opened(self, chunk: Chunk, nbytes: int) -> None:
        self.memory.reserve(Tier.DEVICE, nbytes, "bucket", f"chunk{chunk.index} bucket")

    def bucket_closed(self, chunk: Chunk, nbytes: int) -> None:
        self.memory.unreserve(Tier.DEVICE, nbytes, "bucket", f"chunk{chunk.index} reduced")

    def add_gradient(self, chunk: Chunk, shard: torch.Tensor) -> None:
        """The reduced shard is added to the chunk's fp32 gradients; when the step's gradients
        are complete, their per-parameter squares are taken."""
        grads = self._parts[chunk.index]["grads"]
        fresh = grads.residence is Residence.EMPTY
        g = self.memory.need(grads, self._work_tier(grads))
        if fresh:
            g.copy_(shard)
        else:
            g.add_(shard.to(g.device, torch.float32))
        self.memory.dirty(grads)
        if self.sharded.final:
            self.sharded.slot_squares(self._slot_sq, chunk, g)
        self.memory.done(grads)

    def backward_done(self) -> None:
        if self.tight_heap:
            trim_heap()  # the activations just freed go back to the system before the step reads parts

    def _work_tier(self, part: Part) -> Tier:
        """Where a part is used outside the step: its home's memory (static), else the device."""
        home = self.policy.home(part)
        return Tier.HOST if home in (Tier.HOST, Tier.DISK) else Tier.DEVICE

    def grad_norm(self) -> torch.Tensor:
        """The whole model's gradient norm (after every scaling so far); collective."""
        sharded = self.sharded
        norm = norm_from_slot_squares(self._slot_sq, sharded.slot_placements, sharded.ctx, over=sharded.group)
        for factor in self._factors:
            norm = norm * factor.abs()
        return norm

    def scale_gradients(self, factor: torch.Tensor | float) -> None:
        """Multiply every gradient by ``factor`` (applied to each chunk when it is stepped)."""
        device = self.sharded.ctx.device
        self._factors.append(torch.as_tensor(factor, dtype=torch.float32, device=device).detach().clone())

    def zero_grad(self) -> None:
        for parts in self._parts:
            self.memory.drop(parts["grads"])
        self._slot_sq.zero_()
        self._factors.clear()

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> None:
        """Step every chunk where it lives (see the module docstring); a chunk still gathered
        takes every member's new shard at once, overlapping the next chunks' steps."""
        refreshing: list[tuple[TieredChunk, Pending]] = []
        for chunk in self.chunks:
            self._step_chunk(chunk)
            pending = chunk.refresh_full(async_op=True)
            refreshing += [(chunk, pending)] if pending is not None else []
            while len(refreshing) > (2 if chunk is not self.chunks[-1] else 0):
                refreshed, pending = refreshing.pop(0)
                pending.wait()
                refreshed.refreshed()
        if self.tight_heap:
            trim_heap()  # the activations freed since the forward go back to the system, not into holes
        self._factors.clear()
        self.sharded.gradients_consumed()
        self._slot_sq.zero_()

    def _ungathered(self) -> int:
        """Device bytes the chunks not gathered now would take gathered."""
        return sum(c.full_bytes for c in self.chunks if not c.counted)

    def warmed_up(self, activations: int) -> None:
        """The warm-up step traced ``activations`` bytes here: the policy keeps room for the most
        any replica traced. Every rank of a chunk's group must decide alike whether a prefetching
        gather finds room (a gather one rank skips and another starts would pair collectives
        wrongly), and an MoE layer's saved tensors differ in size from rank to rank."""
        most = torch.tensor([float(activations)], device=self.sharded.ctx.device)
        comm.all_reduce(most, self.sharded.group, op="max")  # the ranks sharing the chunks
        self.policy.keep_room_for(int(most.item()), self._parts, self._ungathered(), self.memory)

    def _step_chunk(self, chunk: TieredChunk) -> None:
        parts = self._parts[chunk.index]
        where = self.policy.step_tier(parts, self.memory, self._ungathered)  # summed only if asked
        memory = self.memory
        held: list[Part] = []

        def need(name: str, fill: bool = True) -> torch.Tensor:
            tensor = memory.need(parts[name], where, fill=fill)
            held.append(parts[name])
            return tensor

        try:
            grads = parts["grads"]
            grad = need("grads") if grads.residence is not Residence.EMPTY else None
            if grad is not None:
                for factor in self._factors:
                    grad.mul_(factor.to(grad.device))
            master = self._view_masters(chunk.index, where)  # the pieces view the masters and their gradients
            held.append(self._masters(parts))
            first = parts.get("states") is not None and parts["states"].residence is Residence.EMPTY
            states = need("states", fill=not first) if "states" in parts else None
            pieces = self.sharded.pieces[chunk.index]
            for piece, slot, a, b in pieces:
                piece.grad = grad[a:b] if grad is not None and self.sharded.has_grad(slot) else None
            held_states = [(piece, a, b) for piece, _, a, b in pieces]
            if states is not None and not first:
                self.states.bind(held_states, states, chunk.shard_numel)
            group = self.sharded.param_group_of(chunk)
            step_only(self.sharded.optimizer, group, [piece for piece, _, _, _ in pieces], self.sharded.empty)
            self.states.unbind(held_states, states, chunk.shard_numel)
            if states is not None:
                memory.dirty(parts["states"])
            self._empty_pieces(chunk.index)
            memory.dirty(self._masters(parts))
            if self.separate_master:  # the parameters follow their masters
                params = memory.need(parts["params"], where, fill=False)
                held.append(parts["params"])
                params.copy_(master)
                memory.dirty(parts["params"])
        finally:
            for part in held:
                memory.done(part)
        memory.drop(parts["grads"])

    def master_from_params(self, chunk: Chunk) -> None:
        """New parameter values reached ``chunk``'s params part: the fp32 masters follow."""
        if not self.separate_master:
            return
        parts = self._parts[chunk.index]
        params = self.memory.need(parts["params"], Tier.DEVICE)
        master = self.memory.need(parts["master"], Tier.DEVICE, fill=False)
        master.copy_(params)
        self.memory.dirty(parts["master"])
        self.memory.done(parts["master"])
        self.memory.done(parts["params"])

    # ---- whole values, memory ----------------------------------------------------------------
    def lifted(self) -> AbstractContextManager[None]:
        return self.ledger.lifted()

    @contextmanager
    def master_shard(self, chunk: Chunk) -> Iterator[torch.Tensor]:
        part = self._parts[chunk.index]["master"]
        shard = self.memory.need(part, Tier.DEVICE)
        try:
            yield shard.clone()
        finally:
            self.memory.done(part)

    def memory_parts(self) -> dict[str, list[torch.Tensor]]:
        return parts_by_kind(self.memory.parts)

    def report(self) -> dict[str, Any]:
        return tiered_report(self.memory)

    def close(self) -> None:
        """Wait for disk transfers and remove this rank's offload files (also when the optimizer
        failed while being built)."""
        memory = getattr(self, "memory", None)
        if memory is not None:
            memory.close()


__all__ = ["TieredResidence"]
