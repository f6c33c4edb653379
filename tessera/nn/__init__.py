"""Parallel layers. The mode-dispatching ones (``Linear``, ``LayerNorm``, ``Embedding``, ...)
build the layer of the configured tensor-parallel mode, or a plain torch layer when the tensor
group has one rank; the explicit ones (``Linear1D_Col``, ``Linear2D``, ``LayerNorm3D``, ...) are
the classes of the modes in ``tessera.parallel.tensor`` with ``ctx`` defaulting to the current
context (``tessera.nn.explicit``)."""

from __future__ import annotations

from tessera.nn.explicit import EXPLICIT
from tessera.nn.layers import (
    Classifier,
    CrossEntropyLoss,
    Dropout,
    Embedding,
    LayerNorm,
    Linear,
    PatchEmbedding,
    VocabParallelClassifier,
    VocabParallelCrossEntropyLoss,
    VocabParallelEmbedding,
    batch_parts,
    enter_sequence_parallel,
    exit_sequence_parallel,
    gather_activation,
    hidden_parts,
    resolve_context,
    split_activation,
    split_region_rng,
)
from tessera.nn.moe import MoE, auxiliary_loss
from tessera.nn.recompute import checkpoint_blocks, mark_block
from tessera.nn.sequence import Attention, attention, positions
from tessera.parallel.tensor import plain

globals().update(EXPLICIT)  # Linear1D_Col, Linear2D, ... (tessera.nn.explicit)

__all__ = [
    "Attention",
    "Classifier",
    "CrossEntropyLoss",
    "Dropout",
    "Embedding",
    "LayerNorm",
    "Linear",
    "MoE",
    "PatchEmbedding",
    "VocabParallelClassifier",
    "VocabParallelCrossEntropyLoss",
    "VocabParallelEmbedding",
    "attention",
    "auxiliary_loss",
    "batch_parts",
    "checkpoint_blocks",
    "enter_sequence_parallel",
    "exit_sequence_parallel",
    "gather_activation",
    "hidden_parts",
    "mark_block",
    "plain",
    "positions",
    "resolve_context",
    "split_activation",
    "split_region_rng",
    *EXPLICIT,
]
