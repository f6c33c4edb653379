"""The chunk store: model tensors packed into flat chunks, each split evenly over a group.

A chunk is one flat buffer holding several parameters end to end (padded so that every member
of the group holds an equal shard). The parameters become views into the chunk's full buffer.
Each member keeps its shard; the full payload exists only while the chunk is gathered:

    SHARDED --gather--> GATHERING --wait--> GATHERED --release--> SHARDED
    SHARDED --------------gather(sync)----> GATHERED

Releasing frees the full buffer's storage (``resize_(0)``) without dropping the tensor, so the
parameter views, and any views autograd saved of them, see the data again after the next gather.
A chunk created with ``keep_full=True`` (ZeRO stages 1 and 2) is always gathered and its shard
is a view into the full buffer (no second copy); any other chunk starts SHARDED, holding only
its shard. ZeRO-3 and the Gemini memory manager share
this store; every state change goes through :meth:`Chunk.to_state`, which refuses illegal moves.

A module whose parameters are views into released chunks would give ``state_dict()`` tensors
with empty storage (and ``load_state_dict()`` would write into none); :class:`WholeStateDict`
gathers the chunks around those calls, returns copies and takes the shards of loaded values.
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tessera import comm
from tessera.comm import AxisGroup, Pending


class ChunkState(enum.Enum):
    SHARDED = "sharded"  # only this member's shard is held
    GATHERING = "gathering"  # an all-gather into the full buffer is in flight
    GATHERED = "gathered"  # the full payload is in the buffer


LEGAL_TRANSITIONS: dict[ChunkState, frozenset[ChunkState]] = {
    ChunkState.SHARDED: frozenset({ChunkState.GATHERING, ChunkState.GATHERED}),
    ChunkState.GATHERING: frozenset({ChunkState.GATHERED}),
    ChunkState.GATHERED: frozenset({ChunkState.SHARDED}),
}


class IllegalTransition(RuntimeError):
    """A chunk was asked to move between two states that the transition table does not link."""


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one tensor lives: ``chunk.full[offset : offset + numel]`` viewed as ``shape``."""

    name: str
    index: int  # position among all tensors of the store (stable across ranks)
    shape: torch.Size
    offset: int
    numel: int


