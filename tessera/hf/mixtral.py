"""The Mixtral policy (``MixtralForCausalLM``, ``MixtralModel``): expert parallelism and 1D
tensor parallelism.

Each decoder layer's ``mlp`` (a sparse mixture-of-experts block: the router ``gate`` and the
experts' fused weights ``experts.gate_up_proj`` ``[experts, 2 x ff, d]`` and ``experts.down_proj``
``[experts, d, ff]``) becomes a :class:`SparseMoeBlock` that keeps the router and the weights'
names: the experts are spread over the ``expert`` axis (``num_local_experts / size`` per rank)
and, with tensor parallelism, each expert's width over the tensor axis (the gate and up halves
each split, the down projection on its input). Tokens go through ``tessera.nn.moe.dispatch``
(grouped products, all-to-all over the expert axis); Mixtral drops no token, and its router
(kept as it is, so ``output_router_logits`` still reports it) picks and weighs the experts. The
attention is split as LLaMA's (``q/k/v_proj`` column-, ``o_proj`` row-parallel).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera import comm
from tessera.context import ParallelContext
from tessera.context.placement import ShardSpec
from tessera.hf.decoder import Block, Layout
from tessera.hf.plans import heads_rule
from tessera.hf.policy import Policy, register_policy
from tessera.hf.stages import pipeline_layers
from tessera.nn.moe import dispatch, expert_groups
from tessera.parallel.tensor.common import shard_parameter

LAYOUT = Layout(
    body="model",
    embedding="embed_tokens",
    layers="layers",
    blocks=(
        Block("self_attn", {"self_attn.q_proj": 1, "self_attn.k_proj": 1, "self_attn.v_proj": 1}, "self_attn.o_proj"),
    ),
    norms=("input_layernorm", "post_attention_layernorm"),
    final_norm="norm",
)


class SpreadExperts(nn.Module):
    """Mixtral's experts (``gate_up_proj``, ``down_proj``), this rank's experts and block of each
    one's width: ``[local experts, slots, d] -> [local experts, slots, d]``."""

    def __init__(self, module: Any, ctx: ParallelContext) -> None:
        super().__init__()
        experts, two_ff, d = module.gate_up_proj.shape
        spread, self.tensor = expert_groups(ctx)
        e_axis = ("expert",) if spread is not None else ()
        t_axis = ("tensor",) if self.tensor is not None else ()
        self.act_fn = module.act_fn
        self.gate_up_proj = shard_parameter(module.gate_up_proj, ShardSpec((experts, two_ff, d), (e_axis, t_axis, ()), (1, 2, 1)), ctx)  # fmt: skip
        self.down_proj = shard_parameter(module.down_proj, ShardSpec((experts, d, two_ff // 2), (e_axis, (), t_axis)), ctx)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tensor is not None:  # every tensor rank has the tokens; each computes its block of the width
            x = comm.copy_forward_all_reduce_backward(x, self.tensor)
        gate, up = torch.bmm(x, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
        out = torch.bmm(self.act_fn(gate) * up, self.down_proj.transpose(1, 2))
        if self.tensor is not None:
            out = comm.all_reduce_forward_copy_backward(out, self.tensor)
        return out


class SparseMoeBlock(nn.Module):
    """Mixtral's ``mlp`` with its experts spread (module docstring): the router ``gate`` is the
    model's own module."""

    def __init__(self, module: Any, ctx: ParallelContext) -> None:
        super().__init__()
        self.gate = module.gate
        self.experts = SpreadExperts(module.experts, ctx)
        self.num_experts = int(module.gate.num_experts)
        self.jitter_noise = float(getattr(module, "jitter_noise", 0.0) or 0.0)
        self.group, _ = expert_groups(ctx)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            noise = torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
            hidden_states = hidden_states * noise
        tokens = hidden_states.reshape(-1, shape[-1])
        _, weights, experts = self.gate(tokens)
        y, _, _, _ = dispatch(tokens, weights, experts, self.num_experts, None, self.experts, self.group)
        return y.view(shape)


def spread_experts(model: Any, ctx: ParallelContext) -> dict[int, nn.Parameter]:
    """Replace every decoder layer's MoE block by a :class:`SparseMoeBlock` for ``ctx``; the
    replaced parameters, old id -> new parameter."""
    body = model.get_submodule(LAYOUT.body) if hasattr(model, "lm_head") else model
    replaced: dict[int, nn.Parameter] = {}
    for layer in body.get_submodule(LAYOUT.layers):
        old = layer.mlp
        new = SparseMoeBlock(old, ctx)
        replaced[id(old.experts.gate_up_proj)] = new.experts.gate_up_proj
        replaced[id(old.experts.down_proj)] = new.experts.down_proj
        layer.mlp = new
    return replaced


def check(model: Any, ctx: ParallelContext) -> list[str]:
    config = model.config
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    broken = heads_rule(ctx, num_attention_heads=config.num_attention_heads, num_key_value_heads=kv)
    if config.num_local_experts % ctx.size("expert"):
        broken.append(f"num_local_experts ({config.num_local_experts}) must be divisible by the expert size")
    if config.intermediate_size % ctx.size("tensor"):
        broken.append(f"intermediate_size ({config.intermediate_size}) must be divisible by the tensor size")
    return broken


def apply(model: Any, ctx: ParallelContext) -> dict[int, nn.Parameter]:
    from tessera.hf.plans import apply_layout

    replaced = apply_layout(model, ctx, LAYOUT)
    replaced.update(spread_experts(model, ctx))
    return replaced


POLICY = Policy(
    name="mixtral",
    classes=("MixtralForCausalLM", "MixtralModel"),
    modes=("1d",),
    check=check,
    apply=apply,
    pipeline=lambda model: pipeline_layers(model, LAYOUT),
    experts=spread_experts,
    sequence_parallel=False,
    notes="expert parallelism and 1d tensor parallelism (inside each expert too), pipeline stages",
)
register_policy(POLICY)
