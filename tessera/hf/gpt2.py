"""The GPT-2 policy (``GPT2LMHeadModel``, ``GPT2Model``): 1D tensor parallelism.

Per block: ``attn.c_attn`` (``Conv1D``, q, k and v fused) column-parallel with its three parts
split on their own, ``attn.c_proj`` row-parallel, ``mlp.c_fc`` column- and ``mlp.c_proj``
row-parallel; each rank keeps ``n_head / P`` heads (``attn.split_size`` and ``attn.num_heads``
follow). ``wte`` is split on the vocabulary and so is the tied ``lm_head`` (logits gathered);
``wpe`` and the LayerNorms stay whole. With sequence-parallel regions the blocks see
``[b, s/P, h]`` between regions: split before the first block, gathered after ``ln_f``.
"""

from __future__ import annotations

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
from tessera.hf.policy import Policy, divides, register_policy, swap


def _body(model: Any) -> tuple[Any, str]:
    """The ``GPT2Model`` inside ``model`` and its name prefix."""
    return (model.transformer, "transformer.") if hasattr(model, "transformer") else (model, "")


def check(model: Any, ctx: ParallelContext) -> list[str]:
    config = model.config
    broken = divides("n_head", config.n_head, ctx.size("tensor"))
    if getattr(config, "add_cross_attention", False):
        broken.append("cross-attention (add_cross_attention=True) has no tensor-parallel policy")
    return broken


def apply(model: Any, ctx: ParallelContext) -> dict[int, nn.Parameter]:
    body, prefix = _body(model)
    size = ctx.size("tensor")
    sp = ctx.dims.sequence_parallel
    replaced: dict[int, nn.Parameter] = {}
    swap(model, f"{prefix}wte", lambda m: VocabEmbedding(m, ctx=ctx), replaced)
    for n, block in enumerate(body.h):
        name = f"{prefix}h.{n}"
        attn = block.attn
        swap(model, f"{name}.attn.c_attn", lambda m: ColumnParallel(m, ctx=ctx, groups=3), replaced)
        swap(model, f"{name}.attn.c_proj", lambda m: RowParallel(m, ctx=ctx, sequence_parallel=sp), replaced)
        attn.split_size //= size
        attn.num_heads //= size
        swap(model, f"{name}.mlp.c_fc", lambda m: ColumnParallel(m, ctx=ctx), replaced)
        swap(model, f"{name}.mlp.c_proj", lambda m: RowParallel(m, ctx=ctx, sequence_parallel=sp), replaced)
        region(block.attn, ctx, sp)
        region(block.mlp, ctx, sp)
        if sp:
            for norm in ("ln_1", "ln_2"):
                swap(model, f"{name}.{norm}", lambda m: SequenceParallelNorm(m, ctx=ctx), replaced)
    if sp:
        split_sequence_before(body.h[0], ctx)
        ln_f = swap(model, f"{prefix}ln_f", lambda m: SequenceParallelNorm(m, ctx=ctx), replaced)
        gather_sequence_after(ln_f, ctx)
    head = getattr(model, "lm_head", None)
    if head is not None:
        tied = replaced.get(id(head.weight))  # the head shares the embedding's weight: keep sharing it
        swap(model, "lm_head", lambda m: VocabHead(m, ctx=ctx, tied=tied), replaced)
    return replaced


POLICY = Policy(
    name="gpt2",
    classes=("GPT2LMHeadModel", "GPT2Model"),
    modes=("1d",),
    check=check,
    apply=apply,
    notes="1D tensor parallelism with sequence-parallel regions; the other modes are not built yet",
)
register_policy(POLICY)
