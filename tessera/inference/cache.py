"""The paged KV cache: fixed-size blocks of key/value slots, a block table per sequence, and the
attention that reads a sequence's keys and values through its table.

Every rank keeps the keys and values of its own layers (its pipeline stage) and its own heads
(its tensor-parallel block) in one pool per layer, ``[num_blocks * block_size, kv_heads,
head_dim]``. Which blocks a sequence owns is decided by the scheduler on rank 0
(:mod:`tessera.inference.blocks`) and travels with each step's :class:`~tessera.inference.scheduler.StepPlan`, so every rank writes and
reads the same slots.

A step runs ``S`` sequences with ``T`` new tokens each, left-padded: sequence ``s`` has
``new[s]`` real tokens at the right end of its row and ``past[s]`` tokens already cached.
:class:`StepBatch` turns that into the index tensors the attention needs, once per step, and
:func:`paged_attention` (called by every attention layer) writes the new keys and values into
their slots, gathers each sequence's whole history and attends with a causal mask over it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

# scaled_dot_product_attention(enable_gqa=) since torch 2.5: on CPU it reads each key head for its
# query heads without copying (the same numbers as repeating the key heads)
_SDPA_GQA = torch.__version__ >= "2.5"


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than asked for (the scheduler preempts sequences so that
    this never happens in a step)."""


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
            with torch.inference_mode(False):  # plain tensors: the engine's steps run in inference mode, others may not
                self.keys[index] = torch.zeros(shape, dtype=like.dtype, device=self.device)
                self.values[index] = torch.zeros(shape, dtype=like.dtype, device=self.device)
        return self.keys[index], self.values[index]

    def copy_blocks(self, copies: Sequence[tuple[int, int]], block_size: int) -> None:
        """Copy-on-write: the slots of block ``source`` into block ``destination``, for each pair
        and in every layer (before a step writes into the copies)."""
        if not copies or not self.keys:
            return
        offsets = torch.arange(block_size, device=self.device)
        source = torch.cat([offsets + s * block_size for s, _ in copies])
        target = torch.cat([offsets + d * block_size for _, d in copies])
        for pool in (self.keys, self.values):
            for tensor in pool.values():
                tensor.index_copy_(0, target, tensor.index_select(0, source))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pool in (self.keys, self.values) for t in pool.values())


@dataclass
class StepBatch:
    """One step's inputs and cache indices on this rank's device.

    ``tokens``/``positions`` ``[S, T]`` (left padding: token 0 at position 0); ``write_rows``
    the flat ``[S * T]`` indices of the real new tokens (None when every row is real: no
    padding) and ``write_slots`` their pool slots; ``read_slots`` ``[S, L]`` the slots of each
    sequence's history (``L`` the longest, padded with slot 0); ``mask`` ``[S, 1, T, L]`` which
    history each query row may see, or None when that is plain causal attention (every row
    sees all of ``L`` in a decode of sequences of one length, or a prefill of equal prompts
    from an empty cache: ``causal``). ``adapters``: the served LoRA adapter of each sequence
    (``-1``: the base alone; empty: none for any), which the routed layers read per token."""

    tokens: torch.Tensor
    positions: torch.Tensor
    write_rows: torch.Tensor | None
    write_slots: torch.Tensor
    read_slots: torch.Tensor
    mask: torch.Tensor | None
    pool: KVPool
    causal: bool = False  # mask None and T == L: query row t sees slots 0..t
    adapters: tuple[int, ...] = ()
    logit_index: torch.Tensor | None = None  # flat [S*T] positions to return logits at (None: each row's last)
    read_flat: torch.Tensor = field(init=False)  # read_slots.view(-1), what every layer gathers

    def __post_init__(self) -> None:
        self.read_flat = self.read_slots.view(-1)

    @classmethod
    def build(
        cls,
        new_tokens: Sequence[Sequence[int]],
        past: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        pool: KVPool,
        adapters: Sequence[int] = (),
        logit_positions: Sequence[Sequence[int]] | None = None,
    ) -> StepBatch:
        """The batch of sequences ``s`` with ``new_tokens[s]`` after ``past[s]`` cached tokens,
        whose slots are in ``block_tables[s]`` (enough blocks for ``past[s] + len(new_tokens[s])``),
        using the served adapter ``adapters[s]`` (empty: the base alone for all).
        ``logit_positions[s]``: the positions (absolute, among its new tokens) whose logits
        the runner returns (None: the last new token of each sequence).

        It runs once per step, between the model's forwards (with the caches cold), so it makes
        its indices with few whole-batch numpy calls and hands them to torch at the end."""
        count = len(new_tokens)
        lengths = [len(t) for t in new_tokens]
        totals = [before + n for before, n in zip(past, lengths)]
        for s, (table, total) in enumerate(zip(block_tables, totals)):
            if len(table) * block_size < total:
                raise ValueError(f"sequence {s}: {len(table)} KV blocks hold fewer than its {total} tokens")
        width, history, shortest = max(lengths), max(totals), min(totals)
        read_slots = _history_slots(block_tables, totals, history, block_size)
        write_rows = None
        if min(lengths) != width:  # left padding
            pad = width - np.array(lengths)[:, None]  # [S, 1]
            real = np.arange(width) >= pad  # [S, T]
            tokens = np.array([[0] * (width - len(t)) + list(t) for t in new_tokens], dtype=np.int64)
            positions = np.where(real, np.array(past)[:, None] + np.arange(width) - pad, 0)
            write_slots = np.take_along_axis(read_slots, positions, axis=1)[real]
            write_rows = _tensor(np.flatnonzero(real), pool.device)
        else:
            tokens = np.array(new_tokens, dtype=np.int64).reshape(count, width)
            positions = np.array(past, dtype=np.int64)[:, None] + np.arange(width)
            if shortest == history:  # every sequence's new tokens end its history
                write_slots = read_slots[:, history - width :].reshape(-1)
            else:
                write_slots = np.take_along_axis(read_slots, positions, axis=1).reshape(-1)
        plain_decode = width == 1 and shortest == history
        plain_prefill = write_rows is None and history == width  # every past is 0
        mask = None
        if not (plain_decode or plain_prefill):
            # a padding row has position 0, so it sees slot 0 alone: no empty softmax (its output is unused)
            mask = _tensor(np.arange(history) <= positions[:, :, None], pool.device).unsqueeze(1)
        logit_index = None
        if logit_positions is not None:
            flat = [
                s * width + (width - lengths[s]) + (p - past[s]) for s, ps in enumerate(logit_positions) for p in ps
            ]
            logit_index = _tensor(np.array(flat, dtype=np.int64), pool.device)
        return cls(
            tokens=_tensor(tokens, pool.device),
            positions=_tensor(positions, pool.device),
            write_rows=write_rows,
            write_slots=_tensor(write_slots, pool.device),
            read_slots=_tensor(read_slots, pool.device),
            mask=mask,
            pool=pool,
            causal=plain_prefill and width > 1,
            adapters=tuple(adapters) if any(a >= 0 for a in adapters) else (),
            logit_index=logit_index,
        )


