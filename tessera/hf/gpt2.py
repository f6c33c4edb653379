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
from tessera.hf.decoder import Block, Layout
from tessera.hf.plans import MODES, apply_layout, cross_attention_rule, heads_rule
from tessera.hf.policy import Policy, register_policy
from tessera.hf.stages import pipeline_layers


def _heads(block: Any, size: int) -> None:
    """Each rank keeps ``n_head / P`` heads: ``c_attn``'s output is split ``split_size`` wide."""
    block.attn.split_size //= size
    block.attn.num_heads //= size


LAYOUT = Layout(
    body="transformer",
    embedding="wte",
    layers="h",
    blocks=(Block("attn", {"attn.c_attn": 3}, "attn.c_proj"), Block("mlp", {"mlp.c_fc": 1}, "mlp.c_proj")),
    norms=("ln_1", "ln_2"),
    final_norm="ln_f",
    replicated=("wpe",),
    per_layer=_heads,
)


def check(model: Any, ctx: ParallelContext) -> list[str]:
    config = model.config
    broken = heads_rule(ctx, n_head=config.n_head)
    return broken + cross_attention_rule(config)


def apply(model: Any, ctx: ParallelContext) -> dict[int, nn.Parameter]:
    return apply_layout(model, ctx, LAYOUT)


POLICY = Policy(
    name="gpt2",
    classes=("GPT2LMHeadModel", "GPT2Model"),
    modes=MODES,
    check=check,
    apply=apply,
    pipeline=lambda model: pipeline_layers(model, LAYOUT),
    notes="every tensor mode; sequence-parallel regions in 1D",
)
register_policy(POLICY)
