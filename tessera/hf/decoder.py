"""1D tensor parallelism for a stack of transformer layers, described as data.

A family's policy says where its parts are (:class:`Layout`: the embedding, the list of
layers, in each layer the attention and MLP blocks with their column- and row-parallel
projections and the norms, the final norm, the head); :func:`apply_1d` rewrites any model laid
out that way: projections split, blocks made regions, the embedding and head split on the
vocabulary, and with sequence-parallel regions the norms wrapped and the sequence split before
the first layer and gathered after the final norm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from torch import nn

from tessera.context import ParallelContext
from tessera.hf.layers import (
    ColumnParallel,
    RowParallel,
    SequenceParallelNorm,
    VocabEmbedding,
    VocabHead,
    gather_sequence_after,
    region,
    split_sequence_before,
)
from tessera.hf.policy import retie, swap

__all__ = ["Block", "Layout", "apply_1d", "has_submodule"]


@dataclass(frozen=True)
class Block:
    """A region of a layer: the submodule ``region`` whose input enters the region, its
    ``columns`` projections (dotted names below the layer -> fused parts) and the ``row``
    projection they feed (dotted name below the layer)."""

    region: str
    columns: dict[str, int]
    row: str


@dataclass(frozen=True)
class Layout:
    """Where a family keeps its parts, by dotted name below the model's body (``body``: the
    attribute holding the base model in a model with a head, "" for a base model; ``head`` is
    below the model itself).

    ``embedding``: the word embedding (split on the vocabulary), None for a model without one
    (ViT); ``replicated``: modules that turn the inputs into activations with every parameter
    whole (position and token-type tables, ViT's patch embedding): 1D leaves them as they are;
    ``norms``: in each layer; ``final_norm``: after the layers (None: none); ``head``: the output
    projection, split on the vocabulary when ``vocab_head`` (tied to the embedding or not), else
    a few classes left whole; ``per_layer(layer, parts)``: anything else a layer needs when its
    attention heads are split ``parts`` ways (head counts kept as attributes, say)."""

    body: str
    embedding: str | None
    layers: str
    blocks: tuple[Block, ...]
    norms: tuple[str, ...]
    final_norm: str | None
    head: str = "lm_head"
    vocab_head: bool = True
    replicated: tuple[str, ...] = ()
    per_layer: Callable[[Any, int], None] | None = None


def has_submodule(root: nn.Module, name: str) -> bool:
    """Whether ``root`` has the submodule at dotted ``name``."""
    try:
        root.get_submodule(name)
    except AttributeError:
        return False
    return True


def apply_1d(model: Any, ctx: ParallelContext, layout: Layout) -> dict[int, nn.Parameter]:
    """Rewrite ``model`` (laid out as ``layout``) for 1D tensor parallelism under ``ctx``; the
    replaced parameters, old id -> new parameter."""
    has_head = has_submodule(model, layout.head)
    prefix = f"{layout.body}." if has_head and layout.body else ""
    body = model.get_submodule(layout.body) if prefix else model
    sp = ctx.dims.sequence_parallel
    replaced: dict[int, nn.Parameter] = {}
    if layout.embedding is not None:
        swap(model, prefix + layout.embedding, lambda m: VocabEmbedding(m, ctx=ctx), replaced)
    layers = body.get_submodule(layout.layers)
    for n, layer in enumerate(layers):
        name = f"{prefix}{layout.layers}.{n}"
        for block in layout.blocks:
            for column, groups in block.columns.items():
                swap(model, f"{name}.{column}", partial(ColumnParallel, ctx=ctx, groups=groups), replaced)
            swap(model, f"{name}.{block.row}", partial(RowParallel, ctx=ctx, sequence_parallel=sp), replaced)
            region(layer.get_submodule(block.region), ctx, sp)
        if sp:
            for norm in layout.norms:
                swap(model, f"{name}.{norm}", lambda m: SequenceParallelNorm(m, ctx=ctx), replaced)
        if layout.per_layer is not None:
            layout.per_layer(layer, ctx.size("tensor"))
    if sp:
        split_sequence_before(layers[0], ctx)
        if layout.final_norm is None:
            gather_sequence_after(layers[len(layers) - 1], ctx)
        else:
            final = swap(model, prefix + layout.final_norm, lambda m: SequenceParallelNorm(m, ctx=ctx), replaced)
            gather_sequence_after(final, ctx)
    if has_head and layout.vocab_head:
        tied = replaced.get(id(model.get_submodule(layout.head).weight))  # tied to the embedding: share its split
        swap(model, layout.head, lambda m: VocabHead(m, ctx=ctx, tied=tied), replaced)
    retie(model, replaced)  # a parameter the model shares elsewhere (BERT's head bias) follows its split
    return replaced
