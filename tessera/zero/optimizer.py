"""ZeRO over the data axis: the optimizer's states, then the gradients, then the parameters,
split evenly over the data-parallel ranks (Rajbhandari et al., 2020).

The model's trainable parameters are packed, in order, into the chunks of a
:class:`~tessera.memory.chunks.ChunkStore` sharded over the data axis; each parameter becomes a
view into its chunk. A rank owns one contiguous shard of every chunk. The user's optimizer is
kept (so learning-rate schedulers bound to it still work) but its parameter groups now hold
*pieces*: views into this rank's fp32 master shard, one per parameter that overlaps the shard.
Elementwise optimizers (SGD, Adam, AdamW) give exactly the single-process update this way; LAMB
and LARS read each piece's placement (its ZeRO slot, and how the parameter it belongs to is
split) to compute whole-parameter norms (see ``tessera.optim.norms``).

- stage 1: full gradients stay on every rank until the step; then one reduce-scatter per chunk
  gives each rank the average of its shard, it steps its shard, and an all-gather refreshes the
  parameters (2P communicated).
- stage 2: as each chunk's gradients are complete during the backward pass, they are copied into
  a bucket and reduce-scattered (asynchronously, overlapping the rest of the backward); only the
  shard of the gradient is kept (2P communicated).
- stage 3: chunks are also released after use; see :mod:`tessera.zero.release` (3P communicated).

The stages are policies (:class:`~tessera.zero.policy.ZeroPolicy`) of this one optimizer.

With bf16/fp16 the parameters (and their chunks) are kept in that dtype and the masters in fp32;
in fp32 the master *is* the parameter shard. ``offload_optimizer="cpu"`` keeps masters, gradient
pieces and optimizer states in host memory and steps there.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from tessera import comm
from tessera.comm import Pending
from tessera.context import ParallelContext
from tessera.context.placement import Placement, ZeroSlot, placement_of, set_placement, update_placement
from tessera.memory.chunks import Chunk, ChunkStore, Slot, WholeStateDict
from tessera.memory.deferred import set_data
from tessera.memory.host import copy_to_device_, host_copy, wait_for_device
from tessera.optim.host_adam import HostAdamW
from tessera.optim.norms import global_grad_norm
from tessera.optim.wrapping import WrapsOptimizer, optimizer_entries
from tessera.parallel.experts import is_expert
from tessera.zero.policy import ZeroOptions
from tessera.zero.release import ReleaseOnUse

PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ZeroOptimizer(WrapsOptimizer):
    """A sharded optimizer over ``ctx``'s data axis wrapping the user's ``optimizer``.

    Behaves like a ``torch.optim.Optimizer`` for the engine and for LR schedulers
    (``param_groups``, ``state``, ``step``, ``zero_grad``, ``state_dict``); its parameter groups
    hold this rank's pieces of the parameters. Call :meth:`reduce_gradients` after the last
    backward of a step and before clipping or stepping.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        ctx: ParallelContext,
        options: ZeroOptions,
    ) -> None:
        self.policy = policy = options.policy
        self.ctx = ctx
        self.group = ctx.replicas
        self.optimizer = optimizer
        self.overlap_comm = options.overlap_comm
        self.param_dtype = PARAM_DTYPES[options.precision]
        self.master_device = torch.device("cpu") if options.offload == "cpu" else ctx.device
        entries, group_of = optimizer_entries(model, optimizer)
        self.params = [p for _, p in entries]
        # A chunk never spans two parameter groups, nor two blocks of the model (so stage 3
        # gathers one block at a time, and stage 2 reduces a block as soon as its backward ends).
        labels: dict[tuple[int, str], int] = {}
        bins = [labels.setdefault((g, _unit_of(model, n)), len(labels)) for g, (n, _) in zip(group_of, entries)]
        # An MoE layer's experts are sharded over the ranks that hold the same experts, and
        # their gradients, already summed over the expert axis by the all-to-all's backward, are
        # divided by all the replicas (tessera.parallel.experts); the rest over all replicas.
        experts = [is_expert(p) for p in self.params]
        shard_groups = [ctx.expert_replicas if e else ctx.replicas for e in experts] if any(experts) else None
        self._slot_of: dict[int, tuple[Chunk, Slot]] = {}

        def adopt(chunk: Chunk) -> None:
            for slot in chunk.slots:
                p = entries[slot.index][1]
                set_data(p, chunk.view(slot))  # the parameter now lives in its chunk; its old storage goes
                self._slot_of[id(p)] = (chunk, slot)
                update_placement(p, storage=self)  # full state dicts gather and load through this
            if policy.release_parameters:
                chunk.release()

        element = torch.empty((), dtype=self.param_dtype).element_size()
        self.store = ChunkStore(
            entries,
            self.group,
            chunk_numel=max(1, int(options.bucket_mb * 2**20) // element),
            dtype=self.param_dtype,
            keep_full=not policy.release_parameters,
            bins=bins,
            on_close=adopt,
            device=ctx.device,
            groups=shard_groups,
        )
        self._chunk_bin = {c.index: group_of[c.slots[0].index] for c in self.store.chunks}
        self._pieces: list[list[tuple[nn.Parameter, int, int]]] = []  # per chunk: (piece, start, end)
        self._install_pieces(entries, [self._make_master(c) for c in self.store.chunks])
        if options.offload == "cpu" and type(optimizer) is torch.optim.AdamW:
            self._use_host_adamw()  # may move the pieces into flat buffers of its own
        # pieces that are not the parameter shard itself: copied into it after each step
        self._separate = any(
            piece.data_ptr() != c.shard[start].data_ptr() for c, ps in zip(self.store.chunks, self._pieces)
            for piece, start, _ in ps
        )  # fmt: skip
        self.grad_shards: list[torch.Tensor | None] = [None] * len(self.store.chunks)
        self._has_grad: set[int] = set()  # slot indices that received a gradient this step
        self._in_flight: list[tuple[Chunk, Pending, torch.Tensor]] = []
        self._buckets: dict[int, torch.Tensor] = {}  # stage 2/3: chunk index -> gradients being collected
        self._ready: dict[int, int] = {}
        self._callback_queued = False
        self._trainable = {c.index: len(c.slots) for c in self.store.chunks}
        if policy.reduce_in_backward:  # the gradient hooks go on when the first pass begins
            self._hooks_pending = model.register_forward_pre_hook(self._install_grad_hooks)
        self._release = ReleaseOnUse(model, self.store, self._slot_of) if policy.release_parameters else None
        # model.state_dict() gathers released chunks and returns copies; model.load_state_dict()
        # reaches the shards and the masters
        chunk_of = {key: chunk for key, (chunk, _) in self._slot_of.items()}
        self._state_dicts = WholeStateDict(model, chunk_of, on_loaded=self._masters_from_shard)

    # ---- construction ------------------------------------------------------------------------
    def _make_master(self, chunk: Chunk) -> torch.Tensor:
        if self.param_dtype == torch.float32 and self.master_device == chunk.shard.device:
            return chunk.shard  # fp32 on the same device: the shard itself is the master
        if self.master_device.type == "cpu":  # offloaded: pinned host memory when the shard is on a GPU
            return host_copy(chunk.shard, torch.float32)
        return chunk.shard.detach().to(self.master_device, torch.float32, copy=True)

    def _install_pieces(self, entries: list[tuple[str, nn.Parameter]], masters: list[torch.Tensor]) -> None:
        """Replace the optimizer's parameters by this rank's pieces of them (state is reset:
        ZeRO is applied before the first step)."""
        total = len(entries)
        groups: list[list[nn.Parameter]] = [[] for _ in self.optimizer.param_groups]
        for chunk, master in zip(self.store.chunks, masters):
            pieces = []
            for slot, start, end in chunk.shard_pieces():
                piece = nn.Parameter(master[start:end])
                # how the parameter is split and which stage owns it, plus the slot of the piece
                inherited = placement_of(entries[slot.index][1])
                set_placement(
                    piece, replace(inherited, mesh=self.ctx, zero=ZeroSlot(slot.index, total, tuple(slot.shape)))
                )
                pieces.append((piece, start, end))
                groups[self._chunk_bin[chunk.index]].append(piece)
            self._pieces.append(pieces)
        # A rank whose shards are all padding still joins the norms' collectives (LAMB, LARS)
        # through one empty piece.
        self._empty: nn.Parameter | None = None
        if not any(groups):
            self._empty = nn.Parameter(torch.zeros(0, device=self.master_device))
            set_placement(self._empty, Placement(mesh=self.ctx, zero=ZeroSlot(0, total, tuple(entries[0][1].shape))))
            groups[0].append(self._empty)
        # What the gradient norm needs of every parameter (the same on every data rank).
        self._slot_placements = [placement_of(p) for _, p in entries]
        self.optimizer.state.clear()
        for group, params in zip(self.optimizer.param_groups, groups):
            group["params"] = params

    def _use_host_adamw(self) -> None:
        """Offloaded AdamW steps with ``HostAdamW`` (flat host buffers, fused CPU kernel). It
        shares the user's parameter-group dicts, so schedulers that change their ``lr`` still
        reach it."""
        user = self.optimizer
        keys = ("params", "lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
        host = HostAdamW([{k: g[k] for k in keys if k in g} for g in user.param_groups])
        for host_group, user_group in zip(host.param_groups, user.param_groups):
            user_group.update(fused=host_group["fused"], foreach=host_group["foreach"], params=host_group["params"])
        host.param_groups = user.param_groups
        self.optimizer = host
        self._user_optimizer = user

    # ---- the optimizer interface (param_groups, state, defaults: the user's) -----------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient: the model's, the shards' and the pieces'."""
        for p in self.params:
            p.grad = None
        for pieces in self._pieces:
            for piece, _, _ in pieces:
                piece.grad = None
        self.grad_shards = [None] * len(self.store.chunks)
        self._has_grad.clear()

    def step(self) -> None:
        """Step this rank's pieces, write them back into the parameter shards and refresh the
        parameters (all-gather; stage 3 gathers on next use instead)."""
        self.optimizer.step()
        pending: list[Pending | None] = []
        with torch.no_grad():
            for chunk, pieces in zip(self.store.chunks, self._pieces):
                if self._separate and pieces:
                    copy_to_device_([chunk.shard[a:b] for _, a, b in pieces], [p for p, _, _ in pieces])
                pending.append(chunk.refresh_full(async_op=True))
        for work in pending:
            if work is not None:
                work.wait()
        for pieces in self._pieces:  # fp32 gradient pieces are transient
            for piece, _, _ in pieces:
                piece.grad = None

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (pieces in chunk order)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)
        user = getattr(self, "_user_optimizer", None)
        if user is not None:  # loading made new group dicts: share the user's again (schedulers)
            for user_group, group in zip(user.param_groups, self.optimizer.param_groups):
                user_group.update(group)
            self.optimizer.param_groups = user.param_groups

    # ---- gradients ---------------------------------------------------------------------------
    def _install_grad_hooks(self, module: nn.Module, args: Any) -> None:
        """Before the first forward: a hook on each parameter taking its gradient as soon as it
        is accumulated (installed then rather than at construction, as FSDP2 does its lazy
        set-up: a model that is built and only saved or loaded carries none)."""
        self._hooks_pending.remove()
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, p: torch.Tensor) -> None:
        """Stage 2/3, during backward: move ``p``'s gradient into its chunk's bucket; when the
        chunk is complete, start its reduce-scatter."""
        chunk, slot = self._slot_of[id(p)]
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True
        bucket = self._buckets.get(chunk.index)
        if bucket is None:
            bucket = self._buckets[chunk.index] = torch.zeros(
                chunk.padded_numel, dtype=self.param_dtype, device=chunk.full.device
            )
        assert p.grad is not None
        bucket[slot.offset : slot.offset + slot.numel].copy_(p.grad.reshape(-1))
        p.grad = None
        self._has_grad.add(slot.index)
        self._ready[chunk.index] = self._ready.get(chunk.index, 0) + 1
        if self._ready[chunk.index] == self._trainable[chunk.index]:
            self._reduce_bucket(chunk)

    def _reduce_bucket(self, chunk: Chunk) -> None:
        bucket = self._buckets.pop(chunk.index)
        out = torch.empty(chunk.shard_numel, dtype=self.param_dtype, device=bucket.device)
        pending = self._reduce_scatter(out, bucket, chunk)
        self._in_flight.append((chunk, pending, bucket))
        # Two reductions in flight at most: older buckets are freed as the backward goes on, so
        # the whole model's gradients never exist at once.
        self._drain(keep=2 if self.overlap_comm else 0)
        self.after_reduce(chunk)

    def after_reduce(self, chunk: Chunk) -> None:
        """The chunk's gradients are complete: its parameters may go (when they are released)."""
        if self._release is not None:
            chunk.release()

    def _reduce_scatter(self, out: torch.Tensor, bucket: torch.Tensor, chunk: Chunk) -> Pending:
        """Start the average of ``chunk``'s gradients (``bucket``) over all the replicas; this
        rank's shard of it arrives in ``out``. An expert chunk's group holds a part of them (the
        other expert ranks hold other experts): its sum is divided by all of them."""
        divide = self.ctx.replicas.size // chunk.group.size
        return comm.reduce_scatter_into(out, bucket, chunk.group, op="avg", async_op=True, divide_by=divide)

    def _drain(self, keep: int = 0) -> None:
        """Wait for the reduce-scatters in flight (all but the newest ``keep``) and add their
        results into the gradient shards."""
        while len(self._in_flight) > keep:
            chunk, pending, _ = self._in_flight.pop(0)
            out = pending.wait()
            current = self.grad_shards[chunk.index]
            if current is None:
                self.grad_shards[chunk.index] = out
            else:
                current.add_(out)

    def _finish_backward(self) -> None:
        """End of a backward pass: reduce chunks some of whose parameters got no gradient,
        then wait for all reductions."""
        for chunk in self.store.chunks:
            if chunk.index in self._buckets:
                self._reduce_bucket(chunk)
        self._drain()
        self._ready.clear()
        self._callback_queued = False

    def reduce_gradients(self) -> None:
        """After the step's last backward: make each piece's ``.grad`` the data-parallel average
        of its gradient (fp32, on the master device). Stage 1 reduces here; stages 2 and 3 have
        reduced during the backward passes."""
        if not self.policy.reduce_in_backward:
            self._reduce_full_gradients()
        if self._empty is not None:
            self._empty.grad = torch.zeros_like(self._empty)
        copied = False
        for chunk, pieces in zip(self.store.chunks, self._pieces):
            shard = self.grad_shards[chunk.index]
            if shard is None:
                continue
            if shard.device != self.master_device:  # offloaded: one pinned, non-blocking copy per chunk
                shard, copied = host_copy(shard, torch.float32, wait=False), True
            for (piece, start, end), (slot, _, _) in zip(pieces, chunk.shard_pieces()):
                if slot.index not in self._has_grad:
                    continue  # no rank of the data axis computed it (e.g. another stage's layer)
                grad = shard[start:end]
                piece.grad = (
                    grad
                    if grad.dtype == piece.dtype and grad.device == piece.device
                    else grad.to(piece.device, piece.dtype)
                )
        if copied:
            wait_for_device(self.ctx.device)  # the gradients copied to the host have arrived

    def grad_norm(self) -> torch.Tensor:
        """The 2-norm of the whole model's gradient from the pieces' gradients (after
        :meth:`reduce_gradients`); every rank makes the same collectives whatever its shard holds."""
        pieces = [piece for pieces in self._pieces for piece, _, _ in pieces]
        return global_grad_norm(pieces, self.ctx, zero_slots=self._slot_placements)

    def _reduce_full_gradients(self) -> None:
        pending: list[tuple[Chunk, Pending, torch.Tensor]] = []
        for chunk in self.store.chunks:
            if len(pending) == 2:  # two buckets in flight at most: overlap without a second full copy
                done, work, _ = pending.pop(0)
                self.grad_shards[done.index] = work.wait()
            bucket = torch.zeros(chunk.padded_numel, dtype=self.param_dtype, device=chunk.full.device)
            any_grad = False
            for slot in chunk.slots:
                p = self.params[slot.index]
                if p.grad is not None:
                    bucket[slot.offset : slot.offset + slot.numel].copy_(p.grad.reshape(-1))
                    self._has_grad.add(slot.index)
                    any_grad = True
            if not any_grad:
                continue
            out = torch.empty(chunk.shard_numel, dtype=self.param_dtype, device=bucket.device)
            pending.append((chunk, self._reduce_scatter(out, bucket, chunk), bucket))
        for chunk, work, _ in pending:
            self.grad_shards[chunk.index] = work.wait()

    # ---- memory, checkpoints -----------------------------------------------------------------
    def memory_parts(self) -> dict[str, list[torch.Tensor]]:
        """The model-state tensors this rank holds, by kind (for ``tessera.memory.report``)."""
        params: list[torch.Tensor] = [p for p in self.params if p.untyped_storage().nbytes() > 0]
        if self.policy.release_parameters:
            params += [c.shard for c in self.store.chunks]
        grads = [p.grad for p in self.params if p.grad is not None]
        grads += [g for g in self.grad_shards if g is not None and self.policy.reduce_in_backward]
        states = [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        if self._separate:  # fp32 masters kept apart from the parameter shards
            states += [piece for pieces in self._pieces for piece, _, _ in pieces]
        return {"parameters": params, "gradients": grads, "optimizer_states": states}

    def full_precision_weights(self) -> list[tuple[nn.Parameter, torch.Tensor]] | None:
        """``(parameter, fp32 master)`` for every parameter, each master whole over the data axis
        and of the parameter's shape on this rank, bitwise what the pieces hold; None in fp32,
        where the parameter shards are the masters. Collective over the data axis (one
        all-gather per chunk)."""
        if self.param_dtype == torch.float32:
            return None
        masters: list[tuple[nn.Parameter, torch.Tensor]] = []
        with torch.no_grad():
            for chunk, pieces in zip(self.store.chunks, self._pieces):
                # the pieces may be apart from each other (host AdamW's flat buffers): a shard of them
                shard = torch.zeros(chunk.shard_numel, dtype=torch.float32, device=chunk.shard.device)
                for piece, start, end in pieces:
                    shard[start:end].copy_(piece)
                full = torch.empty(chunk.padded_numel, dtype=torch.float32, device=shard.device)
                comm.all_gather_into(full, shard, chunk.group)
                for slot in chunk.slots:
                    master = full[slot.offset : slot.offset + slot.numel].view(slot.shape)
                    masters.append((self.params[slot.index], master))
        return masters

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every parameter readable inside the block (released chunks are gathered, then released again)."""
        with self.store.gathered() if self.policy.release_parameters else nullcontext():
            yield

    def params_loaded(self) -> None:
        """After new values were written into the (gathered) parameters: take the shards and
        masters from them."""
        for chunk in self.store.chunks:
            chunk.scatter_from_full()
            self._masters_from_shard(chunk)

    def _masters_from_shard(self, chunk: Chunk) -> None:
        """New values reached ``chunk``'s shard: its fp32 masters (when apart) follow."""
        pieces = self._pieces[chunk.index]
        if self._separate and pieces:
            with torch.no_grad():
                torch._foreach_copy_([p for p, _, _ in pieces], [chunk.shard[a:b] for _, a, b in pieces])

    # ---- sharded checkpoints -----------------------------------------------------------------
    def held_pieces(self) -> list[tuple[str, nn.Parameter, nn.Parameter, int, int]]:
        """``(name, parameter, piece, start, end)`` for each piece this rank steps: ``piece``
        holds elements ``[start, end)`` of ``parameter``'s (tensor-parallel block, row-major)
        values, at the masters' precision."""
        out = []
        for chunk, pieces in zip(self.store.chunks, self._pieces):
            lo = chunk.shard_range[0]
            for (piece, a, b), (slot, _, _) in zip(pieces, chunk.shard_pieces()):
                start = lo + a - slot.offset
                out.append((slot.name, self.params[slot.index], piece, start, start + (b - a)))
        return out

    def masters_loaded(self) -> None:
        """After new values were written into the pieces (a checkpoint loaded): the parameter
        shards take them, and the parameters are refreshed (collective over the data axis)."""
        pending: list[Pending | None] = []
        with torch.no_grad():
            for chunk, pieces in zip(self.store.chunks, self._pieces):
                if self._separate and pieces:
                    copy_to_device_([chunk.shard[a:b] for _, a, b in pieces], [p for p, _, _ in pieces])
                pending.append(chunk.refresh_full(async_op=True))
        for work in pending:
            if work is not None:
                work.wait()


def _unit_of(model: nn.Module, name: str) -> str:
    """The block a parameter belongs to: the first element of a ``ModuleList``/``Sequential`` on
    its path (``blocks.3`` for ``blocks.3.attn.qkv.weight``), else the model's child holding it."""
    parts = name.split(".")
    module: nn.Module = model
    for depth, part in enumerate(parts[:-1]):
        if isinstance(module, nn.ModuleList | nn.Sequential):
            return ".".join(parts[: depth + 1])
        module = getattr(module, part)
    return parts[0] if len(parts) > 1 else ""
