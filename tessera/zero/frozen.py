"""The frozen part of a model under parameter release (ZeRO-3, Gemini): parameters that never
train (a LoRA adapter's base, frozen layers) and the buffers a module names in
``frozen_buffers`` (a quantized base's codes and scales) are packed into chunks of their own,
sharded over the same groups as trainable parameters and released between uses like them. They
have no gradient, no fp32 master and no optimizer state: a rank holds its shard of them and the
chunks a running module needs, never the whole frozen model.

A frozen chunk is gathered before a module that uses it runs, forward and backward, and released
after its forward and once the gradient of its inputs is computed in the backward
(:class:`~tessera.memory.release.ReleaseOnUse`). Checkpoints and a deferred model's filling see
each rank's shard as flat ranges of the tensors (:meth:`FrozenStore.pieces`), so a frozen base
is saved, loaded and materialised shard by shard.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from tessera import comm
from tessera.comm import AxisGroup
from tessera.context import ParallelContext
from tessera.context.placement import update_placement
from tessera.context.reduction import gradient_reduction
from tessera.memory.chunks import Chunk, ChunkState, ChunkStore, Slot
from tessera.memory.deferred import module_tensors, set_data
from tessera.memory.search import packing_labels

#: one frozen tensor's piece on this rank: (state-dict key, the model's tensor, the piece, start, end)
FrozenPiece = tuple[str, torch.Tensor, torch.Tensor, int, int]


def adopting(
    tensors: Sequence[torch.Tensor], slot_of: dict[int, tuple[Chunk, Slot]], storage: Any
) -> Callable[[Chunk], None]:
    """A store's ``on_close``: each of ``tensors`` packed into the chunk becomes a view into it
    (its old storage goes), is recorded in ``slot_of`` and names ``storage`` as its owner (full
    state dicts gather and load through it)."""

    def adopt(chunk: Chunk) -> None:
        for slot in chunk.slots:
            tensor = tensors[slot.index]
            set_data(tensor, chunk.view(slot))  # type: ignore[arg-type]
            slot_of[id(tensor)] = (chunk, slot)
            update_placement(tensor, storage=storage)

    return adopt


def frozen_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` for each of ``model``'s parameters that does not train and each buffer
    its module names in ``frozen_buffers``, once each (a tied one under its first key)."""
    found = []
    for key, owner, attr, kind, tensor in module_tensors(model):
        frozen_buffer = kind == "buffer" and attr in getattr(owner, "frozen_buffers", ())
        if (kind == "parameter" and not tensor.requires_grad) or frozen_buffer:
            found.append((key, tensor))
    return found


class FrozenStore:
    """``named`` frozen tensors of ``model`` (:func:`frozen_tensors`; none: the frozen tensors
    stay where they are, as under ZeRO stages 1 and 2) in released chunks of at most
    ``chunk_numel`` elements, each tensor now a view into its chunk (see the module docstring).
    ``storage``: the owner the tensors' placements name (it gathers and loads them);
    ``chunk_type``: the chunks' class (Gemini's tiered chunk); ``group``: the group every tensor
    is sharded over (hybrid sharding: the replicas on this rank's host; default: each tensor's
    gradient reduction's)."""

    def __init__(
        self,
        named: list[tuple[str, torch.Tensor]],
        model: nn.Module,
        ctx: ParallelContext,
        *,
        chunk_numel: int,
        storage: Any,
        chunk_type: type[Chunk] = Chunk,
        group: AxisGroup | None = None,
    ) -> None:
        self.tensors = [t for _, t in named]
        self.slot_of: dict[int, tuple[Chunk, Slot]] = {}
        # experts shard as their gradients would be reduced, unless a group is given
        groups = [group if group is not None else gradient_reduction(ctx, t).group for t in self.tensors]
        labels = packing_labels(model, [k for k, _ in named], [id(g) for g in groups])
        adopt = adopting(self.tensors, self.slot_of, storage)
        self.store = ChunkStore(
            named, group if group is not None else ctx.replicas, chunk_numel=chunk_numel, bins=labels,
            on_close=adopt, device=ctx.device, groups=groups, chunk_type=chunk_type,
        ) if named else None  # fmt: skip
        self.chunks: list[Chunk] = self.store.chunks if self.store is not None else []
        # stable tensors for checkpoints (a listing keeps them): each views its range of a shard
        self._pieces: list[list[tuple[Slot, torch.Tensor, int, int]]] = [
            [(slot, torch.empty(0, dtype=chunk.shard.dtype, device=ctx.device), a, b)
             for slot, a, b in chunk.shard_pieces()]
            for chunk in self.chunks
        ]  # fmt: skip

    @property
    def stores(self) -> list[ChunkStore]:
        return [self.store] if self.store is not None else []

    def gathered(self) -> AbstractContextManager[None]:
        """Every frozen chunk gathered inside the block (see ``ChunkStore.gathered``)."""
        return self.store.gathered() if self.store is not None else nullcontext()

    def chunk_of(self) -> dict[int, Chunk]:
        return {key: chunk for key, (chunk, _) in self.slot_of.items()}

    def pieces(
        self, shard_of: Callable[[Chunk], torch.Tensor] | None = None, chunks: list[Chunk] | None = None
    ) -> list[FrozenPiece]:
        """This rank's pieces of every frozen tensor (of ``chunks``, default all), each viewing
        its range of the chunk's shard (``shard_of(chunk)``: where the shard is now; default
        ``chunk.shard``): read and write them to save, load or fill the frozen tensors."""
        out = []
        chosen = None if chunks is None else {id(c) for c in chunks}
        for chunk, pieces in zip(self.chunks, self._pieces):
            if chosen is not None and id(chunk) not in chosen:
                continue
            shard = chunk.shard if shard_of is None else shard_of(chunk)
            lo = chunk.shard_range[0]
            for slot, piece, a, b in pieces:
                piece.data = shard[a:b]
                start = lo + a - slot.offset
                out.append((slot.name, self.tensors[slot.index], piece, start, start + (b - a)))
        return out

    def loaded(self, shard_of: Callable[[Chunk], torch.Tensor] | None = None) -> None:
        """New values reached the shards (a checkpoint): a chunk gathered now takes them
        (collective over the chunks' groups; ``shard_of`` as for :meth:`pieces`)."""
        for chunk in self.chunks:
            if chunk.state is ChunkState.GATHERED:
                shard = chunk.shard if shard_of is None else shard_of(chunk)
                comm.all_gather_into(chunk.full, shard.clone(), chunk.group)

    def keys(self) -> set[int]:
        """The ids of the frozen tensors."""
        return {id(t) for t in self.tensors}


__all__ = ["FrozenPiece", "FrozenStore", "adopting", "frozen_tensors"]
