"""The inputs of the micro-batch a chunk is running, for the chunk's own use.

Only chunk 0 is fed the micro-batch's inputs; the later chunks get the previous chunk's
activation. Some models need more of the batch than that activation on every stage (a Hugging
Face layer takes the attention mask and position embeddings the model made from the batch):
since every pipeline rank of a data-parallel replica draws the same micro-batches, the runtime
makes the current one's inputs readable during each chunk's forward (:func:`current_inputs`),
so nothing but the activation has to cross the wire.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

__all__ = ["MISSING", "current_inputs", "running_inputs"]

MISSING: Any = object()  # a rank not given the micro-batches
_CURRENT: ContextVar[Any] = ContextVar("tessera_pipeline_inputs", default=MISSING)


@contextlib.contextmanager
def running_inputs(inputs: Any) -> Iterator[None]:
    """Make ``inputs`` (a micro-batch's inputs) the current ones inside the block."""
    token = _CURRENT.set(inputs)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_inputs() -> Any:
    """The inputs of the micro-batch whose forward is running on this rank. Raises outside a
    pipeline chunk's forward, or where this rank was not given the micro-batches."""
    inputs = _CURRENT.get()
    if inputs is MISSING:
        raise RuntimeError(
            "no micro-batch inputs here: this needs to run inside a pipeline chunk's forward on a rank "
            "that was given the step's micro-batches (engine.train_batch gives every pipeline rank them)"
        )
    return inputs
