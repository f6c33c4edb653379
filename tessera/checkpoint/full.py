"""Full state dicts: the unsharded tensors under the keys the single-process model uses."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside wrappers such as DDP."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` as full CPU tensors under single-process keys.

    Collective once layouts shard parameters (every rank must call it); with data parallelism
    alone every rank returns the same dict.
    """
    return {k: v.detach().to("cpu", copy=True) for k, v in _unwrap(model).state_dict().items()}


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a full state dict (single-process keys) into ``model``; every key must match."""
    _unwrap(model).load_state_dict(state, strict=True)


def save_weights(state: dict[str, torch.Tensor], path: str | Path) -> Path:
    """Write ``state`` as safetensors atomically (a temporary file renamed into place).

    Tensors that share storage (tied weights) are written as separate copies.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().clone() for k, v in state.items()}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a safetensors file written by :func:`save_weights`."""
    return load_file(str(path))
