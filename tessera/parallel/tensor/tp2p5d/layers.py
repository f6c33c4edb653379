"""2.5D (Tesseract) layers: the 2D layers (:mod:`tessera.parallel.tensor.tp2d.layers`) on the
2.5D grid (:func:`~tessera.parallel.tensor.tp2p5d.functional.grid_2p5d`); only their grid
differs. Each takes its context as ``ctx=``."""

from __future__ import annotations

from typing import ClassVar

from tessera.parallel.tensor.tp2d import layers as L2
from tessera.parallel.tensor.tp2d.layers import GridOf
from tessera.parallel.tensor.tp2p5d.functional import grid_2p5d

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
]


class Linear2p5D(L2.Linear2D):
    """``y = x W^T + b``: ``[b/(dq), (s,) in/q]`` -> ``[b/(dq), (s,) out/q]``, SUMMA within each grid;
    ``weight [out, in]`` block ``(j, i)``, ``bias [out]`` block ``j``, both replicated over depth."""

    grid_of: ClassVar[GridOf] = staticmethod(grid_2p5d)


class LayerNorm2p5D(L2.LayerNorm2D):
    """Layer norm of ``[b/(dq), (s,) h/q]`` over the whole hidden size; ``weight``/``bias`` block ``j``."""

    grid_of: ClassVar[GridOf] = staticmethod(grid_2p5d)


class Embedding2p5D(L2.Embedding2D):
    """Full ids ``[B, (S)]`` -> ``[B/(dq), (S,) D/q]``; table stored 1/q^2 per rank (rows block i,
    hidden block j), all-gathered over ``2.5d_col`` for the lookup."""

    grid_of: ClassVar[GridOf] = staticmethod(grid_2p5d)


class VocabParallelEmbedding2p5D(L2.VocabParallelEmbedding2D):
    """Full ids ``[B, (S)]`` -> ``[B/(dq), (S,) D/q]`` with the table split as a SUMMA weight
    (vocabulary block j, hidden block i), tieable to :class:`VocabParallelClassifier2p5D`."""

    grid_of: ClassVar[GridOf] = staticmethod(grid_2p5d)


class Classifier2p5D(L2.Classifier2D):
    """``[b/(dq), (s,) h/q]`` -> logits ``[b/(dq), (s,) C]`` with every class."""

    grid_of: ClassVar[GridOf] = staticmethod(grid_2p5d)


class VocabParallelClassifier2p5D(L2.VocabParallelClassifier2D):
    """``[b/(dq), (s,) h/q]`` -> logits ``[b/(dq), (s,) C/q]``: a :class:`Linear2p5D` without bias
    (by default), tieable to a :class:`VocabParallelEmbedding2p5D`'s weight."""

    grid_of: ClassVar[GridOf] = staticmethod(grid_2p5d)


class PatchEmbedding2p5D(L2.PatchEmbedding2D):
    """ViT patch embedding: full images ``[B, c, H, W]`` -> ``[B/(dq), 1 + N, E/q]``."""

    grid_of: ClassVar[GridOf] = staticmethod(grid_2p5d)


class Dropout2p5D(L2.Dropout2D):
    """Dropout of split activations, masks from ``ctx.rng.fork("tensor")``."""

    grid_of: ClassVar[GridOf] = staticmethod(grid_2p5d)


class CrossEntropyLoss2p5D(L2.CrossEntropyLoss2D):
    """Mean cross entropy of ``[b/(dq), (s,) C]`` against full targets; equal on every rank."""

    grid_of: ClassVar[GridOf] = staticmethod(grid_2p5d)


class VocabParallelCrossEntropyLoss2p5D(L2.VocabParallelCrossEntropyLoss2D):
    """Mean cross entropy of class-split ``[b/(dq), (s,) C/q]`` against full targets; equal on every rank."""

    grid_of: ClassVar[GridOf] = staticmethod(grid_2p5d)
