"""1D tensor parallelism for a stack of transformer layers, described as data.

A family's policy says where its parts are (:class:`Layout1D`: the embedding, the list of
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
from tessera.hf.policy import swap

__all__ = ["Block", "Layout1D", "apply_1d"]


@dataclass(frozen=True)
class Block:
    """A region of a layer: the submodule ``name`` whose ``columns`` (name -> fused parts) feed
    its ``row`` projection."""

    name: str
    columns: dict[str, int]
    row: str


@dataclass(frozen=True)
class Layout1D:
    """Where a family keeps its parts, by dotted name below the model's body (``body``: the
    attribute holding the base model in a model with a head, "" for a base model)."""

    body: str
    embedding: str
    layers: str
    blocks: tuple[Block, ...]
    norms: tuple[str, ...]  # in each layer
    final_norm: str
    head: str = "lm_head"
    per_layer: Callable[[Any, int], None] | None = None  # anything else a layer needs (size P)


def apply_1d(model: Any, ctx: ParallelContext, layout: Layout1D) -> dict[int, nn.Parameter]:
    """Rewrite ``model`` (laid out as ``layout``) for 1D tensor parallelism under ``ctx``; the
    replaced parameters, old id -> new parameter."""
    has_head = hasattr(model, layout.head)
    prefix = f"{layout.body}." if has_head and layout.body else ""
    body = model.get_submodule(layout.body) if prefix else model
    sp = ctx.dims.sequence_parallel
    replaced: dict[int, nn.Parameter] = {}
    swap(model, prefix + layout.embedding, lambda m: VocabEmbedding(m, ctx=ctx), replaced)
    layers = body.get_submodule(layout.layers)
    for n, layer in enumerate(layers):
        name = f"{prefix}{layout.layers}.{n}"
        for block in layout.blocks:
            for column, groups in block.columns.items():
                swap(model, f"{name}.{block.name}.{column}", partial(ColumnParallel, ctx=ctx, groups=groups), replaced)
            swap(
                model, f"{name}.{block.name}.{block.row}", partial(RowParallel, ctx=ctx, sequence_parallel=sp), replaced
            )
            region(layer.get_submodule(block.name), ctx, sp)
        if sp:
            for norm in layout.norms:
                swap(model, f"{name}.{norm}", lambda m: SequenceParallelNorm(m, ctx=ctx), replaced)
        if layout.per_layer is not None:
            layout.per_layer(layer, ctx.size("tensor"))
    if sp:
        split_sequence_before(layers[0], ctx)
        final = swap(model, prefix + layout.final_norm, lambda m: SequenceParallelNorm(m, ctx=ctx), replaced)
        gather_sequence_after(final, ctx)
    if has_head:
        tied = replaced.get(id(model.get_submodule(layout.head).weight))  # tied to the embedding: share its split
        swap(model, layout.head, lambda m: VocabHead(m, ctx=ctx, tied=tied), replaced)
    return replaced
