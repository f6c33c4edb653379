"""Rows of a batch: a tensor, an ``(inputs, targets)`` pair, or a mapping of tensors (what a
Hugging Face data collator returns: ``input_ids``, ``attention_mask``, ``labels``, ...).

Dim 0 of every tensor of a batch is its rows. :func:`take_rows` cuts all of them at once, so
that the keys of a dict batch stay consistent (a row's ``input_ids``, mask and labels go
together); :func:`row_share` says which rows one of several ranks takes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def rows_of(batch: Any) -> int | None:
    """The rows of ``batch``: dim 0 of its first tensor with at least one dim (mappings in
    their key order, sequences in order); None when it holds no such tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() > 0 else None
    if isinstance(batch, Mapping):
        parts: Any = batch.values()
    elif isinstance(batch, list | tuple):
        parts = batch
    else:
        return None
    for part in parts:
        rows = rows_of(part)
        if rows is not None:
            return rows
    return None


def take_rows(batch: Any, start: int, stop: int, rows: int | None = None) -> Any:
    """``batch`` with every tensor whose dim 0 has ``rows`` entries (default: :func:`rows_of`)
    cut to rows ``[start, stop)``. Mappings come back as dicts with the same keys, lists and
    tuples as their own type; other tensors (a scalar, a table shared by all rows) and
    non-tensor leaves are kept whole."""
    if rows is None:
        rows = rows_of(batch)
        if rows is None:
            return batch
    if not 0 <= start <= stop <= rows:
        raise ValueError(f"rows [{start}, {stop}) are not within the batch's {rows} rows")
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() > 0 and batch.shape[0] == rows else batch
    if isinstance(batch, Mapping):
        return {key: take_rows(value, start, stop, rows) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(take_rows(part, start, stop, rows) for part in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(take_rows(part, start, stop, rows) for part in batch)
    return batch


def row_share(rows: int, size: int, rank: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` that ``rank`` of ``size`` takes of ``rows``: consecutive
    blocks in rank order, their sizes differing by at most one; ``size * k`` rows give every
    rank ``k``."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not one of {size} ranks")
    return rank * rows // size, (rank + 1) * rows // size


__all__ = ["row_share", "rows_of", "take_rows"]
