"""Dict batches: what the engine does with a batch that is a mapping of tensors (a Hugging Face
data collator's ``input_ids``, ``attention_mask``, ``labels``, ...).

The model is called with ``**batch``. Without a criterion the loss is the model output's
``.loss`` (or ``["loss"]``); with one, it is ``criterion(output, batch)``. Either way the loss of
a micro-batch is taken to be a mean over the items :func:`loss_items` counts, and the engine
weighs each micro-batch by its count, so that the step's loss is the mean over every counted
item of the global batch (all micro-batches, all data ranks): what one process computes on the
whole batch, however the ignored labels (``-100``: padding, prompts) fall between the ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tessera.errors import TesseraError
from tessera.parallel.batches import rows_of

#: the label that losses skip (``torch.nn.CrossEntropyLoss``'s and Hugging Face's ``ignore_index``)
IGNORE_INDEX = -100


def loss_shifts_labels(model: Any) -> bool:
    """Whether ``model``'s own loss predicts ``labels[..., 1:]`` from the tokens before them: a
    Hugging Face causal language model (its ``loss_function`` is ``ForCausalLMLoss``), not an
    encoder-decoder one (whose labels are the decoder's targets as they stand)."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return False
    loss_function = getattr(model, "loss_function", None)
    return getattr(loss_function, "__name__", None) == "ForCausalLMLoss"


def loss_items(batch: Mapping[str, Any], *, shift: bool = False) -> torch.Tensor:
    """The number of items the loss of ``batch`` averages over (an int64 scalar): the entries of
    ``batch["shift_labels"]`` that are not -100 when it has them; else those of
    ``batch["labels"]`` (without its first position along dim 1 when ``shift``, as a causal
    language model's loss leaves it out); else the batch's rows."""
    labels = batch.get("shift_labels")
    if not isinstance(labels, torch.Tensor):
        labels = batch.get("labels")
        if isinstance(labels, torch.Tensor) and shift and labels.dim() >= 2:
            labels = labels[:, 1:]
    if isinstance(labels, torch.Tensor):
        return (labels != IGNORE_INDEX).sum().to(torch.int64)
    rows = rows_of(batch)
    if rows is None:
        raise TesseraError(f"a dict batch needs tensors with a batch dimension; got keys {sorted(batch)}")
    return torch.tensor(rows, dtype=torch.int64)


def output_loss(output: Any) -> torch.Tensor:
    """The loss a model returned: ``output.loss``, or ``output["loss"]`` of a mapping."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if not isinstance(loss, torch.Tensor):
        raise TesseraError(
            f"the model returned no loss for a dict batch ({type(output).__name__} without .loss): put the "
            "targets in the batch (labels=...) so that the model computes its loss, or pass "
            "criterion=fn(output, batch) to initialize"
        )
    return loss


__all__ = ["IGNORE_INDEX", "loss_items", "loss_shifts_labels", "output_loss"]
