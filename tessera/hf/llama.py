"""The LLaMA policy (``LlamaForCausalLM``, ``LlamaModel`` and the models that share their layout:
Qwen2, Mistral): 1D tensor parallelism.

Per decoder layer: ``self_attn.q_proj``, ``k_proj`` and ``v_proj`` column-parallel (each rank
keeps ``num_attention_heads / P`` query heads and ``num_key_value_heads / P`` key/value heads,
so grouped-query attention keeps its ratio), ``o_proj`` row-parallel; ``mlp.gate_proj`` and
``up_proj`` column- and ``down_proj`` row-parallel. ``embed_tokens`` and ``lm_head`` are split
on the vocabulary (logits gathered; a tied head shares the embedding's split weight). The
attention reads its head count from the projections' widths (``view(..., -1, head_dim)``), so
nothing else changes. With sequence-parallel regions the layers see ``[b, s/P, h]`` between
regions: split before the first layer, gathered after the final norm; the rotary embeddings and
the mask are computed for the whole sequence before that.
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
    return (model.model, "model.") if hasattr(model, "lm_head") else (model, "")


def check(model: Any, ctx: ParallelContext) -> list[str]:
    config = model.config
    size = ctx.size("tensor")
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return divides("num_attention_heads", config.num_attention_heads, size) + divides("num_key_value_heads", kv, size)


def apply(model: Any, ctx: ParallelContext) -> dict[int, nn.Parameter]:
    body, prefix = _body(model)
    sp = ctx.dims.sequence_parallel
    replaced: dict[int, nn.Parameter] = {}
    swap(model, f"{prefix}embed_tokens", lambda m: VocabEmbedding(m, ctx=ctx), replaced)
    for n, layer in enumerate(body.layers):
        name = f"{prefix}layers.{n}"
        for proj in ("q_proj", "k_proj", "v_proj"):
            swap(model, f"{name}.self_attn.{proj}", lambda m: ColumnParallel(m, ctx=ctx), replaced)
        swap(model, f"{name}.self_attn.o_proj", lambda m: RowParallel(m, ctx=ctx, sequence_parallel=sp), replaced)
        for proj in ("gate_proj", "up_proj"):
            swap(model, f"{name}.mlp.{proj}", lambda m: ColumnParallel(m, ctx=ctx), replaced)
        swap(model, f"{name}.mlp.down_proj", lambda m: RowParallel(m, ctx=ctx, sequence_parallel=sp), replaced)
        region(layer.self_attn, ctx, sp)
        region(layer.mlp, ctx, sp)
        if sp:
            for norm in ("input_layernorm", "post_attention_layernorm"):
                swap(model, f"{name}.{norm}", lambda m: SequenceParallelNorm(m, ctx=ctx), replaced)
    if sp:
        split_sequence_before(body.layers[0], ctx)
        final = swap(model, f"{prefix}norm", lambda m: SequenceParallelNorm(m, ctx=ctx), replaced)
        gather_sequence_after(final, ctx)
    head = getattr(model, "lm_head", None)
    if head is not None:
        tied = replaced.get(id(head.weight))  # tied to the embedding: share its split weight
        swap(model, "lm_head", lambda m: VocabHead(m, ctx=ctx, tied=tied), replaced)
    return replaced


POLICY = Policy(
    name="llama",
    classes=(
        "LlamaForCausalLM",
        "LlamaModel",
        "Qwen2ForCausalLM",
        "Qwen2Model",
        "MistralForCausalLM",
        "MistralModel",
    ),
    modes=("1d",),
    check=check,
    apply=apply,
    notes="1D tensor parallelism with sequence-parallel regions; the other modes are not built yet",
)
register_policy(POLICY)
