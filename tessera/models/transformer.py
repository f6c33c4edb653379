"""The pre-norm transformer block shared by the GPT and the ViT, written once with ``tessera.nn``
so that it runs in every tensor-parallel mode (plain torch layers when there is none)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
from torch import nn

from tessera import nn as tnn
from tessera.context.placement import placement_of
from tessera.parallel.tensor.common import local_shard

#: ``attend(q, k, v) -> y`` over ``[b, heads, s, head_dim]``: attention that replaces the
#: block's own (``tessera.inference`` reads and writes its KV cache in one)
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class SelfAttention(nn.Module):
    """Multi-head self-attention over this rank's heads: ``[b, s, h]`` in the mode's layout."""

    def __init__(
        self, d_model: int, n_heads: int, dropout: float, causal: bool, attention_dropout: float | None = None
    ) -> None:
        super().__init__()
        parts = tnn.hidden_parts()
        if n_heads % parts:
            raise ValueError(f"{n_heads} attention heads cannot be split into the {parts} hidden blocks of the layout")
        self.head_dim = d_model // n_heads
        self.dropout = dropout if attention_dropout is None else attention_dropout  # on the attention weights
        self.causal = causal
        self.qkv = tnn.Linear(d_model, 3 * d_model, out_groups=3)
        self.out = tnn.Linear(d_model, d_model, input_is_parallel=True)
        self.out_dropout = tnn.Dropout(dropout)

    def forward(self, x: torch.Tensor, attend: Attend | None = None) -> torch.Tensor:
        """``attend(q, k, v) -> y`` (each ``[b, heads, s, head_dim]``) replaces the attention
        over ``x``'s own tokens (generation passes one that reads a KV cache)."""
        qkv = self.qkv(x)  # [b, s, 3 * local heads * head_dim] (this rank's tokens of the sequence axis)
        batch, seq = qkv.shape[0], qkv.shape[1]
        q, k, v = qkv.chunk(3, dim=-1)
        heads = q.shape[-1] // self.head_dim
        q, k, v = (t.reshape(batch, seq, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if attend is not None:
            y = attend(q, k, v)
        else:
            p = self.dropout if self.training else 0.0
            # attention dropout on this rank's heads, from the tensor rank's own stream (without
            # dropout no stream is switched: a compiled block then has no graph break here)
            with tnn.split_region_rng() if p > 0 else contextlib.nullcontext():
                y = tnn.attention(q, k, v, dropout_p=p, causal=self.causal)
        return self.out_dropout(self.out(y.transpose(1, 2).reshape(batch, seq, heads * self.head_dim)))


class MLP(nn.Module):
    def __init__(self, d_model: int, ff_dim: int, dropout: float) -> None:
        super().__init__()
        self.fc = tnn.Linear(d_model, ff_dim)
        self.act = nn.GELU()
        self.proj = tnn.Linear(ff_dim, d_model, input_is_parallel=True)
        self.dropout = tnn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.act(self.fc(x))))


@tnn.mark_block  # what activation checkpointing recomputes
class Block(nn.Module):
    """``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))`` (``mlp``: another MLP, such as an MoE,
    in place of the dense one)."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        ff_dim: int,
        dropout: float,
        eps: float,
        causal: bool,
        attention_dropout: float | None = None,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.ln_1 = tnn.LayerNorm(d_model, eps=eps)
        self.attn = SelfAttention(d_model, n_heads, dropout, causal, attention_dropout)
        self.ln_2 = tnn.LayerNorm(d_model, eps=eps)
        self.mlp = mlp if mlp is not None else MLP(d_model, ff_dim, dropout)

    def forward(self, x: torch.Tensor, attend: Attend | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attend)
        return x + self.mlp(self.ln_2(x))


class StagePart(nn.Module):
    """A piece of a model outside its block list (embeddings, head) as a layer of its own, for
    cutting the model into pipeline stages: it holds the model's submodules it uses (so its
    parameters are theirs) and runs the model's own code for that piece."""

    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor], **modules: nn.Module) -> None:
        super().__init__()
        for name, module in modules.items():
            self.add_module(name, module)
        self._forward = forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """Single-process shape of a parameter (a sharded one reports its full shape)."""
    return placement_of(param).full_shape(param)


def reset_in_full(module: nn.Module, rule: Callable[[str, tuple[int, ...]], torch.Tensor]) -> None:
    """Give every parameter the full value ``rule(name, full_shape)`` draws, in parameter order,
    keeping this rank's block of it: the same values in every layout (every rank draws the
    same seeded stream), one full tensor at a time. A tied parameter is drawn once, under its
    first name."""
    drawn: set[int] = set()
    with torch.no_grad():
        for name, param in module.named_parameters(remove_duplicate=False):
            if id(param) in drawn:
                continue
            drawn.add(id(param))
            full = rule(name, full_shape(param))
            placement = placement_of(param)
            if placement.shard is not None:
                assert placement.mesh is not None
                full = local_shard(full.to(param.dtype), placement.shard, placement.mesh)
            param.copy_(full)


def gpt2_init(name: str, n_layers: int) -> float | str:
    """How GPT-2 initialises the parameter ``name``: ``"ones"`` (LayerNorm scales), ``"zeros"``
    (biases), or the standard deviation of its normal draw (0.02; residual projections, the
    experts' output weights among them, scaled by 1/sqrt(2 n_layers))."""
    leaf = name.rsplit(".", 1)[-1]
    owner = name.rsplit(".", 2)[-2] if name.count(".") else ""
    if owner.startswith("ln") or owner == "norm":
        return "ones" if leaf == "weight" else "zeros"
    if leaf == "bias":
        return "zeros"
    residual = ("attn.out.weight", "mlp.proj.weight", "mlp.experts.w_out")
    return 0.02 / math.sqrt(2 * n_layers) if name.endswith(residual) else 0.02


def gpt2_rule(n_layers: int) -> Callable[[str, tuple[int, ...]], torch.Tensor]:
    """GPT-2 initialisation by parameter name (:func:`gpt2_init`), as full tensors."""

    def rule(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        how = gpt2_init(name, n_layers)
        if how == "ones":
            return torch.ones(shape)
        if how == "zeros":
            return torch.zeros(shape)
        assert isinstance(how, float)
        return torch.randn(shape).mul_(how)  # in place: one full tensor at a time

    return rule
