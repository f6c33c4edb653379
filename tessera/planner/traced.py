"""A :class:`~tessera.planner.spec.ModelSpec` measured from a module: for a transformer the planner
has no preset or config for, read its sizes off its parameters and trace what one forward keeps
for the backward.

The module's blocks are its checkpointable blocks (:func:`tessera.nn.recompute.is_block`: tessera's
own), else the longest ``nn.ModuleList`` of one class (Hugging Face's ``layers``, ``h``,
``layer``). Inside one block: the width ``d_model`` is the most common length of its vectors
(norms and output biases); each matrix has one side of that width, and the other side is its
``width``. The MLP's hidden width is the largest width that at least two matrices share (three:
a gated MLP); whatever the block's matrices hold beyond the MLP is attention, ``2 d^2`` for the
queries and the output and ``2 d kv`` for the keys and values, which gives the key/value width.
Outside the blocks the vocabulary is the largest table of rows of ``d_model`` and a second such
table is a learned position table; one table of the vocabulary's rows means the output layer is
tied to it. The heads come from ``n_heads=``, else the module's config or attributes
(``num_attention_heads``, ``n_head``, ``num_heads``, ``n_heads``; or ``head_dim``).

The trace runs the module once on ``example`` (real values: a small batch is enough) and counts
the bytes each block's forward keeps for the backward (saved-tensor hooks; parameters and
storages seen before left out), per token: :mod:`tessera.planner.memory` then scales its
per-layout formulas by the measured over the formula's unsplit block.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import torch
from torch import nn

from tessera.errors import ConfigError
from tessera.planner.spec import Family, ModelSpec

_HEAD_ATTRIBUTES = ("num_attention_heads", "n_head", "num_heads", "n_heads")


def _blocks(module: nn.Module) -> list[nn.Module]:
    from tessera.nn.recompute import is_block

    marked = [m for name, m in module.named_modules() if name and is_block(name, m)]
    if marked:
        return marked
    lists: list[nn.ModuleList] = [m for m in module.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    lists = [m for m in lists if len({type(child) for child in m}) == 1]
    if not lists:
        raise ConfigError(
            f"{type(module).__name__}: no transformer blocks found (neither tessera's marked blocks nor an "
            "nn.ModuleList of one class); describe it with a preset or a config instead"
        )
    longest: nn.ModuleList = max(lists, key=lambda m: sum(1 for _ in m))
    return list(longest)


def _heads(module: nn.Module, block: nn.Module, d_model: int) -> int:
    config = getattr(module, "config", None)
    for owner in (config, *block.modules()):
        for attribute in _HEAD_ATTRIBUTES:
            value = getattr(owner, attribute, None)
            if isinstance(value, int) and value > 0:
                return value
    for owner in block.modules():
        head_dim = getattr(owner, "head_dim", None)
        if isinstance(head_dim, int) and head_dim > 0 and d_model % head_dim == 0:
            return d_model // head_dim
    raise ConfigError(f"{type(module).__name__}: cannot tell its attention heads; pass n_heads=")


def _shape(module: nn.Module, blocks: list[nn.Module], n_heads: int | None) -> dict[str, Any]:
    block = blocks[0]
    vectors = [p.numel() for p in block.parameters() if p.dim() == 1]
    matrices = [tuple(p.shape) for p in block.parameters() if p.dim() == 2]
    if not vectors or not matrices:
        raise ConfigError(f"{type(block).__name__}: a block without norms or matrices is not a transformer block")
    d = collections.Counter(vectors).most_common(1)[0][0]
    widths = [b if a == d else a for a, b in matrices if d in (a, b)]
    counts = collections.Counter(widths)
    shared = [w for w, n in counts.items() if n >= 2 and w > d] or [w for w, n in counts.items() if n >= 2]
    if not shared:
        raise ConfigError(f"{type(block).__name__}: no MLP found (two matrices of one hidden width)")
    ff = max(shared)
    gated = counts[ff] >= 3
    mlp = (3 if gated else 2) * d * ff
    attention = sum(a * b for a, b in matrices) - mlp
    kv = (attention - 2 * d * d) // (2 * d)
    if kv < 1 or attention != 2 * d * d + 2 * d * kv:
        raise ConfigError(f"{type(block).__name__}: its matrices are not a self-attention and an MLP of width {d}")
    heads = n_heads or _heads(module, block, d)
    norms = [m for m in block.modules() if "norm" in type(m).__name__.lower()]
    rms = any("rms" in type(m).__name__.lower() for m in norms)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    tables = [p for p in module.parameters() if p.dim() == 2 and id(p) not in in_blocks and d in p.shape]
    if not tables:
        raise ConfigError(f"{type(module).__name__}: no embedding of width {d} outside the blocks")
    rows = sorted((p.shape[0] if p.shape[1] == d else p.shape[1] for p in tables), reverse=True)
    vocab = rows[0]
    positions = [n for n in rows[1:] if n != vocab]
    vocab_tables = rows.count(vocab)
    biases = sum(vectors) > len(norms) * d * (1 if rms else 2)
    return {
        "d_model": d,
        "ff_dim": ff,
        "gated_mlp": gated,
        "n_heads": heads,
        "n_kv_heads": kv // (d // heads) if kv != d else None,
        "norm": "rmsnorm" if rms else "layernorm",
        "vocab_size": vocab,
        "learned_positions": bool(positions),
        "max_positions": positions[0] if positions else None,
        "tie_weights": vocab_tables == 1,
        "biases": biases,
    }


def _kept_per_block(module: nn.Module, blocks: list[nn.Module], example: Any) -> float:
    """Bytes each block's forward keeps for the backward, averaged over the blocks."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: set[int] = set(params)
    kept = [0]
    inside = [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if inside[0] and ptr not in seen:
            kept[0] += t.untyped_storage().nbytes()
        seen.add(ptr)
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    handles = []
    for block in blocks:

        def enter(*_: Any) -> None:
            inside[0] = True

        def leave(*_: Any) -> None:
            inside[0] = False

        handles.append(block.register_forward_pre_hook(enter))
        handles.append(block.register_forward_hook(leave))
    try:
        with torch.enable_grad(), hooks:
            out = module(**example) if isinstance(example, dict) else module(example)
        del out
    finally:
        for handle in handles:
            handle.remove()
    return kept[0] / len(blocks)


def from_module(
    module: nn.Module,
    example: Any,
    *,
    name: str | None = None,
    family: Family | None = None,
    n_heads: int | None = None,
    seq_len: int | None = None,
) -> ModelSpec:
    """A spec of ``module`` (a transformer: blocks of self-attention and an MLP) read off its
    parameters, with the activation bytes per token of its blocks traced on ``example`` (a batch
    of token ids, or a dict of the module's inputs; its second dimension is the sequence unless
    ``seq_len`` is given). ``family``: "gpt" unless the blocks are LLaMA's (gated MLP, RMSNorm)
    or given; ``n_heads`` where the module does not say."""
    blocks = _blocks(module)
    shape = _shape(module, blocks, n_heads)
    first = next(iter(example.values())) if isinstance(example, dict) else example
    if not isinstance(first, torch.Tensor) or first.dim() < 2:
        raise ConfigError("from_module: example must be a batch (a tensor, or a dict of them) of [batch, seq, ...]")
    batch, seq = int(first.shape[0]), int(first.shape[1])
    inferred: Family = "llama" if shape["gated_mlp"] or shape["norm"] == "rmsnorm" else "gpt"
    spec = ModelSpec(
        name=name or type(module).__name__,
        family=family or inferred,
        n_layers=len(blocks),
        seq_len=seq_len or seq,
        **shape,
    )
    counted, actual = spec.num_parameters(), sum(p.numel() for p in module.parameters())
    if abs(counted - actual) > 0.01 * actual:
        raise ConfigError(
            f"{spec.name}: the description covers {counted:,} of its {actual:,} parameters; it is not a plain "
            "transformer the planner describes (give a preset or a config)"
        )
    kept = _kept_per_block(module, blocks, example)
    return dataclasses.replace(spec, traced_block_bytes_per_token=kept / (batch * seq))


__all__ = ["from_module"]
