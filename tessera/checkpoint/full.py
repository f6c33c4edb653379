"""Full state dicts: the unsharded tensors under the keys the single-process model uses."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tessera import comm
from tessera.context import ParallelContext
from tessera.context.placement import Placement, ReleasableStorage, placement_of, storages_of
from tessera.files import atomic_path
from tessera.parallel.tensor.common import gather_full, local_shard


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

    Collective (every rank of the model's layout must call it): a sharded parameter is gathered
    along the axes of its placement's spec and its padding dropped, a pipeline stage's parameter
    is sent from its stage, released storage is gathered first. Every rank returns the same dict.
    """
    module = _unwrap(model)
    out: dict[str, torch.Tensor] = {}
    gathered: dict[int, torch.Tensor] = {}  # tied parameters are gathered once
    with _storage_gathered(module):
        for key, tensor in _named_tensors(module).items():
            if id(tensor) not in gathered:
                gathered[id(tensor)] = _full_tensor(tensor).to("cpu", copy=True)
            out[key] = gathered[id(tensor)]
    return out


@contextmanager
def _storage_gathered(module: nn.Module) -> Iterator[list[ReleasableStorage]]:
    """Every parameter of ``module`` readable inside the block (released storage gathered)."""
    storages = storages_of(module.parameters())
    with ExitStack() as stack:
        for storage in storages:
            stack.enter_context(storage.gathered())
        yield storages


def _mesh(placement: Placement, key: str) -> ParallelContext:
    if placement.mesh is None:
        raise ValueError(f"{key}: its placement names no parallel context to gather or shard it with")
    return placement.mesh


def _full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The full value of one parameter: gathered over the tensor axes that split it, and fetched
    from the pipeline stage that trains it."""
    full = tensor.detach()
    placement = placement_of(tensor)
    if placement.shard is not None:
        full = gather_full(full, placement.shard, _mesh(placement, "a sharded tensor"))
    mesh = placement.mesh
    if placement.stage is not None and mesh is not None and mesh.size("pipeline") > 1:
        full = comm.broadcast(full.clone(), mesh.group("pipeline"), src=placement.stage)
    return full


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a full state dict (single-process keys) into ``model`` in any layout; every key of
    the model must be present, and no other."""
    module = _unwrap(model)
    named = _named_tensors(module)
    missing, unexpected = sorted(set(named) - set(state)), sorted(set(state) - set(named))
    if missing or unexpected:
        raise KeyError(f"state dict does not match the model: missing {missing}, unexpected {unexpected}")
    with torch.no_grad(), _storage_gathered(module) as storages:
        for key, tensor in named.items():
            full = state[key]
            placement = placement_of(tensor)
            if placement.shard is not None:
                full = local_shard(full.to(tensor.dtype), placement.shard, _mesh(placement, key))
            if tuple(full.shape) != tuple(tensor.shape):
                raise ValueError(f"{key}: shape {tuple(full.shape)} does not fit {tuple(tensor.shape)}")
            tensor.copy_(full)
        for storage in storages:
            storage.params_loaded()  # shards and fp32 masters follow the new values


def save_weights(state: dict[str, torch.Tensor], path: str | Path) -> Path:
    """Write ``state`` as safetensors atomically (a temporary file renamed into place), with
    the mode the umask gives (0644 under umask 022).

    Tensors that share storage (tied weights) are written as separate copies.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().clone() for k, v in state.items()}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp))
    return path


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a safetensors file written by :func:`save_weights`."""
    return load_file(str(path))
