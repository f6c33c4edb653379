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

The layers are the 2D ones with the 2.5D grid (``grid_of``); only their grid differs.

Linear cost: with ``X`` this rank's input block ``[b/(d*q) * s, in/q]`` and ``W`` its weight
block ``[out/q, in/q]``, forward and backward move per rank

* ``2.5d_row``: broadcast ``2 (q-1) |X|``, reduce ``(q-1) |X|``;
* ``2.5d_col``: broadcast ``2 (q-1) |W|``, reduce ``(q-1) |W|``, all-reduce ``2 (q-1)/q |bias|``;
* ``2.5d_dep``: all-reduce ``2 (d-1)/d (|W| + |bias|)`` (the parameter gradients),

in all ``3 (q-1) (|X| + |W|) + 2 (q-1)/q |bias| + 2 (d-1)/d (|W| + |bias|)``: the activation terms
shrink by ``d`` against 2D on the same ``q``, at the price of the depth all-reduce.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from tessera.context import ParallelContext, get_context
from tessera.parallel.tensor import summa, tp2d
from tessera.parallel.tensor.summa import SummaGrid

__all__ = [
    "Classifier2p5D",
    "CrossEntropyLoss2p5D",
    "Dropout2p5D",
    "Embedding2p5D",
    "LayerNorm2p5D",
    "Linear2p5D",
    "PatchEmbedding2p5D",
    "VocabParallelClassifier2p5D",
    "VocabParallelCrossEntropyLoss2p5D",
    "VocabParallelEmbedding2p5D",
    "batch_parts",
    "gather_activation",
    "grid_2p5d",
    "hidden_parts",
    "split_activation",
]


def grid_2p5d(ctx: ParallelContext) -> SummaGrid:
    """The ``depth`` q x q grids of a context in tensor mode ``2.5d``."""
    if ctx.dims.tensor_mode != "2.5d":
        raise ValueError(
            f"2.5D tensor-parallel layers need tensor mode '2.5d'; the context has {ctx.dims.tensor_mode!r}"
        )
    return SummaGrid.from_context(ctx, row="2.5d_row", col="2.5d_col", dep="2.5d_dep")


class Linear2p5D(tp2d.Linear2D):
    """``y = x W^T + b``: ``[b/(dq), (s,) in/q]`` -> ``[b/(dq), (s,) out/q]``, SUMMA within each grid;
    ``weight [out, in]`` block ``(j, i)``, ``bias [out]`` block ``j``, both replicated over depth."""

    grid_of: ClassVar[tp2d.GridOf] = staticmethod(grid_2p5d)


class LayerNorm2p5D(tp2d.LayerNorm2D):
    """Layer norm of ``[b/(dq), (s,) h/q]`` over the whole hidden size; ``weight``/``bias`` block ``j``."""

    grid_of: ClassVar[tp2d.GridOf] = staticmethod(grid_2p5d)


class Embedding2p5D(tp2d.Embedding2D):
    """Full ids ``[B, (S)]`` -> ``[B/(dq), (S,) D/q]``; table stored 1/q^2 per rank (rows block i,
    hidden block j), all-gathered over ``2.5d_col`` for the lookup."""

    grid_of: ClassVar[tp2d.GridOf] = staticmethod(grid_2p5d)


class VocabParallelEmbedding2p5D(tp2d.VocabParallelEmbedding2D):
    """Full ids ``[B, (S)]`` -> ``[B/(dq), (S,) D/q]`` with the table split as a SUMMA weight
    (vocabulary block j, hidden block i), tieable to :class:`VocabParallelClassifier2p5D`."""

    grid_of: ClassVar[tp2d.GridOf] = staticmethod(grid_2p5d)


class Classifier2p5D(tp2d.Classifier2D):
    """``[b/(dq), (s,) h/q]`` -> logits ``[b/(dq), (s,) C]`` with every class."""

    grid_of: ClassVar[tp2d.GridOf] = staticmethod(grid_2p5d)


class VocabParallelClassifier2p5D(tp2d.VocabParallelClassifier2D):
    """``[b/(dq), (s,) h/q]`` -> logits ``[b/(dq), (s,) C/q]``: a :class:`Linear2p5D` without bias
    (by default), tieable to a :class:`VocabParallelEmbedding2p5D`'s weight."""

    grid_of: ClassVar[tp2d.GridOf] = staticmethod(grid_2p5d)


class PatchEmbedding2p5D(tp2d.PatchEmbedding2D):
    """ViT patch embedding: full images ``[B, c, H, W]`` -> ``[B/(dq), 1 + N, E/q]``."""

    grid_of: ClassVar[tp2d.GridOf] = staticmethod(grid_2p5d)


class Dropout2p5D(tp2d.Dropout2D):
    """Dropout of split activations, masks from ``ctx.rng.fork("tensor")``."""

    grid_of: ClassVar[tp2d.GridOf] = staticmethod(grid_2p5d)


class CrossEntropyLoss2p5D(tp2d.CrossEntropyLoss2D):
    """Mean cross entropy of ``[b/(dq), (s,) C]`` against full targets; equal on every rank."""

    grid_of: ClassVar[tp2d.GridOf] = staticmethod(grid_2p5d)


class VocabParallelCrossEntropyLoss2p5D(tp2d.VocabParallelCrossEntropyLoss2D):
    """Mean cross entropy of class-split ``[b/(dq), (s,) C/q]`` against full targets; equal on every rank."""

    grid_of: ClassVar[tp2d.GridOf] = staticmethod(grid_2p5d)


# ---- boundary helpers ------------------------------------------------------------------------


def _grid(ctx: ParallelContext | None) -> SummaGrid:
    return grid_2p5d(ctx if ctx is not None else get_context())


def split_activation(x_full: torch.Tensor, ctx: ParallelContext | None = None) -> torch.Tensor:
    """Full ``[B, (S,) H]`` -> this rank's ``[B/(dq) (block k*q + i), (S,) H/q (block j)]``,
    zero-padded; backward all-gathers the gradient."""
    return summa.split_activation(x_full, _grid(ctx))


def gather_activation(
    x_local: torch.Tensor, ctx: ParallelContext | None = None, full_shape: Any = None
) -> torch.Tensor:
    """Every rank's block -> the full activation on every rank; ``full_shape`` drops the padding."""
    return summa.gather_activation(x_local, _grid(ctx), full_shape)


def hidden_parts(ctx: ParallelContext | None = None) -> int:
    """Into how many blocks the hidden dimension is split: q."""
    return _grid(ctx).q


def batch_parts(ctx: ParallelContext | None = None) -> int:
    """Into how many blocks the batch is split: depth * q."""
    return _grid(ctx).batch_parts
