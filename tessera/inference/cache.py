"""The paged KV cache: fixed-size blocks of key/value slots, a block table per sequence, and the
attention that reads a sequence's keys and values through its table.

Every rank keeps the keys and values of its own layers (its pipeline stage) and its own heads
(its tensor-parallel block) in one pool per layer, ``[num_blocks * block_size, kv_heads,
head_dim]``. Which blocks a sequence owns is decided once, by the scheduler on rank 0, and
travels with each step's :class:`~tessera.inference.plan.StepPlan`, so every rank writes and
reads the same slots. A finished (or aborted) sequence's blocks go back to the free list.

A step runs ``S`` sequences with ``T`` new tokens each, left-padded: sequence ``s`` has
``new[s]`` real tokens at the right end of its row and ``past[s]`` tokens already cached.
:class:`StepBatch` turns that into the index tensors the attention needs, once per step, and
:func:`paged_attention` (called by every attention layer) writes the new keys and values into
their slots, gathers each sequence's whole history and attends with a causal mask over it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than asked for (the scheduler admits requests so that
    this never happens to a running sequence)."""


class BlockAllocator:
    """The free list of a pool of ``num_blocks`` blocks of ``block_size`` token slots."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV cache needs at least one block of one slot, got {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, tokens: int) -> int:
        """Blocks needed to hold ``tokens`` slots."""
        return -(-tokens // self.block_size)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfBlocksError(f"asked for {count} KV blocks, {len(self._free)} of {self.num_blocks} are free")
        return [self._free.pop() for _ in range(count)]

    def release(self, blocks: Sequence[int]) -> None:
        taken = set(self._free)
        for block in blocks:
            if block in taken or not 0 <= block < self.num_blocks:
                raise ValueError(f"KV block {block} is not in use: released twice or never allocated")
            taken.add(block)
        self._free.extend(reversed(blocks))


class KVPool:
    """This rank's keys and values: one pair of ``[slots, kv_heads, head_dim]`` tensors per
    layer, made at the layer's first write (their heads, width and dtype are the layer's)."""

    def __init__(self, num_blocks: int, block_size: int, device: torch.device | str = "cpu") -> None:
        self.slots = num_blocks * block_size
        self.device = torch.device(device)
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def layer(self, index: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pools of layer ``index``; ``like`` is a key tensor ``[..., heads, head_dim]``."""
        if index not in self.keys:
            shape = (self.slots, like.shape[-2], like.shape[-1])
            self.keys[index] = torch.zeros(shape, dtype=like.dtype, device=self.device)
            self.values[index] = torch.zeros(shape, dtype=like.dtype, device=self.device)
        return self.keys[index], self.values[index]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pool in (self.keys, self.values) for t in pool.values())


@dataclass
class StepBatch:
    """One step's inputs and cache indices on this rank's device.

    ``tokens``/``positions`` ``[S, T]`` (left padding: token 0 at position 0); ``write_rows``
    the flat ``[S * T]`` indices of the real new tokens and ``write_slots`` their pool slots;
    ``read_slots`` ``[S, L]`` the slots of each sequence's history (``L`` the longest, padded
    with slot 0); ``mask`` ``[S, 1, T, L]`` which history each query row may see."""

    tokens: torch.Tensor
    positions: torch.Tensor
    write_rows: torch.Tensor
    write_slots: torch.Tensor
    read_slots: torch.Tensor
    mask: torch.Tensor
    pool: KVPool

    @classmethod
    def build(
        cls,
        new_tokens: Sequence[Sequence[int]],
        past: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        pool: KVPool,
    ) -> StepBatch:
        """The batch of sequences ``s`` with ``new_tokens[s]`` after ``past[s]`` cached tokens,
        whose slots are in ``block_tables[s]`` (enough blocks for ``past[s] + len(new_tokens[s])``)."""
        device = pool.device
        width = max(len(t) for t in new_tokens)
        history = max(p + len(t) for p, t in zip(past, new_tokens))
        count = len(new_tokens)
        tokens = torch.zeros(count, width, dtype=torch.long)
        positions = torch.zeros(count, width, dtype=torch.long)
        read_slots = torch.zeros(count, history, dtype=torch.long)
        mask = torch.zeros(count, 1, width, history, dtype=torch.bool)
        rows: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        for s, (new, before, table) in enumerate(zip(new_tokens, past, block_tables)):
            n, total = len(new), before + len(new)
            if len(table) * block_size < total:
                raise ValueError(f"sequence {s}: {len(table)} KV blocks hold fewer than its {total} tokens")
            pad = width - n
            tokens[s, pad:] = torch.tensor(list(new), dtype=torch.long)
            positions[s, pad:] = torch.arange(before, total)
            seq_slots = slots_of(table, total, block_size)
            read_slots[s, :total] = seq_slots
            rows.append(torch.arange(s * width + pad, (s + 1) * width))
            slots.append(seq_slots[before:])
            query_pos = torch.arange(before, total).unsqueeze(1)  # [n, 1]
            mask[s, 0, pad:, :total] = torch.arange(total).unsqueeze(0) <= query_pos
            mask[s, 0, :pad, 0] = True  # padding rows see one slot: no empty softmax (their output is unused)
        return cls(
            tokens=tokens.to(device),
            positions=positions.to(device),
            write_rows=torch.cat(rows).to(device),
            write_slots=torch.cat(slots).to(device),
            read_slots=read_slots.to(device),
            mask=mask.to(device),
            pool=pool,
        )


def slots_of(table: Sequence[int], length: int, block_size: int) -> torch.Tensor:
    """Pool slots of positions ``0 .. length-1`` of a sequence with block table ``table``."""
    pos = torch.arange(length)
    return torch.tensor(list(table), dtype=torch.long)[pos // block_size] * block_size + pos % block_size


def paged_attention(
    layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StepBatch, scale: float | None = None
) -> torch.Tensor:
    """Causal attention of a step's new tokens over their sequences' whole history.

    ``q`` ``[S, Hq, T, D]``, ``k``/``v`` ``[S, Hkv, T, D]`` (this layer's new keys and values,
    ``Hq`` a multiple of ``Hkv``) -> ``[S, Hq, T, D]``. Writes the real new keys and values
    into layer ``layer``'s pool first, so a prefill attends to its own tokens."""
    count, kv_heads, width, dim = k.shape
    keys, values = batch.pool.layer(layer, k.transpose(1, 2))
    new_k = k.transpose(1, 2).reshape(count * width, kv_heads, dim)
    new_v = v.transpose(1, 2).reshape(count * width, kv_heads, dim)
    keys[batch.write_slots] = new_k[batch.write_rows].to(keys.dtype)
    values[batch.write_slots] = new_v[batch.write_rows].to(values.dtype)
    past_k = keys[batch.read_slots].transpose(1, 2).to(q.dtype)  # [S, Hkv, L, D]
    past_v = values[batch.read_slots].transpose(1, 2).to(q.dtype)
    groups = q.shape[1] // kv_heads
    if groups > 1:  # grouped-query attention: each key head serves `groups` query heads
        past_k = past_k.repeat_interleave(groups, dim=1)
        past_v = past_v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, past_k, past_v, attn_mask=batch.mask, scale=scale)