def _history_slots(
    block_tables: Sequence[Sequence[int]], totals: Sequence[int], history: int, block_size: int
) -> np.ndarray:
    """``[S, history]``: the pool slots of positions ``0 .. totals[s]-1`` of each sequence, then 0."""
    blocks = -(-history // block_size)
    rows = [t[:blocks] if len(t) >= blocks else [*t, *[0] * (blocks - len(t))] for t in block_tables]
    table = np.array(rows, dtype=np.int64).reshape(len(rows), blocks)
    slots = (table[:, :, None] * block_size + np.arange(block_size)).reshape(len(rows), -1)[:, :history]
    if min(totals) != history:
        slots = np.where(np.arange(history) < np.array(totals)[:, None], slots, 0)
    return slots


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A torch tensor of ``array`` on ``device`` (shares its memory on the CPU)."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    return t if device.type == "cpu" else t.to(device)


def paged_attention(
    layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StepBatch, scale: float | None = None
) -> torch.Tensor:
    """Causal attention of a step's new tokens over their sequences' whole history.

    ``q`` ``[S, Hq, T, D]``, ``k``/``v`` ``[S, Hkv, T, D]`` (this layer's new keys and values,
    ``Hq`` a multiple of ``Hkv``) -> ``[S, Hq, T, D]``. Writes the real new keys and values
    into layer ``layer``'s pool first, so a prefill attends to its own tokens."""
    count, kv_heads, width, dim = k.shape
    new_k = k.transpose(1, 2).reshape(count * width, kv_heads, dim)
    new_v = v.transpose(1, 2).reshape(count * width, kv_heads, dim)
    keys, values = batch.pool.layer(layer, new_k)
    new_k, new_v = _same_dtype(new_k, keys.dtype), _same_dtype(new_v, values.dtype)
    if batch.write_rows is not None:  # leave the padding out
        new_k, new_v = new_k.index_select(0, batch.write_rows), new_v.index_select(0, batch.write_rows)
    keys.index_copy_(0, batch.write_slots, new_k)
    values.index_copy_(0, batch.write_slots, new_v)
    history = batch.read_slots.shape[1]
    past_k = _same_dtype(keys.index_select(0, batch.read_flat), q.dtype).view(count, history, kv_heads, dim)
    past_v = _same_dtype(values.index_select(0, batch.read_flat), q.dtype).view(count, history, kv_heads, dim)
    past_k, past_v = past_k.transpose(1, 2), past_v.transpose(1, 2)  # [S, Hkv, L, D]
    groups = q.shape[1] // kv_heads
    gqa = groups > 1 and _SDPA_GQA and q.device.type == "cpu"  # CPU kernels take the key heads as they are
    if groups > 1 and not gqa:  # grouped-query attention: each key head serves `groups` query heads
        past_k = past_k.repeat_interleave(groups, dim=1)
        past_v = past_v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(
        q,
        past_k,
        past_v,
        attn_mask=batch.mask,
        is_causal=batch.causal,
        scale=scale,
        **({"enable_gqa": True} if gqa else {}),
    )


def _same_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)  # a no-op .to() still costs a dispatch, per layer
