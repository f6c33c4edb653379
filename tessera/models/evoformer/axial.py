"""Dynamic axial parallelism (DAP, as in FastFold) for one Evoformer block: the block's own
parameters, its inputs and outputs split over the ranks of ``group``.

Layouts (n ranks): the MSA representation ``m`` [B, S, R, c_m] split along sequences (``S/n``
each) between blocks; the pair representation ``z`` [B, R, R, c_z] split along rows (``R/n`` rows
``i`` each). Inside the block:

- row attention with pair bias runs on the rows' split MSA (every residue of the local sequences);
  its bias, a projection of ``z`` to the heads, is gathered whole;
- the MSA switches to a split along residues (all-to-all) for column attention, the transition and
  the outer product mean, whose second factor is gathered along residues; then back (all-to-all);
- the outgoing triangle multiplication gathers its second factor along rows; the incoming one
  switches its first factor to a split along columns (all-to-all) and gathers the second;
- triangle attention around the starting node gathers its bias; around the ending node the pair
  representation switches to a split along columns (all-to-all), is attended as transposed, and
  switches back.

Every exchange is differentiable (tessera.comm.autograd). The parameters are the same on every
rank, and each rank's gradients are its share: the caller sums them over ``group``. ``R`` must
divide by the group's size (:func:`pad_residues` pads it, and the mask keeps the padding out of
every sum and attention), and each rank holds as many sequences.
"""

from __future__ import annotations

from fractions import Fraction

import torch
from torch import nn

from tessera.comm import AxisGroup
from tessera.comm.autograd import all_gather_forward_reduce_scatter_backward as gather
from tessera.comm.autograd import all_to_all_forward_all_to_all_backward as switch
from tessera.models.evoformer.block import (
    EvoformerBlock,
    EvoformerConfig,
    TriangleAttention,
    TriangleMultiplication,
    heads_first,
)


def _row_attention(
    block: EvoformerBlock, m: torch.Tensor, z: torch.Tensor, group: AxisGroup, mask: torch.Tensor | None
) -> torch.Tensor:
    mod = block.row_attention
    bias = gather(mod.pair_bias(mod.pair_norm(z)), group, 1)  # [B, R, R, H]
    return mod.attend(mod.norm(m), heads_first(bias), mask)


def _outer_product_mean(block: EvoformerBlock, m_cols: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """The rows i of z from the MSA split along residues (its residues are the rows i)."""
    mod = block.outer_product_mean
    x = mod.norm(m_cols)
    a, b = mod.a(x), gather(mod.b(x), group, 2)  # [B, S, R/n, c], [B, S, R, c]
    outer = torch.einsum("bsic,bsjd->bijcd", a, b) / m_cols.shape[1]
    return mod.out(outer.flatten(-2))


def _triangle_multiplication(
    mod: TriangleMultiplication, z: torch.Tensor, group: AxisGroup, mask: torch.Tensor | None
) -> torch.Tensor:
    x = mod.norm(z)
    a, b = mod.factors(x)  # rows i local
    b = gather(b, group, 1)  # every row
    if not mod.outgoing:
        a = switch(a, group, 2, 1)  # a_ki for the local i: a split along columns
    return mod.finish(x, mod.product(a, b, mask))


def _triangle_attention(
    mod: TriangleAttention, z: torch.Tensor, group: AxisGroup, mask: torch.Tensor | None
) -> torch.Tensor:
    if not mod.starting:  # the columns j local, as rows of the transposed pairs
        z = switch(z, group, 2, 1).transpose(1, 2)
    x = mod.norm(z)
    out = mod.attend(x, heads_first(gather(mod.bias(x), group, 1)), mask)  # b_jk for every j
    return out if mod.starting else switch(out.transpose(1, 2), group, 1, 2)


def axial_block(
    block: EvoformerBlock, m: torch.Tensor, z: torch.Tensor, group: AxisGroup, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``block`` over ``group`` (module docstring): ``m`` this rank's sequences [B, S/n, R, c_m],
    ``z`` its rows [B, R/n, R, c_z]; returns both in the same layouts. ``mask`` [R] bool: the
    residues that exist, the others padding (R rounded up to a multiple of n: :func:`pad_residues`)."""
    n = group.size
    if m.shape[2] % n or z.shape[1] * n != z.shape[2] or z.shape[2] != m.shape[2]:
        raise ValueError(
            f"dynamic axial parallelism over {n} ranks: the local MSA [B, S/n, R, c] needs R dividing by {n} and "
            f"the local pairs [B, R/n, R, c] a 1/{n} share of the R rows; got {tuple(m.shape)}, {tuple(z.shape)}"
        )
    m = m + _row_attention(block, m, z, group, mask)
    cols = switch(m, group, 2, 1)  # [B, S, R/n, c]: every sequence of the local residues
    cols = cols + block.column_attention(cols)
    cols = cols + block.msa_transition(cols)
    z = z + _outer_product_mean(block, cols, group)
    m = switch(cols, group, 1, 2)
    z = z + _triangle_multiplication(block.triangle_out, z, group, mask)
    z = z + _triangle_multiplication(block.triangle_in, z, group, mask)
    z = z + _triangle_attention(block.triangle_start, z, group, mask)
    z = z + _triangle_attention(block.triangle_end, z, group, mask)
    z = z + block.pair_transition(z)
    return m, z


def pad_residues(m: torch.Tensor, z: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Whole ``m`` [B, S, R, c_m] and ``z`` [B, R, R, c_z] with R padded (zeros) to a multiple of
    ``size``, and the mask of the real residues (None: nothing padded)."""
    residues = m.shape[2]
    extra = -residues % size
    if extra == 0:
        return m, z, None
    m = torch.nn.functional.pad(m, (0, 0, 0, extra))
    z = torch.nn.functional.pad(z, (0, 0, 0, extra, 0, extra))
    return m, z, torch.arange(residues + extra, device=m.device) < residues


def block_bytes(
    config: EvoformerConfig, batch: int, sequences: int, residues: int, size: int, element: int = 4
) -> dict[str, Fraction]:
    """The comm ledger's logical bytes per rank of one block's forward under DAP over ``size``
    ranks, by op (docs/protein.md has the table): ``residues`` padded to a multiple of ``size``,
    ``element`` bytes per value. The backward moves the same bytes, its gathers as reduce-scatters."""
    r = residues + (-residues % size)
    f = Fraction(size - 1, size)
    c = config
    gathered = (
        batch * r * r * (c.msa_heads + 2 * c.triangle_dim + 2 * c.pair_heads) + batch * sequences * r * c.outer_dim
    )
    switched = Fraction(2 * batch * sequences * r * c.c_m + batch * r * r * (c.triangle_dim + 2 * c.c_z), size)
    return {"all_gather": f * element * gathered, "all_to_all": f * element * switched}


class AxialEvoformerBlock(nn.Module):
    """An :class:`EvoformerBlock` run with dynamic axial parallelism over ``group``."""

    def __init__(self, block: EvoformerBlock, group: AxisGroup) -> None:
        super().__init__()
        self.block, self.group = block, group

    def forward(
        self, m: torch.Tensor, z: torch.Tensor, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return axial_block(self.block, m, z, self.group, mask)


__all__ = ["AxialEvoformerBlock", "axial_block", "block_bytes", "pad_residues"]
