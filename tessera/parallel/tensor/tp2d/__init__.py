"""2D (SUMMA / Optimus) tensor parallelism: ``functional.py`` (the layout, the parameters' blocks
and the math on any SUMMA grid, built on ``summa.py``), ``layers.py`` (the ``nn.Module``s, reused
by 2.5D with its grid), ``mode.py`` (the registry entry ``tessera.nn`` dispatches to)."""

from tessera.parallel.tensor.tp2d.functional import (
    batch_parts,
    gather_activation,
    grid_2d,
    hidden_parts,
    hidden_spec,
    split_activation,
    summa_weight_spec,
    table_spec,
)
from tessera.parallel.tensor.tp2d.layers import (
    Classifier2D,
    CrossEntropyLoss2D,
    Dropout2D,
    Embedding2D,
    GridOf,
    LayerNorm2D,
    Linear2D,
    PatchEmbedding2D,
    VocabParallelClassifier2D,
    VocabParallelCrossEntropyLoss2D,
    VocabParallelEmbedding2D,
)
from tessera.parallel.tensor.tp2d.mode import MODE_2D

__all__ = [
    "MODE_2D",
    "Classifier2D",
    "CrossEntropyLoss2D",
    "Dropout2D",
    "Embedding2D",
    "GridOf",
    "LayerNorm2D",
    "Linear2D",
    "PatchEmbedding2D",
    "VocabParallelClassifier2D",
    "VocabParallelCrossEntropyLoss2D",
    "VocabParallelEmbedding2D",
    "batch_parts",
    "gather_activation",
    "grid_2d",
    "hidden_parts",
    "hidden_spec",
    "split_activation",
    "summa_weight_spec",
    "table_spec",
]
