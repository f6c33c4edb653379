"""The Evoformer block of AlphaFold 2 (Jumper et al. 2021, supplementary information, section
1.6), written from its description: the MSA representation ``m`` [B, S, R, c_m] (S sequences of R
residues) and the pair representation ``z`` [B, R, R, c_z] update each other through

    m += row attention with pair bias (m, z)      attention along residues, biased by z
    m += column attention (m)                     attention along sequences
    m += transition (m)
    z += outer product mean (m)                   the MSA's co-variation into the pairs
    z += triangle multiplication, outgoing (z)    z_ij from edges i->k and j->k
    z += triangle multiplication, incoming (z)    z_ij from edges k->i and k->j
    z += triangle attention, starting node (z)    z_ij attends over z_ik, biased by z_jk
    z += triangle attention, ending node (z)      z_ij attends over z_kj, biased by z_ki
    z += transition (z)

Every attention is gated (a sigmoid of the input scales each head's output). Dropout is left out:
the parallel tests compare exact numbers, and the trunk trains on synthetic data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class EvoformerConfig:
    """Channels of the MSA (``c_m``) and pair (``c_z``) representations, heads and channels per
    head of the MSA attentions and of the triangle attentions, hidden channels of the outer
    product mean and of the triangle multiplications, and the transitions' widening factor."""

    c_m: int = 32
    c_z: int = 16
    msa_heads: int = 4
    msa_head_dim: int = 8
    pair_heads: int = 2
    pair_head_dim: int = 8
    outer_dim: int = 8
    triangle_dim: int = 16
    transition: int = 4

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 1:
                raise ValueError(f"EvoformerConfig.{name}={value} must be at least 1")


