"""Gemini's optimizer: ZeRO-3 over the data axis with every chunk's model state placed on the
device, in host memory or on disk, and each chunk stepped where its state lives.

Per chunk (this rank's shard of a group of parameters, packed in model order) the memory
manager holds up to four parts: ``params`` (the compute dtype), ``master`` (fp32 masters, with
bf16/fp16 only; in fp32 the parameters are the masters), ``grads`` (fp32, while a step is being
accumulated) and ``states`` (the optimizer's per-element states, one stream of the shard's size
each: Adam's two moments, LARS's momentum). A forward or backward pass gathers a chunk on the
device (its params part comes up from wherever it is); the gradients of a chunk are
reduce-scattered as soon as the backward completes them and added to its grads part.

The step walks the chunks in order and steps each *where it lives*: on the device when its
states are there, else in host memory (parts on disk are read ahead in the background and
written back after). The user's optimizer does the arithmetic: for one chunk at a time its
parameter groups hold that chunk's pieces (views into the masters, with their gradients) and
its state holds views into the states part, so any optimizer whose state is per-element
tensors (SGD, Adam, AdamW, tessera's LAMB and LARS) steps exactly as it would unsharded.
Gradient scaling (fp16 unscaling, clipping) is applied to each chunk's gradients when it is
stepped, and the gradient norm comes from per-parameter squares taken as the gradients arrive.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from tessera import comm
from tessera.context import ParallelContext
from tessera.context.placement import Placement, ZeroSlot, placement_of, set_placement, update_placement
from tessera.errors import ConfigError
from tessera.gemini.chunk import TieredChunk
from tessera.gemini.options import GeminiOptions
from tessera.gemini.residence import EMPTY_FOR, Residency
from tessera.memory.chunks import ChunkState, ChunkStore, Slot, WholeStateDict
from tessera.memory.deferred import set_data
from tessera.memory.disk import DiskIO
from tessera.memory.manager import ChunkMemory
from tessera.memory.placement import AutoPolicy, StaticPolicy
from tessera.memory.report import map_large_allocations, trim_heap
from tessera.memory.search import plan, search_chunk_numel
from tessera.memory.tiers import BudgetError, Part, Residence, Tier, TierLedger
from tessera.optim.norms import norm_from_slot_squares
from tessera.optim.wrapping import WrapsOptimizer, optimizer_entries
from tessera.zero.release import ReleaseOnUse

PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_MIB = 2**20


def state_streams(optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of the per-element states ``optimizer``'s kind keeps for a parameter, found by
    stepping a copy of it over a two-element parameter."""
    probe = nn.Parameter(torch.zeros(2))
    probe.grad = torch.ones(2)
    accepted = inspect.signature(type(optimizer).__init__).parameters
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    try:
        twin = type(optimizer)([probe], **settings)
        twin.step()
    except Exception as error:
        raise ConfigError(
            f"gemini: cannot tell which states {type(optimizer).__name__} keeps per parameter (building it as "
            f"{type(optimizer).__name__}(params, **optimizer.defaults) and stepping it failed: {error}); use an "
            "optimizer whose constructor takes its defaults back (torch.optim's, tessera.optim's)"
        ) from error
    return sorted(k for k, v in twin.state[probe].items() if isinstance(v, torch.Tensor) and v.shape == probe.shape)


