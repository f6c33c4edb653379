"""2.5D (Tesseract) tensor parallelism: ``functional.py`` (the grid stack, the layout and the
activation helpers; the math is 2D's on each grid), ``layers.py`` (the 2D layers on the 2.5D
grid), ``mode.py`` (the registry entry ``tessera.nn`` dispatches to)."""

from tessera.parallel.tensor.tp2p5d.functional import (
    batch_parts,
    gather_activation,
    grid_2p5d,
    hidden_parts,
    split_activation,
)
from tessera.parallel.tensor.tp2p5d.layers import (
    Classifier2p5D,
    CrossEntropyLoss2p5D,
    Dropout2p5D,
    Embedding2p5D,
    LayerNorm2p5D,
    Linear2p5D,
    PatchEmbedding2p5D,
    VocabParallelClassifier2p5D,
    VocabParallelCrossEntropyLoss2p5D,
    VocabParallelEmbedding2p5D,
)
from tessera.parallel.tensor.tp2p5d.mode import MODE_2P5D

__all__ = [
    "MODE_2P5D",
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