def gated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate: torch.Tensor,
    bias: torch.Tensor | None,
    keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention over the second-last axis of ``k``/``v``, per head, gated.

    ``q`` [..., L, H, c], ``k``/``v`` [..., L', H, c], ``gate`` [..., L, H, c] (already through its
    sigmoid), ``bias`` broadcastable to [..., H, L, L'] or None; ``keys`` [L'] bool: the keys that
    exist (None: all; padding is never attended to). Returns [..., L, H, c]."""
    scores = torch.einsum("...qhc,...khc->...hqk", q, k) / math.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + bias
    if keys is not None:
        scores = scores.masked_fill(~keys, float("-inf"))
    out = torch.einsum("...hqk,...khc->...qhc", scores.softmax(dim=-1), v)
    return out * gate


class _Attention(nn.Module):
    """Layer norm, query/key/value/gate projections to ``heads`` x ``head_dim``, the output
    projection back to ``channels`` (zero at the start, as AlphaFold's final layers)."""

    def __init__(self, channels: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.norm = nn.LayerNorm(channels)
        self.qkv = nn.Linear(channels, 3 * heads * head_dim, bias=False)
        self.gate = nn.Linear(channels, heads * head_dim)
        self.out = nn.Linear(heads * head_dim, channels)
        nn.init.zeros_(self.gate.weight)
        nn.init.ones_(self.gate.bias)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The normed ``x``'s queries, keys, values and gate, each [..., H, c]."""
        shape = (*x.shape[:-1], self.heads, self.head_dim)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return q.view(shape), k.view(shape), v.view(shape), torch.sigmoid(self.gate(x)).view(shape)

    def finish(self, o: torch.Tensor) -> torch.Tensor:
        return self.out(o.flatten(-2))

    def attend(self, x: torch.Tensor, bias: torch.Tensor | None, keys: torch.Tensor | None) -> torch.Tensor:
        """Gated attention of the normed ``x`` over its second-last axis, projected back."""
        q, k, v, g = self.project(x)
        return self.finish(gated_attention(q, k, v, g, bias, keys))


def heads_first(bias: torch.Tensor) -> torch.Tensor:
    """A per-head pair bias [B, R, R, H] as attention scores take it: [B, 1, H, R, R]."""
    return bias.permute(0, 3, 1, 2).unsqueeze(1)


class MSARowAttentionWithPairBias(_Attention):
    """Each sequence's residues attend to each other, biased per head by the pair representation."""

    def __init__(self, config: EvoformerConfig) -> None:
        super().__init__(config.c_m, config.msa_heads, config.msa_head_dim)
        self.pair_norm = nn.LayerNorm(config.c_z)
        self.pair_bias = nn.Linear(config.c_z, config.msa_heads, bias=False)

    def forward(self, m: torch.Tensor, z: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.attend(self.norm(m), heads_first(self.pair_bias(self.pair_norm(z))), mask)


class MSAColumnAttention(_Attention):
    """Each residue's sequences attend to each other."""

    def __init__(self, config: EvoformerConfig) -> None:
        super().__init__(config.c_m, config.msa_heads, config.msa_head_dim)

    def forward(self, m: torch.Tensor) -> torch.Tensor:
        return self.attend(self.norm(m.transpose(-2, -3)), None, None).transpose(-2, -3)  # over [B, R, S]


class Transition(nn.Module):
    """Layer norm, a widening linear layer, ReLU, and back."""

    def __init__(self, channels: int, factor: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(channels)
        self.up = nn.Linear(channels, factor * channels)
        self.down = nn.Linear(factor * channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(self.norm(x))))


class OuterProductMean(nn.Module):
    """``z_ij += W [mean over sequences of a_si (x) b_sj]``: the MSA's co-variation of residues i
    and j, projected to the pair channels."""

    def __init__(self, config: EvoformerConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(config.c_m)
        self.a = nn.Linear(config.c_m, config.outer_dim)
        self.b = nn.Linear(config.c_m, config.outer_dim)
        self.out = nn.Linear(config.outer_dim**2, config.c_z)

    def forward(self, m: torch.Tensor) -> torch.Tensor:
        x = self.norm(m)
        a, b = self.a(x), self.b(x)  # [B, S, R, c]
        outer = torch.einsum("bsic,bsjd->bijcd", a, b) / m.shape[1]
        return self.out(outer.flatten(-2))


class TriangleMultiplication(nn.Module):
    """``outgoing``: z_ij from the edges i->k and j->k (sum over k of a_ik * b_jk); otherwise
    incoming: from k->i and k->j (sum over k of a_ki * b_kj). Gated, normed, projected."""

    def __init__(self, config: EvoformerConfig, outgoing: bool) -> None:
        super().__init__()
        c, d = config.c_z, config.triangle_dim
        self.outgoing = outgoing
        self.norm = nn.LayerNorm(c)
        self.a, self.a_gate = nn.Linear(c, d), nn.Linear(c, d)
        self.b, self.b_gate = nn.Linear(c, d), nn.Linear(c, d)
        self.out_norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, c)
        self.gate = nn.Linear(c, c)

    def factors(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gated factors ``a`` and ``b`` of the normed pairs ``x``."""
        return torch.sigmoid(self.a_gate(x)) * self.a(x), torch.sigmoid(self.b_gate(x)) * self.b(x)

    def product(self, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The sum over the third residue k (none through a padded one: ``mask``)."""
        if mask is not None:
            keep = (mask[None, :, None] if self.outgoing else mask[:, None, None]).to(a.dtype)
            a, b = a * keep, b * keep
        if self.outgoing:
            return torch.einsum("bikc,bjkc->bijc", a, b)
        return torch.einsum("bkic,bkjc->bijc", a, b)

    def finish(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(x)) * self.out(self.out_norm(t))

    def forward(self, z: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.norm(z)
        a, b = self.factors(x)
        return self.finish(x, self.product(a, b, mask))


class TriangleAttention(_Attention):
    """``starting``: z_ij attends over z_ik (k along the row of i), biased by z_jk; otherwise
    ending: z_ij attends over z_kj (along the column of j), biased by z_ki (the starting node's
    computation on the transposed pair representation)."""

    def __init__(self, config: EvoformerConfig, starting: bool) -> None:
        super().__init__(config.c_z, config.pair_heads, config.pair_head_dim)
        self.starting = starting
        self.bias = nn.Linear(config.c_z, config.pair_heads, bias=False)

    def forward(self, z: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if not self.starting:
            z = z.transpose(1, 2)
        x = self.norm(z)
        out = self.attend(x, heads_first(self.bias(x)), mask)  # b_jk for every row i
        return out if self.starting else out.transpose(1, 2)


class EvoformerBlock(nn.Module):
    """One Evoformer block: ``forward(m, z) -> (m, z)`` (module docstring)."""

    def __init__(self, config: EvoformerConfig) -> None:
        super().__init__()
        self.config = config
        self.row_attention = MSARowAttentionWithPairBias(config)
        self.column_attention = MSAColumnAttention(config)
        self.msa_transition = Transition(config.c_m, config.transition)
        self.outer_product_mean = OuterProductMean(config)
        self.triangle_out = TriangleMultiplication(config, outgoing=True)
        self.triangle_in = TriangleMultiplication(config, outgoing=False)
        self.triangle_start = TriangleAttention(config, starting=True)
        self.triangle_end = TriangleAttention(config, starting=False)
        self.pair_transition = Transition(config.c_z, config.transition)

    def forward(
        self, m: torch.Tensor, z: torch.Tensor, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``mask`` [R] bool: the residues that exist (None: all); padded ones never reach the others."""
        m = m + self.row_attention(m, z, mask)
        m = m + self.column_attention(m)
        m = m + self.msa_transition(m)
        z = z + self.outer_product_mean(m)
        z = z + self.triangle_out(z, mask)
        z = z + self.triangle_in(z, mask)
        z = z + self.triangle_start(z, mask)
        z = z + self.triangle_end(z, mask)
        z = z + self.pair_transition(z)
        return m, z


__all__ = [
    "EvoformerBlock",
    "EvoformerConfig",
    "MSAColumnAttention",
    "MSARowAttentionWithPairBias",
    "OuterProductMean",
    "Transition",
    "TriangleAttention",
    "TriangleMultiplication",
    "gated_attention",
    "heads_first",
]