class Chunk:
    """One flat buffer of several tensors, sharded evenly over ``group``."""

    def __init__(
        self,
        slots: list[Slot],
        dtype: torch.dtype,
        device: torch.device,
        group: AxisGroup,
        keep_full: bool,
        index: int = 0,
        capacity: int = 0,
    ) -> None:
        self.slots = slots
        self.index = index
        self.group = group
        self.keep_full = keep_full
        self.numel = sum(s.numel for s in slots)
        self.shard_numel = max(1, math.ceil(max(self.numel, capacity) / group.size))
        self.padded_numel = self.shard_numel * group.size
        # A sharded chunk's full buffer starts unwritten (torch.empty touches no pages) and is
        # released right after packing: packing never holds a whole chunk's payload.
        make = torch.zeros if keep_full else torch.empty
        self.full = make(self.padded_numel, dtype=dtype, device=device)
        start = group.rank * self.shard_numel
        if keep_full:
            self.shard = self.full[start : start + self.shard_numel]
        else:
            self.shard = torch.zeros(self.shard_numel, dtype=dtype, device=device)
        self.state = ChunkState.GATHERED
        self._pending: Pending | None = None

    # ---- what this member owns -------------------------------------------------------------
    @property
    def shard_range(self) -> tuple[int, int]:
        """[start, end) of this member's shard within the flat chunk."""
        start = self.group.rank * self.shard_numel
        return start, start + self.shard_numel

    def view(self, slot: Slot) -> torch.Tensor:
        """The tensor of ``slot`` as a view into the full buffer."""
        return self.full[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def shard_pieces(self) -> Iterator[tuple[Slot, int, int]]:
        """``(slot, start, end)`` for each tensor overlapping this member's shard, where
        [start, end) is the overlap in shard coordinates (0 .. shard_numel)."""
        lo, hi = self.shard_range
        for slot in self.slots:
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a < b:
                yield slot, a - lo, b - lo

    # ---- state machine ---------------------------------------------------------------------
    def to_state(self, new: ChunkState) -> None:
        if new not in LEGAL_TRANSITIONS[self.state]:
            raise IllegalTransition(f"chunk {self.index}: {self.state.value} -> {new.value} is not a legal move")
        self.state = new

    def scatter_from_full(self) -> None:
        """Take this member's shard from the (gathered) full buffer: called once after the
        tensors were written into the chunk, before the first release."""
        if self.state is not ChunkState.GATHERED:
            raise IllegalTransition(f"chunk {self.index}: cannot take a shard while {self.state.value}")
        if not self.keep_full:
            lo, hi = self.shard_range
            self.shard.copy_(self.full[lo:hi])

    def gather(self, async_op: bool = False) -> None:
        """Bring back the full payload from every member's shard (a no-op when gathered)."""
        if self.state is ChunkState.GATHERED or (self.state is ChunkState.GATHERING and async_op):
            return
        if self.state is ChunkState.GATHERING:
            self.wait()
            return
        storage = self.full.untyped_storage()
        storage.resize_(self.padded_numel * self.full.element_size())
        self._pending = comm.all_gather_into(self.full, self.shard, self.group, async_op=True)
        self.to_state(ChunkState.GATHERING)
        if not async_op:
            self.wait()

    def wait(self) -> None:
        """Finish a gather in flight."""
        if self.state is not ChunkState.GATHERING:
            return
        assert self._pending is not None
        self._pending.wait()
        self._pending = None
        self.to_state(ChunkState.GATHERED)

    def release(self) -> None:
        """Free the full buffer's storage, keeping only the shard (chunks that keep their full
        buffer, and chunks already sharded, stay as they are)."""
        if self.keep_full or self.state is ChunkState.SHARDED:
            return
        self.wait()
        self.to_state(ChunkState.SHARDED)
        self.full.untyped_storage().resize_(0)

    def refresh_full(self, async_op: bool = False) -> Pending | None:
        """After the shard changed (an optimizer step): every member's new shard into the full
        buffer (chunks that keep it, or are gathered now), or nothing (released chunks gather on
        next use). With ``async_op`` the returned gather is still in flight."""
        if self.keep_full:  # the shard is a view into the full buffer: gather from a copy
            return comm.all_gather_into(self.full, self.shard.clone(), self.group, async_op=async_op)
        if self.state is ChunkState.GATHERED:
            return comm.all_gather_into(self.full, self.shard, self.group, async_op=async_op)
        return None

    def held_bytes(self) -> int:
        """Bytes this member holds for the chunk's payload right now (full buffer and shard)."""
        full = self.full.untyped_storage().nbytes()
        shard = 0 if self.keep_full else self.shard.numel() * self.shard.element_size()
        return full + shard


class ChunkStore:
    """Tensors packed into chunks of at most ``chunk_numel`` elements (a larger tensor gets a
    chunk of its own), in the order given, each chunk sharded over ``group`` (or over the group
    ``groups`` names for its tensors)."""

    def __init__(
        self,
        named: Sequence[tuple[str, torch.Tensor]],
        group: AxisGroup,
        *,
        chunk_numel: int,
        dtype: torch.dtype | None = None,
        keep_full: bool = False,
        bins: Sequence[int] | None = None,
        on_close: Callable[[Chunk], None] | None = None,
        device: torch.device | None = None,
        chunk_type: type[Chunk] = Chunk,
        fixed_size: bool = False,
        groups: Sequence[AxisGroup] | None = None,
    ) -> None:
        """``named``: the tensors to pack; ``dtype``: the chunks' dtype (default: each tensor's);
        ``bins``: a label per tensor (a parameter group, a block of the model); tensors of
        different labels never share a chunk; ``on_close(chunk)``: called as soon as each
        chunk is filled (to re-point its tensors and release it before the next is built, so
        that packing a model never holds all of it twice); ``device``: the chunks' device
        (default: each first tensor's); ``chunk_type``: the class of the chunks (a subclass of
        :class:`Chunk`); ``fixed_size``: every chunk holds ``chunk_numel`` elements however
        many its tensors fill (buffers of one size that take turns in the same memory). Tensors
        on the meta device (a deferred model) are not copied: their values are written into the
        chunks later. ``groups``: a group per tensor, instead of ``group`` for all (tensors of
        different groups never share a chunk; an MoE layer's experts shard over the ranks that
        replicate them, the rest of the model over all data ranks)."""
        if chunk_numel < 1:
            raise ValueError(f"chunk_numel={chunk_numel} must be at least 1")
        if groups is not None and len(groups) != len(named):
            raise ValueError(f"ChunkStore: {len(groups)} groups for {len(named)} tensors")
        self.group = group
        self.chunks: list[Chunk] = []
        self._where: dict[str, tuple[Chunk, Slot]] = {}
        labels = list(bins) if bins is not None else [0] * len(named)
        pending: list[tuple[int, str, torch.Tensor]] = []

        def close() -> None:
            if not pending:
                return
            slots, offset = [], 0
            for index, name, tensor in pending:
                slots.append(Slot(name, index, tensor.shape, offset, tensor.numel()))
                offset += tensor.numel()
            first = pending[0][2]
            chunk_group = group if groups is None else groups[pending[0][0]]
            chunk = chunk_type(
                slots, dtype or first.dtype, device or first.device, chunk_group, keep_full, index=len(self.chunks),
                capacity=chunk_numel if fixed_size else 0,
            )  # fmt: skip
            with torch.no_grad():
                if keep_full:
                    for (_, _, tensor), slot in zip(pending, slots):
                        if not tensor.is_meta:
                            chunk.view(slot).copy_(tensor)
                else:  # only this member's part goes into its shard
                    by_index = {index: tensor for index, _, tensor in pending}
                    for slot, start, end in chunk.shard_pieces():
                        if by_index[slot.index].is_meta:
                            continue
                        at = chunk.shard_range[0] + start - slot.offset
                        chunk.shard[start:end].copy_(by_index[slot.index].reshape(-1)[at : at + end - start])
            for slot in slots:
                self._where[slot.name] = (chunk, slot)
            self.chunks.append(chunk)
            pending.clear()
            if on_close is not None:
                on_close(chunk)  # the full buffer's storage is still there: views of it can be taken
            chunk.release()  # a sharded chunk starts SHARDED (its full buffer was never written)

        filled = 0
        for index, (name, tensor) in enumerate(named):
            if name in self._where or any(name == n for _, n, _ in pending):
                raise ValueError(f"tensor name {name!r} appears twice")
            starts_new = pending and (
                labels[index] != labels[pending[0][0]]
                or (groups is not None and groups[index] is not groups[pending[0][0]])
                or tensor.dtype != pending[0][2].dtype
                or tensor.device != pending[0][2].device
                or filled + tensor.numel() > chunk_numel
            )
            if starts_new:
                close()
                filled = 0
            pending.append((index, name, tensor))
            filled += tensor.numel()
        close()

    def locate(self, name: str) -> tuple[Chunk, Slot]:
        return self._where[name]

    def view(self, name: str) -> torch.Tensor:
        chunk, slot = self._where[name]
        return chunk.view(slot)

    @contextmanager
    def gathered(self, chunks: Sequence[Chunk] | None = None) -> Iterator[None]:
        """Every chunk (or the given ones) gathered inside the block; those that were sharded
        before are released again after it."""
        chosen = list(self.chunks if chunks is None else chunks)
        was_sharded = [c for c in chosen if c.state is not ChunkState.GATHERED]
        for c in chosen:
            c.gather()
        try:
            yield
        finally:
            for c in was_sharded:
                c.release()

    def held_bytes(self) -> int:
        return sum(c.held_bytes() for c in self.chunks)


class WholeStateDict:
    """``module.state_dict()`` and ``module.load_state_dict()`` with whole tensors although
    ``module``'s parameters are views into chunks that are released between uses
    (``chunk_of``: a parameter's, or a buffer's, id to its chunk).

    Hooks on every module holding such a parameter (and on their ancestors): before a module's
    entries are written or read, its chunks are gathered; after them, a saved entry that views
    a chunk which does not keep its full buffer is replaced by a copy. Once the last module
    using a chunk is done, a load takes the chunk's shard from the loaded values and calls
    ``on_loaded(chunk)`` (ZeRO's fp32 masters follow), and a chunk the call gathered is
    released. A call thus holds the copies and the chunks in use, never the model twice, and
    leaves every chunk as it found it. Tied parameters get one copy, shared by their keys, as
    single-process tensors share storage. Collective over the chunks' groups: every member
    makes the same call (each chunk is gathered once per call). ``state_dict(keep_vars=True)``
    returns the live parameters (empty while released) and communicates nothing;
    ``load_state_dict(assign=True)`` is refused (it would replace the chunks' views).
    """

    def __init__(
        self, module: nn.Module, chunk_of: Mapping[int, Chunk], on_loaded: Callable[[Chunk], None] | None = None
    ) -> None:
        self._chunk_of = dict(chunk_of)
        self._on_loaded = on_loaded
        self._own: dict[int, list[Chunk]] = {}  # id(module) -> chunks of its own parameters
        hooked: set[int] = set()
        for path, m in module.named_modules(remove_duplicate=False):  # a shared module: every path
            own = {id(self._chunk_of[id(t)]): self._chunk_of[id(t)] for _, t in _own_tensors(m)
                   if id(t) in self._chunk_of}  # fmt: skip
            if own:
                self._own[id(m)] = list(own.values())
                hooked.update(id(a) for a in _ancestors(module, path))

        def after_save(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
            self._after_save(module, state, prefix)  # a function: torch marks the post-hooks it is given

        before_save, before_load, after_load = self._before_save, self._before_load, self._after_load  # bound once
        for m in module.modules():
            if id(m) in hooked:
                m.register_state_dict_pre_hook(before_save)
                m.register_state_dict_post_hook(after_save)
                m.register_load_state_dict_pre_hook(before_load)
                m.register_load_state_dict_post_hook(after_load)
        # the call in progress
        self._kind = ""  # "save" or "load"
        self._stack: list[nn.Module] = []  # modules whose call is running, outermost first
        self._users_left: Counter[int] = Counter()  # id(chunk) -> modules of the call still to use it
        self._touched: dict[int, Chunk] = {}  # chunks the call uses and is not through with
        self._gathered: set[int] = set()  # chunks the call gathered (released again)
        self._copies: dict[int, torch.Tensor] = {}  # id(parameter) -> its saved copy (ties share it)

    # ---- the hooks -----------------------------------------------------------------------------
    def _before_save(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if not keep_vars:
            self._enter(module, "save")

    def _after_save(self, module: nn.Module, state: dict[str, Any], prefix: str) -> None:
        if not self._follows(module, "save"):
            return  # keep_vars=True
        for name, p in _own_tensors(module):
            chunk = self._chunk_of.get(id(p))
            key = prefix + name
            if chunk is None or chunk.keep_full or key not in state:
                continue
            if id(p) not in self._copies:
                self._copies[id(p)] = state[key].clone()
            state[key] = self._copies[id(p)]
        self._leave(module)

    def _before_load(self, module: nn.Module, state: Any, prefix: str, local_metadata: Any, *args: Any) -> None:
        if local_metadata.get("assign_to_params_buffers"):  # refused at the first module, before any change
            raise ValueError(
                f"load_state_dict(assign=True) would replace parameters of {type(module).__name__} that "
                "live in chunks (ZeRO, chunked memory) with the given tensors: load with assign=False"
            )
        self._enter(module, "load")

    def _after_load(self, module: nn.Module, incompatible_keys: Any) -> None:
        if self._follows(module, "load"):
            self._leave(module)

    # ---- one call ------------------------------------------------------------------------------
    def _enter(self, module: nn.Module, kind: str) -> None:
        if self._stack and (kind != self._kind or not any(c is module for c in self._stack[-1].children())):
            self._finish()  # left over from a call that raised: not our parent, so a new call
        if not self._stack:
            self._kind = kind
            for _, m in module.named_modules(remove_duplicate=False):  # as the call visits them
                self._users_left.update(id(c) for c in self._own.get(id(m), ()))
        self._stack.append(module)
        for chunk in self._own.get(id(module), ()):
            if chunk.state is ChunkState.SHARDED:
                self._gathered.add(id(chunk))
            chunk.gather()
            self._touched[id(chunk)] = chunk

    def _follows(self, module: nn.Module, kind: str) -> bool:
        return bool(self._stack) and self._stack[-1] is module and self._kind == kind

    def _leave(self, module: nn.Module) -> None:
        self._stack.pop()
        for chunk in self._own.get(id(module), ()):
            self._users_left[id(chunk)] -= 1
            if self._users_left[id(chunk)] <= 0:
                self._done_with(chunk)
        if not self._stack:
            self._finish()

    def _done_with(self, chunk: Chunk) -> None:
        if self._touched.pop(id(chunk), None) is None:
            return
        if self._kind == "load":
            chunk.scatter_from_full()
            if self._on_loaded is not None:
                self._on_loaded(chunk)
        if id(chunk) in self._gathered:
            self._gathered.discard(id(chunk))
            chunk.release()

    def _finish(self) -> None:
        for chunk in list(self._touched.values()):
            self._done_with(chunk)
        self._stack.clear()
        self._users_left.clear()
        self._touched.clear()
        self._gathered.clear()
        self._copies.clear()


def _own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module``'s own parameters and buffers (a frozen base's quantized codes live in chunks too)."""
    return [*module.named_parameters(recurse=False, remove_duplicate=False), *module.named_buffers(recurse=False)]


def _ancestors(root: nn.Module, path: str) -> list[nn.Module]:
    """The modules from ``root`` down to the submodule at ``path`` (both included)."""
    found = [root]
    for part in path.split(".") if path else []:
        found.append(found[-1].get_submodule(part))
    return found
