"""3D tensor parallelism on a q x q x q cube: ``functional.py`` (the layout, Agarwal's 3D matmul,
the parameters' blocks), ``layers.py`` (the ``nn.Module``s), ``mode.py`` (the registry entry
``tessera.nn`` dispatches to). The cube's coordinates are in ``tessera.parallel.tensor.grid``."""

from tessera.parallel.tensor.tp3d.functional import (
    Cube,
    batch_block,
    batch_parts,
    gather_activation,
    hidden_local,
    hidden_param,
    hidden_parts,
    hidden_spec,
    layer_norm_3d,
    linear_3d,
    mean_over_batch,
    split_activation,
    weight_spec,
)
from tessera.parallel.tensor.tp3d.layers import (
    Classifier3D,
    CrossEntropyLoss3D,
    Dropout3D,
    Embedding3D,
    LayerNorm3D,
    Linear3D,
    PatchEmbedding3D,
    VocabParallelClassifier3D,
    VocabParallelCrossEntropyLoss3D,
    VocabParallelEmbedding3D,
)
from tessera.parallel.tensor.tp3d.mode import MODE_3D

__all__ = [
    "MODE_3D",
    "Classifier3D",
    "CrossEntropyLoss3D",
    "Cube",
    "Dropout3D",
    "Embedding3D",
    "LayerNorm3D",
    "Linear3D",
    "PatchEmbedding3D",
    "VocabParallelClassifier3D",
    "VocabParallelCrossEntropyLoss3D",
    "VocabParallelEmbedding3D",
    "batch_block",
    "batch_parts",
    "gather_activation",
    "hidden_local",
    "hidden_param",
    "hidden_parts",
    "hidden_spec",
    "layer_norm_3d",
    "linear_3d",
    "mean_over_batch",
    "split_activation",
    "weight_spec",
]
