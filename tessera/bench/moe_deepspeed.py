"""``tessera bench moe``, the DeepSpeed-MoE side: the same GPT with each MoE block's MLP a
``deepspeed.moe.layer.MoE`` of SwiGLU (or GELU) experts, trained by a DeepSpeed engine (ZeRO
stage 0) on the process group tessera started (see :mod:`tessera.bench.moe` for how it is
measured).

The model is tessera's GPT built under the same seed and layout as tessera's side; every MoE
layer is swapped for DeepSpeed's with the same weights: its gate takes the router's weight, its
local experts this rank's block of tessera's expert weights (both spread the experts over
consecutive ranks: expert ``e`` lives on expert-parallel rank ``e // (experts / ep)``, checked
after DeepSpeed makes its groups). Routing as tessera's: top-k with the weights renormalised,
the second choice the second-largest probability (``top2_2nd_expert_sampling=False``; DeepSpeed's
default samples it with Gumbel noise), capacity ``ceil(factor * tokens * k / experts)`` with
first choices served first (``min_capacity=1``); one difference is DeepSpeed's own: when a
token's choice is dropped, it renormalises the token's weights over the choices kept (tessera
keeps them). As its users train it, the loss DeepSpeed
differentiates is the model's loss plus ``aux_loss_weight`` times its layers' ``l_aux`` (its own
load-balancing loss, from the first choices; it has no z-loss).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tessera.models.gpt import GPTConfig

StepFn = Callable[[torch.Tensor, torch.Tensor], float]


class Expert(nn.Module):
    """One expert as DeepSpeed-MoE takes it (a module it copies for each local expert):
    ``[..., d_model] -> [..., d_model]``, SwiGLU or GELU, no biases (as tessera's experts)."""

    def __init__(self, d_model: int, ff_dim: int, activation: str) -> None:
        super().__init__()
        self.w_in = nn.Linear(d_model, ff_dim, bias=False)
        self.w_gate = nn.Linear(d_model, ff_dim, bias=False) if activation == "swiglu" else None
        self.w_out = nn.Linear(ff_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.w_in(x)
        hidden = F.silu(self.w_gate(x)) * hidden if self.w_gate is not None else F.gelu(hidden)
        return self.w_out(hidden)


class DeepSpeedMoEMLP(nn.Module):
    """A block's MLP: DeepSpeed's MoE layer, whose forward returns ``(output, l_aux, counts)``;
    this keeps ``l_aux`` of the last forward for the loss and returns the output."""

    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.moe = moe
        self.l_aux: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, self.l_aux, _ = self.moe(x)
        return out


def deepspeed_moe_of(layer: Any, config: GPTConfig, ep_size: int) -> DeepSpeedMoEMLP:
    """DeepSpeed's MoE layer in place of tessera's ``layer`` (a ``tessera.nn.MoE`` holding this
    rank's experts), with its router's and local experts' weights."""
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    factor = config.moe_capacity_factor
    moe = DeepSpeedMoE(
        config.d_model,
        Expert(config.d_model, config.ff_dim, config.moe_activation),
        num_experts=config.num_experts,
        ep_size=ep_size,
        k=config.moe_top_k,
        capacity_factor=factor or 1.0,
        eval_capacity_factor=factor or 1.0,
        min_capacity=1,
        drop_tokens=factor is not None,
        top2_2nd_expert_sampling=False,
    )
    gate, experts = moe.deepspeed_moe.gate, moe.deepspeed_moe.experts.deepspeed_experts
    ours = layer.experts
    if ours.w_in.shape[0] != len(experts):
        raise RuntimeError(f"tessera holds {ours.w_in.shape[0]} experts on this rank, DeepSpeed {len(experts)}")
    with torch.no_grad():
        gate.wg.weight.copy_(layer.router.weight)
        for i, expert in enumerate(experts):
            expert.w_in.weight.copy_(ours.w_in[i].t())  # tessera: x @ w_in[e]; nn.Linear: x @ weight.T
            expert.w_out.weight.copy_(ours.w_out[i].t())
            if expert.w_gate is not None:
                expert.w_gate.weight.copy_(ours.w_gate[i].t())
    return DeepSpeedMoEMLP(moe)


def build_deepspeed_moe(
    build_model: Callable[[], nn.Module], expert_rank: int, ep_size: int, micro_batch: int, lr: float
) -> StepFn:
    """DeepSpeed's side on this rank: ``build_model()`` (tessera's GPT, as tessera's side builds
    it) with its MoE layers swapped, a DeepSpeed engine over it; returns one training step
    ``step(x, y) -> this rank's loss``. ``expert_rank``: this rank's place on tessera's expert
    axis, which DeepSpeed's expert-parallel rank must equal."""
    from tessera import nn as tnn
    from tessera.bench.zero_anchors import _deepspeed
    from tessera.models import NextTokenLoss

    deepspeed = _deepspeed()
    from deepspeed.utils import groups

    model = build_model()
    config: GPTConfig = model.config  # type: ignore[assignment]
    swapped = []
    for block in model.blocks:  # type: ignore[union-attr]
        if isinstance(block.mlp, tnn.MoE):
            block.mlp = deepspeed_moe_of(block.mlp, config, ep_size)
            swapped.append(block.mlp)
    world = torch.distributed.get_world_size()
    ds_config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch * world,
        "zero_optimization": {"stage": 0},
        "zero_allow_untested_optimizer": True,  # torch's AdamW, as on the other sides
        "gradient_clipping": 0.0,  # DeepSpeed clips to norm 1.0 unless told; the other sides do not clip
        "steps_per_print": 2**31 - 1,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    theirs = groups._get_expert_parallel_rank(f"ep_size_{ep_size}")
    if theirs != expert_rank:
        raise RuntimeError(f"DeepSpeed's expert-parallel rank {theirs} is not tessera's {expert_rank}: other experts")
    criterion = NextTokenLoss()
    aux_weight = config.moe_aux_loss_weight

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = criterion(engine(x), y)
        aux = torch.stack([layer.l_aux for layer in swapped]).sum()
        engine.backward(loss + aux_weight * aux)
        engine.step()
        return float(loss.detach())

    return step


__all__ = ["DeepSpeedMoEMLP", "Expert", "build_deepspeed_moe", "deepspeed_moe_of"]
