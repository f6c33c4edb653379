"""The sharded optimizer: ZeRO stages 1-3 and Gemini are this one optimizer, told by a policy
when gradients are reduced and whether parameters are released, and by a residence where a
shard's parts live and how its chunks are stepped (Rajbhandari et al., 2020).

The model's trainable parameters are packed, in order, into the chunks of a
:class:`~tessera.memory.chunks.ChunkStore` sharded over the data axis; each parameter becomes a
view into its chunk. A chunk never spans two parameter groups nor two blocks of the model (so
released chunks are gathered one block at a time, and a block's gradients are reduced as soon as
its backward ends); an MoE layer's experts go into chunks of their own, sharded over the ranks
that hold the same experts (``ctx.expert_replicas``), the rest over every replica. A rank owns
one contiguous shard of every chunk. The user's optimizer is kept (so learning-rate schedulers
bound to it still work) but its parameter groups now hold *pieces*: one per parameter that
overlaps this rank's shard, each carrying its ZeRO slot so that LAMB and LARS compute
whole-parameter norms (``tessera.optim.norms``).

The gradients go through :mod:`tessera.zero.gradients`, the same for every residence; with
``release_parameters`` (stage 3, Gemini) a chunk's full buffer exists only while a module uses
it (:mod:`tessera.memory.release`). The residences: :mod:`tessera.zero.device` (every part on the
device, or masters and states in host memory) and :mod:`tessera.gemini.tiered` (each chunk's
parts on the device, in host memory or on disk, stepped where they live).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from tessera.context import ParallelContext
from tessera.context.placement import Placement, ZeroSlot, placement_of, set_placement
from tessera.context.reduction import Reduction, gradient_reduction
from tessera.errors import ConfigError
from tessera.memory.chunks import Chunk, ChunkStore, Slot, WholeStateDict
from tessera.memory.release import ReleaseOnUse
from tessera.memory.search import packing_labels
from tessera.optim.wrapping import WrapsOptimizer, optimizer_entries
from tessera.zero.frozen import FrozenStore, adopting, frozen_tensors
from tessera.zero.gradients import GradientPipeline, GradientSink
from tessera.zero.hybrid import host_split
from tessera.zero.policy import ZeroPolicy

PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

#: one parameter's piece on this rank: (the optimizer's parameter, its slot, [start, end) in the shard)
Piece = tuple[nn.Parameter, Slot, int, int]


class Residence(GradientSink):
    """Where a sharded optimizer's parts live and how its chunks are stepped: what the
    :class:`ShardedOptimizer` calls, in this order at construction: ``plan``, then (chunks
    packed, pieces made with ``piece_data``) ``attach``; its gradients arrive as
    :class:`~tessera.zero.gradients.GradientSink` says. Defaults: parts that never leave memory."""

    sharded: ShardedOptimizer
    chunk_type: type[Chunk] = Chunk  # the class of the store's chunks

    def plan(self, sharded: ShardedOptimizer, numels: list[int], labels: list[int], sizes: list[int]) -> int:
        """Before any chunk takes memory: the chunk capacity in elements for tensors of ``numels``
        packed under ``labels`` and sharded over groups of ``sizes``; refuses what cannot fit."""
        raise NotImplementedError

    def piece_data(self, chunk: Chunk, start: int, end: int) -> torch.Tensor:
        """What the piece of ``chunk``'s shard ``[start, end)`` views between steps."""
        raise NotImplementedError

    def attach(self) -> None:
        """The chunks are packed and the optimizer holds the pieces: make the parts."""

    def attach_frozen(self, frozen: FrozenStore) -> None:
        """The frozen tensors are packed (ZeRO-3, Gemini): place their shards. Default: where they are."""

    def frozen_shard(self, chunk: Chunk) -> torch.Tensor:
        """Where a frozen chunk's shard is now (inside :meth:`resident`)."""
        return chunk.shard

    def grad_norm(self) -> torch.Tensor:
        raise NotImplementedError

    def scale_gradients(self, factor: torch.Tensor | float) -> None:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError

    def master_shard(self, chunk: Chunk) -> AbstractContextManager[torch.Tensor]:
        """The fp32 masters of ``chunk``'s shard (to be read only) inside the block."""
        raise NotImplementedError

    def master_from_params(self, chunk: Chunk) -> None:
        """New parameter values reached ``chunk``'s shard: its fp32 masters (when apart) follow."""

    def masters_loaded(self) -> None:
        """New values reached the pieces (a checkpoint): the shards and parameters follow (collective)."""

    def lifted(self) -> AbstractContextManager[None]:
        """A block in which every chunk may be gathered whatever the budgets (a full state dict)."""
        return nullcontext()

    def resident(self) -> AbstractContextManager[None]:
        """A block in which the pieces view the masters and the optimizer's state its states."""
        return nullcontext()

    def memory_parts(self) -> dict[str, list[torch.Tensor]]:
        raise NotImplementedError

    def report(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        """Release what is held outside the process (offload files)."""


class ShardedOptimizer(GradientPipeline, WrapsOptimizer):
    """The user's ``optimizer`` over ``model``'s parameters sharded over ``ctx``'s data axis, per
    ``policy`` and ``residence`` (see the module docstring); ``precision``: the parameters'
    dtype (``"fp32"``, ``"bf16"``, ``"fp16"``; masters stay fp32); ``overlap_comm``: whether
    two reductions stay in flight while the backward goes on; ``shard``: ``"all"`` replicas share
    the shards, or ``"host"``, those of each host (:mod:`tessera.zero.hybrid`).

    Behaves like a ``torch.optim.Optimizer`` for the engine and for LR schedulers
    (``param_groups``, ``state``, ``step``, ``zero_grad``, ``state_dict``); its parameter groups
    hold this rank's pieces. Call :meth:`reduce_gradients` after the last backward of a step and
    before clipping or stepping."""

    residence: Residence

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        ctx: ParallelContext,
        *,
        policy: ZeroPolicy,
        residence: Residence,
        precision: str = "fp32",
        overlap_comm: bool = True,
        shard: str = "all",
    ) -> None:
        self.policy = policy
        self.residence = residence
        self.ctx = ctx
        # zero.shard="host": shards over the replicas of this rank's host, all-reduced across hosts
        split = host_split(ctx, shard)
        self.group = split.inside if split is not None else ctx.replicas
        self.across = split.across if split is not None else None
        self.optimizer = optimizer
        self.overlap_comm = overlap_comm
        self.param_dtype = PARAM_DTYPES[precision]
        self.element_size = torch.empty((), dtype=self.param_dtype).element_size()
        entries, group_of = optimizer_entries(model, optimizer, trainable=True)  # frozen: no piece, no state
        if not entries:
            raise ConfigError("the sharded optimizer was given an optimizer that holds no trainable parameters")
        self.params = [p for _, p in entries]
        # Each gradient is reduced over the group the reduction contract gives it
        # (tessera.context.reduction: an MoE layer's experts over the ranks that hold the same
        # experts, the rest over every replica); a chunk's parameters share one reduction.
        reductions = [gradient_reduction(ctx, p) for p in self.params]
        keys = [(g, id(r.group), r.divide_by) for g, r in zip(group_of, reductions)]
        self.labels = packing_labels(model, [n for n, _ in entries], keys)
        numels = [p.numel() for p in self.params]
        try:
            self._build(model, entries, group_of, reductions, numels)
        except BaseException:
            residence.close()  # nothing it made outside the process (offload files) is left behind
            raise

    def _build(
        self,
        model: nn.Module,
        entries: list[tuple[str, nn.Parameter]],
        group_of: list[int],
        reductions: list[Reduction],
        numels: list[int],
    ) -> None:
        ctx, policy, residence = self.ctx, self.policy, self.residence
        groups = [r.group if self.across is None else self.group for r in reductions]  # no experts: the rules
        sizes = [g.size for g in groups]
        self.chunk_numel = residence.plan(self, numels, self.labels, sizes)
        self._slot_of: dict[int, tuple[Chunk, Slot]] = {}
        adopt = adopting([p for _, p in entries], self._slot_of, self)  # the parameters now live in their chunks
        self.store = ChunkStore(
            entries, self.group, chunk_numel=self.chunk_numel, dtype=self.param_dtype,
            keep_full=not policy.release_parameters, bins=self.labels, on_close=adopt, device=ctx.device,
            groups=groups, chunk_type=residence.chunk_type,
        )  # fmt: skip
        self.chunks = self.store.chunks
        self._chunk_bin = {c.index: group_of[c.slots[0].index] for c in self.chunks}
        self.reductions = {c.index: reductions[c.slots[0].index] for c in self.chunks}
        self._install_pieces(entries)
        residence.attach()
        self._start_gradients(model)
        # under parameter release the frozen tensors are sharded and released too (no gradient, master or state)
        frozen = frozen_tensors(model) if policy.release_parameters else []
        self.frozen = FrozenStore(frozen, model, ctx, chunk_numel=self.chunk_numel, storage=self,
                                  chunk_type=residence.chunk_type,
                                  group=self.group if self.across is not None else None)  # fmt: skip
        residence.attach_frozen(self.frozen)
        frozen_ids = {id(c) for c in self.frozen.chunks}
        self._release = (
            ReleaseOnUse(model, [self.store, *self.frozen.stores], {**self._slot_of, **self.frozen.slot_of},
                         frozen=frozen_ids)
            if policy.release_parameters else None
        )  # fmt: skip
        # model.state_dict() gathers released chunks and returns copies; model.load_state_dict()
        # reaches the shards and the masters
        chunk_of = {key: chunk for key, (chunk, _) in self._slot_of.items()}

        def loaded(chunk: Chunk) -> None:
            if id(chunk) not in frozen_ids:
                residence.master_from_params(chunk)

        self._state_dicts = WholeStateDict(model, {**chunk_of, **self.frozen.chunk_of()}, on_loaded=loaded)

    def _install_pieces(self, entries: list[tuple[str, nn.Parameter]]) -> None:
        """Replace the optimizer's parameters by this rank's pieces of them (state is reset:
        the sharded optimizer is applied before the first step)."""
        total = len(entries)
        groups: list[list[nn.Parameter]] = [[] for _ in self.optimizer.param_groups]
        self.pieces: list[list[Piece]] = []
        for chunk in self.chunks:
            pieces = []
            for slot, start, end in chunk.shard_pieces():
                piece = nn.Parameter(self.residence.piece_data(chunk, start, end))
                # how the parameter is split and which stage owns it, plus the slot of the piece
                inherited = placement_of(entries[slot.index][1])
                set_placement(piece, replace(inherited, mesh=self.ctx, zero=self._slot(slot.index, total, slot.shape)))
                pieces.append((piece, slot, start, end))
                groups[self._chunk_bin[chunk.index]].append(piece)
            self.pieces.append(pieces)
        # A rank whose shard (of a chunk, or of all) is padding still joins the norms'
        # collectives (LAMB, LARS) through one empty piece.
        where = self.residence.piece_data(self.chunks[0], 0, 0).device  # where the pieces are stepped
        self.empty = nn.Parameter(torch.zeros(0, device=where))
        set_placement(self.empty, Placement(mesh=self.ctx, zero=self._slot(0, total, entries[0][1].shape)))
        if not any(groups):
            groups[0].append(self.empty)
        # What the gradient norm needs of every parameter (the same on every data rank).
        self.slot_placements = [placement_of(p) for _, p in entries]
        self.optimizer.state.clear()
        for group, params in zip(self.optimizer.param_groups, groups):
            group["params"] = params

    def _slot(self, index: int, count: int, shape: torch.Size) -> ZeroSlot:
        return ZeroSlot(index, count, tuple(shape), within_host=self.across is not None)

    @property
    def releases_parameters(self) -> bool:
        """Whether a parameter's storage is released between uses (ZeRO-3, Gemini): reading it
        outside a forward pass needs :meth:`gathered`."""
        return self.policy.release_parameters

    # ---- the optimizer interface (param_groups, state, defaults: the user's) -----------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient: the model's and the residence's."""
        for p in self.params:
            p.grad = None
        self._has_grad.clear()
        self.residence.zero_grad()

    def step(self) -> None:
        self.residence.step()

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (pieces in chunk order)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def elements_in(self, mb: float) -> int:
        """A chunk capacity of ``mb`` MiB in elements of the parameters' dtype (at least one)."""
        return max(1, int(mb * 2**20) // self.element_size)

    def param_group_of(self, chunk: Chunk) -> int:
        """The index of the optimizer's parameter group that ``chunk``'s parameters belong to."""
        return self._chunk_bin[chunk.index]

    # ---- whole values, memory ----------------------------------------------------------------
    def memory_parts(self) -> dict[str, list[torch.Tensor]]:
        """The model-state tensors this rank holds, by kind (for ``tessera.memory.report``)."""
        return self.residence.memory_parts()

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every parameter readable inside the block (released chunks are gathered, then released
        again; budgets are lifted for it: a full state is whole on every rank by definition)."""
        with self.residence.lifted(), self.store.gathered(), self.frozen.gathered():
            yield

    def params_loaded(self) -> None:
        """After new values were written into the (gathered) parameters: take the shards and
        masters from them."""
        for chunk in self.chunks:
            chunk.scatter_from_full()
            self.residence.master_from_params(chunk)
        for chunk in self.frozen.chunks:
            chunk.scatter_from_full()

    def held_pieces(self) -> list[tuple[str, nn.Parameter, nn.Parameter, int, int]]:
        """``(name, parameter, piece, start, end)`` for each piece this rank steps: ``piece``
        holds elements ``[start, end)`` of ``parameter``'s (tensor-parallel block, row-major)
        values, at the masters' precision (inside the residence's :meth:`Residence.resident`)."""
        out = []
        for chunk, pieces in zip(self.chunks, self.pieces):
            lo = chunk.shard_range[0]
            for piece, slot, a, b in pieces:
                start = lo + a - slot.offset
                out.append((slot.name, self.params[slot.index], piece, start, start + (b - a)))
        return out
