"""2.5D (Tesseract) tensor parallelism: ``depth`` stacked q x q SUMMA grids.

Rank ``(k, i, j)`` (tensor index ``k*q*q + i*q + j``): ``k = ctx.local_rank("2.5d_dep")`` is its
grid, ``i = ctx.local_rank("2.5d_col")`` its row and ``j = ctx.local_rank("2.5d_row")`` its
column in that grid.

Layout. An activation ``[b, (s,) h]`` is held as ``[b/(d*q) (block k*q + i), (s,) h/q (block j)]``:
the batch is split over the grids and their rows, the hidden dimension over the columns (padded
as in 2D). Each grid runs 2D SUMMA (:mod:`tessera.parallel.tensor.tp2d`, built on
:mod:`tessera.parallel.tensor.summa`) on its own batch rows, with the same parameters: every
parameter is split within a grid exactly as in 2D (``2.5d_row`` for ``2d_row``, ``2.5d_col`` for
``2d_col``) and replicated across ``2.5d_dep``. Each grid computes its batch's share of every
gradient, so parameter gradients are all-reduced over ``2.5d_dep`` in backward.

The layers (``layers.py``) are the 2D ones with the 2.5D grid (``grid_of``); only their grid
differs. This module holds the grid and the activation helpers.

Linear cost: the 2D costs (``tp2d/functional.py``, per SUMMA form and ``keep_blocks``) with
``X`` this rank's input block ``[b/(d*q) * s, in/q]`` and ``Y`` its output block
``[b/(d*q) * s, out/q]``, plus the all-reduce of the parameter gradients over ``2.5d_dep``.
In form "ab" (the output stays; "abt" has ``Y`` for ``X``), forward and backward move per rank

* ``2.5d_row``: broadcast ``2 (q-1) |X|``, reduce ``(q-1) |X|``;
* ``2.5d_col``: broadcast ``2 (q-1) |W|``, reduce ``(q-1) |W|``, all-reduce ``2 (q-1)/q |bias|``;
* ``2.5d_dep``: all-reduce ``2 (d-1)/d (|W| + |bias|)`` (the parameter gradients),

in all ``3 (q-1) (|X| + |W|) + 2 (q-1)/q |bias| + 2 (d-1)/d (|W| + |bias|)``: the activation terms
shrink by ``d`` against 2D on the same ``q``, at the price of the depth all-reduce.
"""

from __future__ import annotations

from typing import Any

import torch

from tessera.context import ParallelContext
from tessera.parallel.tensor import summa
from tessera.parallel.tensor.grid import SummaGrid

__all__ = ["batch_parts", "gather_activation", "grid_2p5d", "hidden_parts", "split_activation"]


def grid_2p5d(ctx: ParallelContext) -> SummaGrid:
    """The ``depth`` q x q grids of a context in tensor mode ``2.5d``."""
    return SummaGrid.from_context(ctx, row="2.5d_row", col="2.5d_col", dep="2.5d_dep")


def split_activation(x_full: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Full ``[B, (S,) H]`` -> this rank's ``[B/(dq) (block k*q + i), (S,) H/q (block j)]``,
    zero-padded; backward all-gathers the gradient."""
    return summa.split_activation(x_full, grid_2p5d(ctx))


def gather_activation(x_local: torch.Tensor, ctx: ParallelContext, full_shape: Any = None) -> torch.Tensor:
    """Every rank's block -> the full activation on every rank; ``full_shape`` drops the padding."""
    return summa.gather_activation(x_local, grid_2p5d(ctx), full_shape)


def hidden_parts(ctx: ParallelContext) -> int:
    """Into how many blocks the hidden dimension is split: q."""
    return grid_2p5d(ctx).q


def batch_parts(ctx: ParallelContext) -> int:
    """Into how many blocks the batch is split: depth * q."""
    return grid_2p5d(ctx).batch_parts
