"""Full state dicts: the unsharded tensors under the keys the single-process model uses."""

from __future__ import annotations

import os
import tempfile
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tessera import comm
from tessera.context import get_context, has_context
from tessera.parallel.tensor.common import gather_full, local_shard, spec_of


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside wrappers such as DDP."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def _named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers under their state-dict keys (tied ones under each key)."""
    keys = set(module.state_dict().keys())
    named: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    return {k: v for k, v in named.items() if k in keys}


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` as full CPU tensors under single-process keys.

    Collective (every rank of the tensor group must call it): a sharded parameter is gathered
    along the axes of its ``tessera_shard`` spec and its padding dropped. Every rank returns the
    same dict.
    """
    module = _unwrap(model)
    out: dict[str, torch.Tensor] = {}
    gathered: dict[int, torch.Tensor] = {}  # tied parameters are gathered once
    with _zero_gathered(module):
        for key, tensor in _named_tensors(module).items():
            if id(tensor) not in gathered:
                gathered[id(tensor)] = _full_tensor(tensor).to("cpu", copy=True)
            out[key] = gathered[id(tensor)]
    return out


def _zero_gathered(module: nn.Module) -> AbstractContextManager[None]:
    """Under ZeRO-3 the parameters are readable only while their chunks are gathered."""
    zero = getattr(module, "tessera_zero", None)
    return zero.gathered() if zero is not None else nullcontext()


def _full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The full value of one parameter: gathered over the tensor axes that split it, and fetched
    from the pipeline stage that trains it."""
    full = tensor.detach()
    spec = spec_of(tensor)
    if spec is not None:
        full = gather_full(full, spec, get_context())
    owner = getattr(tensor, "tessera_pipeline_owner", None)
    if owner is not None and has_context() and get_context().size("pipeline") > 1:
        full = comm.broadcast(full.clone(), get_context().group("pipeline"), src=owner)
    return full


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a full state dict (single-process keys) into ``model`` in any layout; every key of
    the model must be present, and no other."""
    module = _unwrap(model)
    named = _named_tensors(module)
    missing, unexpected = sorted(set(named) - set(state)), sorted(set(state) - set(named))
    if missing or unexpected:
        raise KeyError(f"state dict does not match the model: missing {missing}, unexpected {unexpected}")
    zero = getattr(module, "tessera_zero", None)
    with torch.no_grad(), _zero_gathered(module):
        for key, tensor in named.items():
            full = state[key]
            spec = spec_of(tensor)
            if spec is not None:
                full = local_shard(full.to(tensor.dtype), spec, get_context())
            if tuple(full.shape) != tuple(tensor.shape):
                raise ValueError(f"{key}: shape {tuple(full.shape)} does not fit {tuple(tensor.shape)}")
            tensor.copy_(full)
        if zero is not None:
            zero.params_loaded()  # the shards and fp32 masters follow the new values


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