class GeminiOptimizer(WrapsOptimizer, Residency):
    """The user's ``optimizer`` over chunks of ``model``'s parameters placed by ``options``
    (see the module docstring). Behaves like a ``torch.optim.Optimizer`` for the engine and for
    LR schedulers (``param_groups``, ``state``, ``step``, ``zero_grad``)."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: ParallelContext, options: GeminiOptions
    ) -> None:
        self.ctx = ctx
        self.options = options
        self.group = ctx.replicas
        self.optimizer = optimizer
        self.param_dtype = PARAM_DTYPES[options.precision]
        self.separate_master = self.param_dtype != torch.float32
        self.streams = state_streams(optimizer)
        entries, group_of = optimizer_entries(model, optimizer)
        if not entries:
            raise ValueError("gemini: the optimizer holds no parameters")
        self.params = [p for _, p in entries]
        element = torch.empty((), dtype=self.param_dtype).element_size()
        if options.chunk_mb is None:
            self.chunk_plan = search_chunk_numel([p.numel() for p in self.params], group_of, self.group.size)
            chunk_numel = self.chunk_plan.capacity
        else:
            chunk_numel = max(1, int(options.chunk_mb * _MIB) // element)
            largest = max(p.numel() for p in self.params)
            if largest > chunk_numel:
                raise ConfigError(
                    f"gemini.chunk_mb={options.chunk_mb}: the largest parameter needs "
                    f"{largest * element / _MIB:.3f} MiB; give at least that, or chunk_mb=None to search"
                )
            self.chunk_plan = plan([p.numel() for p in self.params], group_of, chunk_numel, self.group.size)
        # the memory: tiers, policy, disk
        self.ledger = TierLedger(options.device_budget, options.host_budget, keep_samples=options.keep_samples)
        self.tight_heap = options.map_large_buffers or (
            options.map_large_buffers is None and options.host_budget is not None
        )  # freed memory goes back to the system at once (mappings, heap trims)
        if self.tight_heap:
            map_large_allocations()  # freed buffers go back to the system: the resident set follows the ledger
        self.policy: StaticPolicy | AutoPolicy = (
            StaticPolicy(options.params_offload, options.optimizer_offload)
            if options.placement == "static"
            else AutoPolicy()
        )
        disk = DiskIO(options.offload_dir, ctx.rank) if options.offload_dir is not None else None
        self.memory = ChunkMemory(ctx.device, self.ledger, self.policy, disk, prefetch=options.prefetch)
        self._check_budgets(entries, group_of, chunk_numel, element)
        # the chunks
        self._slot_of: dict[int, tuple[TieredChunk, Slot]] = {}
        self.chunks: list[TieredChunk] = []

        def adopt(chunk: Any) -> None:
            for slot in chunk.slots:
                p = entries[slot.index][1]
                set_data(p, chunk.view(slot))
                self._slot_of[id(p)] = (chunk, slot)
                update_placement(p, storage=self)
            self.chunks.append(chunk)

        self.store = ChunkStore(
            entries, self.group, chunk_numel=chunk_numel, dtype=self.param_dtype, bins=group_of, on_close=adopt,
            device=ctx.device, chunk_type=TieredChunk, fixed_size=True,
        )  # fmt: skip
        self._chunk_group = {c.index: group_of[c.slots[0].index] for c in self.chunks}
        self._parts: list[dict[str, Part]] = []
        for chunk in self.chunks:
            self._parts.append(self._make_parts(chunk))
        self._install_pieces(entries)
        # gradients and norms
        self._buckets: dict[int, torch.Tensor] = {}
        self._written: dict[int, set[int]] = {}  # chunk index -> slots whose gradient is in its bucket
        self._in_flight: list[tuple[TieredChunk, Any, torch.Tensor]] = []
        self.memory.on_pressure.append(self._finish_oldest)
        self._ready: dict[int, int] = {}
        self._has_grad: set[int] = set()
        self._slot_sq = torch.zeros(len(entries), dtype=torch.float32, device=ctx.device)
        self._factors: list[torch.Tensor] = []
        self._final = True
        self._callback_queued = False
        self._trainable = {c.index: len(c.slots) for c in self.chunks}
        self._hooks_pending = model.register_forward_pre_hook(self._install_grad_hooks)
        self._release = ReleaseOnUse(model, self.store, self._slot_of)  # type: ignore[arg-type]
        chunk_of = {key: chunk for key, (chunk, _) in self._slot_of.items()}
        self._state_dicts = WholeStateDict(model, chunk_of, on_loaded=self._master_from_params)
        self.steps = 0
        self._resident = False

    # ---- construction ------------------------------------------------------------------------
    def _check_budgets(
        self, entries: list[tuple[str, nn.Parameter]], group_of: list[int], chunk_numel: int, element: int
    ) -> None:
        """Fail now, naming the smallest budgets that would work, when one chunk and the
        largest layer's working set cannot fit: on the device, a layer's gathered chunks and
        their shards, a gradient bucket and the chunk's fp32 gradient; in host memory (with a
        disk tier), one chunk's parts while it is stepped."""
        size = self.group.size
        shard = -(-chunk_numel // size)
        full = shard * size
        per_chunk_full = full * element + shard * element  # gathered buffer + the shard it came from
        # the chunks one module uses at once: a module's parameters may straddle two chunks
        modules = 2 if len(entries) > 1 else 1
        device_need = modules * per_chunk_full + full * element + shard * element + shard * 4
        state_bytes = shard * 4 * (len(self.streams) + (1 if self.separate_master else 0) + 1) + shard * element
        host_need = state_bytes if self.memory.disk is not None else 0
        checks = [("device_budget", self.options.device_budget, device_need),
                  ("host_budget", self.options.host_budget, host_need)]  # fmt: skip
        for key, budget, need in checks:
            if budget is not None and budget < need:
                raise BudgetError(
                    f"gemini.{key}={budget / _MIB:.2f} MiB is too small: one chunk of {full * element / _MIB:.2f} MiB "
                    f"plus the largest layer's working set need at least {need / _MIB:.2f} MiB; give "
                    f"gemini.{key} >= {need / _MIB:.2f} MiB (or a smaller gemini.chunk_mb)"
                )
        total = self.chunk_plan.chunks * shard * (element + 4 * (1 + len(self.streams) + int(self.separate_master)))
        in_memory = sum(b or 0 for b in (self.options.device_budget, self.options.host_budget))
        if self.options.host_budget is not None and self.memory.disk is None and total > in_memory:
            raise BudgetError(
                f"gemini: the model state needs {total / _MIB:.2f} MiB on this rank but the device and host budgets "
                f"hold {in_memory / _MIB:.2f} MiB and there is no disk tier: give gemini.offload_dir or larger budgets"
            )
        if self.memory.disk is not None:
            self.memory.disk.check_room(max(0, total - in_memory) if self.options.host_budget is not None else 0)
        self.policy_host_reserve = host_need  # host room kept for parts passing through
        if isinstance(self.policy, StaticPolicy):
            self.policy.setup(
                self.chunk_plan.chunks,
                (self.options.device_budget or float("inf")) - device_need,
                (self.options.host_budget or float("inf")) - host_need,
            )
        else:
            self.policy.reserve = device_need
            self.policy.host_reserve = host_need

    def _make_parts(self, chunk: TieredChunk) -> dict[str, Part]:
        """The chunk's parts, its parameters (and fp32 masters) placed by the policy."""
        i, n = chunk.index, chunk.shard_numel
        parts = {"params": Part(i, "params", n, self.param_dtype, self.ledger)}
        if self.separate_master:
            parts["master"] = Part(i, "master", n, torch.float32, self.ledger)
        parts["grads"] = Part(i, "grads", n, torch.float32, self.ledger)
        if self.streams:
            parts["states"] = Part(i, "states", n * len(self.streams), torch.float32, self.ledger)
        for part in parts.values():
            self.memory.add(part)
        values = chunk.shard
        self.memory.place(parts["params"], self.policy.initial(parts["params"], self.memory), values)
        if "master" in parts:
            self.memory.place(parts["master"], self.policy.initial(parts["master"], self.memory), values.float())
        chunk.manage(self.memory, parts["params"])
        return parts

    def _install_pieces(self, entries: list[tuple[str, nn.Parameter]]) -> None:
        """The optimizer's parameters become this rank's pieces of them (empty between steps;
        their placements carry the ZeRO slot, for the norms of LAMB and LARS)."""
        total = len(entries)
        groups: list[list[nn.Parameter]] = [[] for _ in self.optimizer.param_groups]
        self._pieces: list[list[tuple[nn.Parameter, Slot, int, int]]] = []
        for chunk in self.chunks:
            pieces = []
            for slot, start, end in chunk.shard_pieces():
                piece = nn.Parameter(torch.empty(0, device=self.ctx.device))
                inherited = placement_of(entries[slot.index][1])
                set_placement(
                    piece, replace(inherited, mesh=self.ctx, zero=ZeroSlot(slot.index, total, tuple(slot.shape)))
                )
                pieces.append((piece, slot, start, end))
                groups[self._chunk_group[chunk.index]].append(piece)
            self._pieces.append(pieces)
        self._empty = nn.Parameter(torch.empty(0, device=self.ctx.device))
        set_placement(self._empty, Placement(mesh=self.ctx, zero=ZeroSlot(0, total, tuple(entries[0][1].shape))))
        self._slot_placements = [placement_of(p) for _, p in entries]
        self._scalars: dict[int, dict[str, Any]] = {}  # id(piece) -> its states that are not streams
        self.optimizer.state.clear()
        for group, params in zip(self.optimizer.param_groups, groups):
            group["params"] = params

    # ---- the optimizer interface (param_groups, state, defaults: the user's) -----------------
    def state_dict(self) -> dict[str, Any]:
        """The user's optimizer's state over this rank's pieces (inside :meth:`resident`)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load per-piece state (inside :meth:`resident`; the states reach the parts after it)."""
        self.optimizer.load_state_dict(state)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        for parts in self._parts:
            self.memory.drop(parts["grads"])
        self._has_grad.clear()
        self._slot_sq.zero_()
        self._factors.clear()

    # ---- gradients ---------------------------------------------------------------------------
    def _install_grad_hooks(self, module: nn.Module, args: Any) -> None:
        self._hooks_pending.remove()
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, p: torch.Tensor) -> None:
        """During backward: ``p``'s gradient goes into its chunk's bucket; a complete bucket is
        reduce-scattered and added to the chunk's fp32 gradients."""
        chunk, slot = self._slot_of[id(p)]
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True
        bucket = self._buckets.get(chunk.index)
        if bucket is None:
            self.memory.reserve(Tier.DEVICE, self._bucket_bytes(chunk), "bucket", f"chunk{chunk.index} bucket")
            bucket = self._buckets[chunk.index] = torch.empty(
                chunk.padded_numel, dtype=self.param_dtype, device=self.ctx.device
            )
            bucket[chunk.numel :].zero_()  # the padding (parameters without a gradient: at the reduction)
        assert p.grad is not None
        bucket[slot.offset : slot.offset + slot.numel].copy_(p.grad.reshape(-1))
        p.grad = None
        self._has_grad.add(slot.index)
        self._written.setdefault(chunk.index, set()).add(slot.index)
        self._ready[chunk.index] = self._ready.get(chunk.index, 0) + 1
        if self._ready[chunk.index] == self._trainable[chunk.index]:
            self._reduce_bucket(chunk)

    def _bucket_bytes(self, chunk: TieredChunk) -> int:
        element = torch.empty((), dtype=self.param_dtype).element_size()
        return (chunk.padded_numel + chunk.shard_numel) * element

    def _reduce_bucket(self, chunk: TieredChunk) -> None:
        """Start the chunk's reduce-scatter; at most two run while the backward goes on."""
        bucket = self._buckets.pop(chunk.index)
        written = self._written.pop(chunk.index, set())
        if len(written) < len(chunk.slots):  # parameters that got no gradient in this pass: zeros
            for slot in chunk.slots:
                if slot.index not in written:
                    bucket[slot.offset : slot.offset + slot.numel].zero_()
        out = torch.empty(chunk.shard_numel, dtype=self.param_dtype, device=bucket.device)
        pending = comm.reduce_scatter_into(out, bucket, self.group, op="avg", async_op=True)
        self._in_flight.append((chunk, pending, bucket))
        self._drain(keep=2)

    def _finish_oldest(self) -> bool:
        """Under memory pressure: finish the oldest reduction in flight (its bucket is freed)."""
        if not self._in_flight:
            return False
        self._drain(keep=len(self._in_flight) - 1)
        return True

    def _drain(self, keep: int = 0) -> None:
        """Finish the reduce-scatters in flight (all but the newest ``keep``): each chunk's
        reduced shard is added to its fp32 gradients, and the chunk is released."""
        while len(self._in_flight) > keep:
            chunk, pending, bucket = self._in_flight.pop(0)
            out = pending.wait()
            del bucket
            grads = self._parts[chunk.index]["grads"]
            fresh = grads.residence is Residence.EMPTY
            g = self.memory.need(grads, self._work_tier(grads))
            if fresh:
                g.copy_(out)
            else:
                g.add_(out.to(g.device, torch.float32))
            self.memory.dirty(grads)
            if self._final:  # the step's gradients are complete: their per-parameter squares
                self._add_squares(chunk, g)
            self.memory.done(grads)
            self.memory.unreserve(Tier.DEVICE, self._bucket_bytes(chunk), "bucket", f"chunk{chunk.index} reduced")
            chunk.release()

    def _add_squares(self, chunk: TieredChunk, grad: torch.Tensor) -> None:
        pieces = [(slot, a, b) for _, slot, a, b in self._pieces[chunk.index] if slot.index in self._has_grad]
        if not pieces:
            return
        norms = torch._foreach_norm([grad[a:b] for _, a, b in pieces], 2.0, dtype=torch.float32)
        index = torch.tensor([slot.index for slot, _, _ in pieces], device=self._slot_sq.device)
        self._slot_sq.index_add_(0, index, torch.stack(norms).to(self._slot_sq.device).square())

    def _finish_backward(self) -> None:
        for chunk in self.chunks:
            if chunk.index in self._buckets:
                self._reduce_bucket(chunk)
        self._drain()
        self._ready.clear()
        self._callback_queued = False
        if self.tight_heap:
            trim_heap()  # the activations just freed go back to the system before the step reads parts

    def _work_tier(self, part: Part) -> Tier:
        """Where a part is used outside the step: its home's memory (static), else the device."""
        home = self.policy.home(part)
        return Tier.HOST if home in (Tier.HOST, Tier.DISK) else Tier.DEVICE

    def set_final(self, final: bool) -> None:
        """Whether the backward pass that follows completes the step's gradients."""
        self._final = final

    def grad_norm(self) -> torch.Tensor:
        """The whole model's gradient norm (after every scaling so far); collective."""
        norm = norm_from_slot_squares(self._slot_sq, self._slot_placements, self.ctx)
        for factor in self._factors:
            norm = norm * factor.abs()
        return norm

    def scale_gradients(self, factor: torch.Tensor | float) -> None:
        """Multiply every gradient by ``factor`` (applied to each chunk when it is stepped)."""
        self._factors.append(torch.as_tensor(factor, dtype=torch.float32, device=self.ctx.device).detach().clone())

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> None:
        """Step every chunk where it lives (see the module docstring)."""
        refreshing: list[tuple[TieredChunk, Any]] = []
        for chunk in self.chunks:
            self._step_chunk(chunk)
            refreshing += self._refresh(chunk)  # overlaps the next chunks' steps
            self._refreshed(refreshing, keep=2)
        self._refreshed(refreshing, keep=0)
        if self.tight_heap:
            trim_heap()  # the activations freed since the forward go back to the system, not into holes
        self._factors.clear()
        self._has_grad.clear()
        self._slot_sq.zero_()
        self.steps += 1

    def _refreshed(self, refreshing: list[tuple[TieredChunk, Any]], keep: int) -> None:
        """Finish the oldest refreshes until at most ``keep`` are in flight."""
        while len(refreshing) > keep:
            chunk, pending = refreshing.pop(0)
            pending.wait()
            assert chunk.part is not None
            self.memory.done(chunk.part)
            self.memory.retain(chunk)  # kept until room is needed

    def _refresh(self, chunk: TieredChunk) -> list[tuple[TieredChunk, Any]]:
        """A chunk still gathered (kept while the device had room) starts taking every member's
        new shard, so that the next forward pass needs no gather for it; the caller waits."""
        if chunk.state is not ChunkState.GATHERED or chunk.part is None:
            return []
        self.memory.forget_retained(chunk)  # not let go while its gather is in flight
        shard = self.memory.need(chunk.part, Tier.DEVICE)
        return [(chunk, comm.all_gather_into(chunk.full, shard, self.group, async_op=True))]

    def _step_tier(self, parts: dict[str, Part]) -> Tier:
        """Device when the chunk's optimizer state is there (or, with the auto policy, when the
        device has room for all its parts beside every chunk kept gathered), else host memory.

        The auto policy gives device room to gathered chunks before optimizer states: a chunk
        kept gathered across steps saves an all-gather in every forward and backward pass,
        while states in host memory cost one move of the chunk's gradients and parameters (and
        nothing where the device is the host's memory)."""
        states = parts.get("states") or parts.get("master") or parts["params"]
        if states.residence is Residence.DEVICE:
            return Tier.DEVICE
        if isinstance(self.policy, StaticPolicy):
            return self._work_tier(states)
        if isinstance(self.policy, AutoPolicy) and states.residence is Residence.EMPTY:
            needed = sum(p.nbytes for p in parts.values() if p.residence is not Residence.DEVICE)
            ungathered = sum(c.full_bytes for c in self.chunks if not c.counted)
            if self.ledger.free(Tier.DEVICE) - self.policy.reserve - ungathered >= needed:
                return Tier.DEVICE
        return Tier.HOST

    def make_room_for_gathered(self, extra: int) -> None:
        """Before ``extra`` more device bytes are reserved (auto policy, at the end of the
        warm-up): optimizer parts leave the device, last chunks first, while the device could
        not also hold every chunk gathered beside its reserve; device room is worth more to
        gathered chunks than to states (see :meth:`_step_tier`), but not more than host memory:
        a part goes down only while host memory has room for it (a move to disk costs more
        than an all-gather)."""
        if not isinstance(self.policy, AutoPolicy):
            return
        ungathered = sum(c.full_bytes for c in self.chunks if not c.counted)
        short = extra + self.policy.reserve + ungathered - self.ledger.free(Tier.DEVICE)
        for parts in reversed(self._parts):
            for kind in ("states", "master"):
                part = parts.get(kind)
                if short <= 0 or part is None or self.ledger.free(Tier.HOST) - self.policy_host_reserve < part.nbytes:
                    continue
                if self.memory.demote(part):
                    short -= part.nbytes

    def _step_chunk(self, chunk: TieredChunk) -> None:
        parts = self._parts[chunk.index]
        where = self._step_tier(parts)
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
            master = need("master" if self.separate_master else "params")
            first = parts.get("states") is not None and parts["states"].residence is Residence.EMPTY
            states = need("states", fill=not first) if "states" in parts else None
            pieces = self._pieces[chunk.index]
            self._bind(pieces, master, grad, states, first)
            self._run_optimizer(chunk, pieces)
            if states is not None:
                self._unbind(pieces, states, first)
                memory.dirty(parts["states"])
            for piece, _, _, _ in pieces:
                piece.data, piece.grad = EMPTY_FOR[piece.device], None
            memory.dirty(parts["master" if self.separate_master else "params"])
            if self.separate_master:  # the parameters follow their masters
                params = memory.need(parts["params"], where, fill=False)
                held.append(parts["params"])
                params.copy_(master)
                memory.dirty(parts["params"])
        finally:
            for part in held:
                memory.done(part)
        memory.drop(parts["grads"])

    def _bind(
        self,
        pieces: list[tuple[nn.Parameter, Slot, int, int]],
        master: torch.Tensor,
        grad: torch.Tensor | None,
        states: torch.Tensor | None,
        first: bool,
    ) -> None:
        n = master.numel()
        for piece, slot, a, b in pieces:
            piece.data = master[a:b]
            piece.grad = grad[a:b] if grad is not None and slot.index in self._has_grad else None
            if first or states is None:
                continue
            state = dict(self._scalars.get(id(piece), {}))
            for k, key in enumerate(self.streams):
                state[key] = states[k * n + a : k * n + b]
            self.optimizer.state[piece] = state

    def _unbind(self, pieces: list[tuple[nn.Parameter, Slot, int, int]], states: torch.Tensor, first: bool) -> None:
        n = states.numel() // len(self.streams)
        for piece, _, a, b in pieces:
            state = self.optimizer.state.pop(piece, None)
            if state is None:
                continue
            if first:  # the optimizer made its states: they move into the part
                for k, key in enumerate(self.streams):
                    if key in state:
                        states[k * n + a : k * n + b].copy_(state[key].reshape(-1))
            self._scalars[id(piece)] = {k: v for k, v in state.items() if k not in self.streams}

    def _run_optimizer(self, chunk: TieredChunk, pieces: list[tuple[nn.Parameter, Slot, int, int]]) -> None:
        """One step of the user's optimizer over ``chunk``'s pieces only (every rank steps every
        chunk in the same order, so the norms of LAMB and LARS meet over the data axis)."""
        groups = self.optimizer.param_groups
        saved = [g["params"] for g in groups]
        chosen: list[list[nn.Parameter]] = [[] for _ in groups]
        for piece, _, _, _ in pieces:
            chosen[self._chunk_group[chunk.index]].append(piece)
        if not pieces:  # this rank's shard is padding: it still meets the others' collectives
            self._empty.grad = torch.zeros_like(self._empty)
            chosen[self._chunk_group[chunk.index]].append(self._empty)
        try:
            for group, params in zip(groups, chosen):
                group["params"] = params
            self.optimizer.step()
        finally:
            for group, params in zip(groups, saved):
                group["params"] = params
            self.optimizer.state.pop(self._empty, None)
            self._empty.grad = None

    def _master_from_params(self, chunk: Any) -> None:
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

    # ---- full state, memory ------------------------------------------------------------------
    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every parameter readable inside the block. A full state dict is whole on every rank
        by definition, so the budgets are lifted for the block (the ledger stops sampling)."""
        with self.ledger.lifted(), self.store.gathered():
            yield

    def params_loaded(self) -> None:
        for chunk in self.chunks:
            chunk.scatter_from_full()
            self._master_from_params(chunk)

    def full_precision_weights(self) -> list[tuple[nn.Parameter, torch.Tensor]] | None:
        """``(parameter, fp32 master)`` for every parameter (bf16/fp16), gathered over the
        data axis; None in fp32. Collective."""
        if not self.separate_master:
            return None
        out: list[tuple[nn.Parameter, torch.Tensor]] = []
        with torch.no_grad(), self.ledger.lifted():
            for chunk, parts in zip(self.chunks, self._parts):
                shard = self.memory.need(parts["master"], Tier.DEVICE)
                full = torch.empty(chunk.padded_numel, dtype=torch.float32, device=self.ctx.device)
                comm.all_gather_into(full, shard.clone(), self.group)
                self.memory.done(parts["master"])
                for slot in chunk.slots:
                    out.append((self.params[slot.index], full[slot.offset : slot.offset + slot.numel].view(slot.shape)))
        return out

    def memory_parts(self) -> dict[str, list[torch.Tensor]]:
        """The model-state tensors held in memory now (parts on disk are not), by kind."""
        kinds = {
            "params": "parameters",
            "grads": "gradients",
            "master": "optimizer_states",
            "states": "optimizer_states",
        }
        out: dict[str, list[torch.Tensor]] = {"parameters": [], "gradients": [], "optimizer_states": []}
        for parts in self._parts:
            for part in parts.values():
                if part.tensor is not None:
                    out[kinds[part.kind]].append(part.tensor)
        return out

    def report(self) -> dict[str, Any]:
        """Chunks, utilisation and the bytes of each tier (now and at their peak)."""
        return {
            "chunks": len(self.chunks),
            "chunk_mb": self.chunk_plan.capacity * torch.empty((), dtype=self.param_dtype).element_size() / _MIB,
            "utilisation": self.chunk_plan.utilisation,
            "policy": self.policy.name,
            **self.ledger.summary(),
            "disk_written_bytes": self.memory.disk.bytes_written if self.memory.disk else 0,
            "disk_read_bytes": self.memory.disk.bytes_read if self.memory.disk else 0,
        }

    def close(self) -> None:
        self.memory.close()


__all__ = ["GeminiOptimizer", "state_streams"]
