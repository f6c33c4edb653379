"""The 2.5D entry of the registry: ``tessera.nn``'s arguments mapped onto the 2.5D layers."""

from __future__ import annotations

from tessera.parallel.tensor.mode import grid_mode
from tessera.parallel.tensor.tp2p5d import functional as F25
from tessera.parallel.tensor.tp2p5d import layers as L25

__all__ = ["MODE_2P5D"]

MODE_2P5D = grid_mode(
    "2.5d",
    {
        "Linear": L25.Linear2p5D,
        "LayerNorm": L25.LayerNorm2p5D,
        "Embedding": L25.Embedding2p5D,
        "VocabParallelEmbedding": L25.VocabParallelEmbedding2p5D,
        "Classifier": L25.Classifier2p5D,
        "VocabParallelClassifier": L25.VocabParallelClassifier2p5D,
        "PatchEmbedding": L25.PatchEmbedding2p5D,
        "Dropout": L25.Dropout2p5D,
        "CrossEntropyLoss": L25.CrossEntropyLoss2p5D,
        "VocabParallelCrossEntropyLoss": L25.VocabParallelCrossEntropyLoss2p5D,
    },
    split_activation=F25.split_activation,
    gather_activation=F25.gather_activation,
    hidden_parts=F25.hidden_parts,
    batch_parts=F25.batch_parts,
)
