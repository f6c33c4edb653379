"""1D (Megatron) tensor parallelism: ``functional.py`` (the layout, the collectives around each
matmul, sequence parallelism), ``layers.py`` (the ``nn.Module``s), ``mode.py`` (the registry
entry ``tessera.nn`` dispatches to)."""

from tessera.parallel.tensor.common import local_range
from tessera.parallel.tensor.tp1d.functional import (
    batch_parts,
    column_parallel_linear,
    gather_activation,
    gather_last_dim,
    hidden_parts,
    row_parallel_linear,
    split_activation,
    split_last_dim,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
)
from tessera.parallel.tensor.tp1d.layers import (
    Classifier1D,
    CrossEntropyLoss1D,
    Dropout1D,
    Embedding1D,
    LayerNorm1D,
    Linear1D_Col,
    Linear1D_Row,
    PatchEmbedding1D,
    VocabParallelClassifier1D,
    VocabParallelCrossEntropyLoss1D,
    VocabParallelEmbedding1D,
)
from tessera.parallel.tensor.tp1d.mode import MODE_1D

__all__ = [
    "MODE_1D",
    "Classifier1D",
    "CrossEntropyLoss1D",
    "Dropout1D",
    "Embedding1D",
    "LayerNorm1D",
    "Linear1D_Col",
    "Linear1D_Row",
    "PatchEmbedding1D",
    "VocabParallelClassifier1D",
    "VocabParallelCrossEntropyLoss1D",
    "VocabParallelEmbedding1D",
    "batch_parts",
    "column_parallel_linear",
    "gather_activation",
    "gather_last_dim",
    "hidden_parts",
    "local_range",
    "row_parallel_linear",
    "split_activation",
    "split_last_dim",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embedding",
]
