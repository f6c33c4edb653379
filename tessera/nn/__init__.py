"""Parallel layers. The mode-dispatching ones (``Linear``, ``LayerNorm``, ``Embedding``, ...)
build the layer of the configured tensor-parallel mode, or a plain torch layer when the tensor
group has one rank; the explicit ones (``Linear1D_Col``, ``Linear2D``, ``LayerNorm3D``, ...)
are looked up in the mode modules of ``tessera.parallel.tensor``."""

from __future__ import annotations

import importlib
from typing import Any

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
    enter_sequence_parallel,
    exit_sequence_parallel,
    gather_activation,
    hidden_parts,
    split_activation,
    split_region_rng,
)

_EXPLICIT_SUFFIXES = {"1D": "tp1d", "2D": "tp2d", "2p5D": "tp2p5d", "3D": "tp3d"}


def __getattr__(name: str) -> Any:
    """``tessera.nn.Linear2D`` and the other explicit classes, from their mode module."""
    for suffix, module in _EXPLICIT_SUFFIXES.items():
        if name.endswith(suffix) or f"{suffix}_" in name:
            mod = importlib.import_module(f"tessera.parallel.tensor.{module}")
            if hasattr(mod, name):
                return getattr(mod, name)
    raise AttributeError(f"module 'tessera.nn' has no attribute {name!r}")


__all__ = [
    "Classifier",
    "CrossEntropyLoss",
    "Dropout",
    "Embedding",
    "LayerNorm",
    "Linear",
    "PatchEmbedding",
    "VocabParallelClassifier",
    "VocabParallelCrossEntropyLoss",
    "VocabParallelEmbedding",
    "enter_sequence_parallel",
    "exit_sequence_parallel",
    "gather_activation",
    "hidden_parts",
    "split_activation",
    "split_region_rng",
]
