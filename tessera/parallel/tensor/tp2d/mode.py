"""The 2D entry of the registry: ``tessera.nn``'s arguments mapped onto the 2D layers."""

from __future__ import annotations

from tessera.parallel.tensor.mode import grid_mode
from tessera.parallel.tensor.tp2d import functional as F2
from tessera.parallel.tensor.tp2d import layers as L2

__all__ = ["MODE_2D"]

MODE_2D = grid_mode(
    "2d",
    {
        "Linear": L2.Linear2D,
        "LayerNorm": L2.LayerNorm2D,
        "Embedding": L2.Embedding2D,
        "VocabParallelEmbedding": L2.VocabParallelEmbedding2D,
        "Classifier": L2.Classifier2D,
        "VocabParallelClassifier": L2.VocabParallelClassifier2D,
        "PatchEmbedding": L2.PatchEmbedding2D,
        "Dropout": L2.Dropout2D,
        "CrossEntropyLoss": L2.CrossEntropyLoss2D,
        "VocabParallelCrossEntropyLoss": L2.VocabParallelCrossEntropyLoss2D,
    },
    split_activation=F2.split_activation,
    gather_activation=F2.gather_activation,
    hidden_parts=F2.hidden_parts,
    batch_parts=F2.batch_parts,
)
