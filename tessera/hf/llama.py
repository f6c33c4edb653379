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
from tessera.errors import ConfigError
from tessera.hf.decoder import Block, Layout
from tessera.hf.plans import MODES, apply_layout, heads_rule
from tessera.hf.policy import Policy, register_policy
from tessera.hf.sequence import apply_sequence
from tessera.hf.stages import pipeline_layers

LAYOUT = Layout(
    body="model",
    embedding="embed_tokens",
    layers="layers",
    blocks=(
        Block("self_attn", {"self_attn.q_proj": 1, "self_attn.k_proj": 1, "self_attn.v_proj": 1}, "self_attn.o_proj"),
        Block("mlp", {"mlp.gate_proj": 1, "mlp.up_proj": 1}, "mlp.down_proj"),
    ),
    norms=("input_layernorm", "post_attention_layernorm"),
    final_norm="norm",
)


def check(model: Any, ctx: ParallelContext) -> list[str]:
    config = model.config
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return heads_rule(ctx, num_attention_heads=config.num_attention_heads, num_key_value_heads=kv)


def sequence(model: Any, ctx: ParallelContext) -> None:
    """Attend over the sequence axis; a sliding window (Mistral, Qwen2) has no sequence-parallel
    attention here, so it is refused rather than ignored."""
    config = model.config
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True):
        raise ConfigError(
            f"parallel.sequence.size={ctx.size('sequence')}: {type(model).__name__} attends within a sliding "
            f"window of {window} tokens, which tessera's sequence-parallel attention does not implement; "
            "layouts that work: sliding_window=None, or no sequence axis"
        )
    apply_sequence(model, ctx, LAYOUT)


def apply(model: Any, ctx: ParallelContext) -> dict[int, nn.Parameter]:
    return apply_layout(model, ctx, LAYOUT)


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
    modes=MODES,
    check=check,
    apply=apply,
    pipeline=lambda model: pipeline_layers(model, LAYOUT),
    sequence=sequence,
    notes="every tensor mode; sequence-parallel regions in 1D",
)
register_policy(POLICY)
