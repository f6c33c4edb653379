"""Chunked inference of an Evoformer block (FastFold's and OpenFold's chunking): each attention,
transition and pair update runs on slices of one axis at a time, so that its temporaries (the
attention scores above all: ``heads x R x R`` for every row of the pairs) exist for ``chunk`` rows
at once instead of all of them. The result is the block's, up to the order of floating-point sums.

    row attention           chunks of sequences (the pair bias computed once)
    column attention        chunks of residues
    transitions             chunks of sequences / rows
    outer product mean      chunks of rows i (the second factor whole)
    triangle multiplication chunks of rows i (both factors whole)
    triangle attention      chunks of rows i (the bias computed once; the ending node on the
                            transposed pairs)

:func:`chunk_for` picks the largest chunk whose temporaries fit a byte budget.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from tessera.models.evoformer.block import (
    EvoformerBlock,
    EvoformerConfig,
    TriangleAttention,
    TriangleMultiplication,
    heads_first,
)


def _slices(length: int, chunk: int) -> Iterator[slice]:
    for start in range(0, length, chunk):
        yield slice(start, min(start + chunk, length))


def _by(dim: int, length: int, chunk: int, fn: Callable[[slice], torch.Tensor]) -> torch.Tensor:
    return torch.cat([fn(part) for part in _slices(length, chunk)], dim=dim)


def _take(x: torch.Tensor, dim: int, part: slice) -> torch.Tensor:
    return x.narrow(dim, part.start, part.stop - part.start)


def _triangle_multiplication(
    mod: TriangleMultiplication, z: torch.Tensor, chunk: int, mask: torch.Tensor | None
) -> torch.Tensor:
    x = mod.norm(z)
    a, b = mod.factors(x)

    def rows(part: slice) -> torch.Tensor:
        t = mod.product(_take(a, 1, part) if mod.outgoing else _take(a, 2, part), b, mask)
        return mod.finish(_take(x, 1, part), t)

    return _by(1, z.shape[1], chunk, rows)


def _triangle_attention(mod: TriangleAttention, z: torch.Tensor, chunk: int, mask: torch.Tensor | None) -> torch.Tensor:
    if not mod.starting:
        z = z.transpose(1, 2)
    x = mod.norm(z)
    bias = heads_first(mod.bias(x))
    out = _by(1, z.shape[1], chunk, lambda part: mod.attend(_take(x, 1, part), bias, mask))
    return out if mod.starting else out.transpose(1, 2)


@torch.no_grad()
def chunked_block(
    block: EvoformerBlock, m: torch.Tensor, z: torch.Tensor, chunk: int, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``block(m, z, mask)`` for inference, ``chunk`` rows (sequences, residues) at a time."""
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be at least 1")
    s, r = m.shape[1], m.shape[2]
    row = block.row_attention
    bias = heads_first(row.pair_bias(row.pair_norm(z)))
    m = m + _by(1, s, chunk, lambda part: row.attend(row.norm(_take(m, 1, part)), bias, mask))
    m = m + _by(2, r, chunk, lambda part: block.column_attention(_take(m, 2, part)))
    m = m + _by(1, s, chunk, lambda part: block.msa_transition(_take(m, 1, part)))
    outer = block.outer_product_mean
    x = outer.norm(m)
    a, b = outer.a(x), outer.b(x)
    z = z + _by(
        1, r, chunk, lambda part: outer.out((torch.einsum("bsic,bsjd->bijcd", _take(a, 2, part), b) / s).flatten(-2))
    )
    z = z + _triangle_multiplication(block.triangle_out, z, chunk, mask)
    z = z + _triangle_multiplication(block.triangle_in, z, chunk, mask)
    z = z + _triangle_attention(block.triangle_start, z, chunk, mask)
    z = z + _triangle_attention(block.triangle_end, z, chunk, mask)
    z = z + _by(1, r, chunk, lambda part: block.pair_transition(_take(z, 1, part)))
    return m, z


def row_bytes(config: EvoformerConfig, batch: int, sequences: int, residues: int, element: int = 4) -> int:
    """The largest temporary one chunk row costs (bytes): a pair row's triangle-attention scores,
    a sequence's row-attention scores, a residue's column-attention scores, a row's outer products
    or triangle products, whichever is largest."""
    r, s, c = residues, sequences, config
    per_row = max(
        c.pair_heads * r * r,  # triangle attention: heads x R x R scores for one row i
        c.msa_heads * r * r,  # row attention: one sequence
        c.msa_heads * s * s,  # column attention: one residue
        r * c.outer_dim**2,  # outer product mean: one row's outer products
        r * c.triangle_dim + r * c.transition * c.c_z,  # a triangle product row, a transition row
    )
    return element * batch * per_row


def chunk_for(config: EvoformerConfig, batch: int, sequences: int, residues: int, budget: int, element: int = 4) -> int:
    """The largest chunk whose temporaries fit in ``budget`` bytes (at least 1: below that, the
    budget cannot hold one row, and the caller learns so from :func:`row_bytes`)."""
    if budget < 1:
        raise ValueError(f"a chunk budget of {budget} bytes must be positive")
    return max(1, budget // row_bytes(config, batch, sequences, residues, element))


__all__ = ["chunk_for", "chunked_block", "row_bytes"]
