"""The 3D entry of the registry: ``tessera.nn``'s arguments mapped onto the 3D layers."""

from __future__ import annotations

from tessera.parallel.tensor.mode import grid_mode
from tessera.parallel.tensor.tp3d import functional as F3
from tessera.parallel.tensor.tp3d import layers as L3

__all__ = ["MODE_3D"]

MODE_3D = grid_mode(
    "3d",
    {
        "Linear": L3.Linear3D,
        "LayerNorm": L3.LayerNorm3D,
        "Embedding": L3.Embedding3D,
        "VocabParallelEmbedding": L3.VocabParallelEmbedding3D,
        "Classifier": L3.Classifier3D,
        "VocabParallelClassifier": L3.VocabParallelClassifier3D,
        "PatchEmbedding": L3.PatchEmbedding3D,
        "Dropout": L3.Dropout3D,
        "CrossEntropyLoss": L3.CrossEntropyLoss3D,
        "VocabParallelCrossEntropyLoss": L3.VocabParallelCrossEntropyLoss3D,
    },
    split_activation=F3.split_activation,
    gather_activation=F3.gather_activation,
    hidden_parts=F3.hidden_parts,
    batch_parts=F3.batch_parts,
)
