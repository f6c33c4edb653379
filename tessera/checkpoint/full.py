"""Full state dicts: the unsharded tensors under the keys the single-process model uses."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tessera import comm
from tessera.checkpoint.protocols import HoldsStrategy
from tessera.context import ParallelContext
from tessera.context.placement import Placement, ReleasableStorage, placement_of, storages_of
from tessera.files import atomic_path
from tessera.memory.deferred import allocate
from tessera.parallel.strategy import Strategy, state_dict_keys
from tessera.parallel.tensor.common import gather_full, local_shard


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside wrappers such as DDP."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def _module_and_strategy(source: nn.Module | HoldsStrategy) -> tuple[nn.Module, Strategy | None]:
    """The user's module of a model or an engine, and the engine's strategy (None for a model)."""
    if isinstance(source, HoldsStrategy) and isinstance(source.strategy, Strategy):
        return source.strategy.module, source.strategy
    if isinstance(source, nn.Module):
        return _unwrap(source), None
    raise TypeError(f"full state dicts are taken of a model or an engine, not of {type(source).__name__}")


def _named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers under their state-dict keys (tied ones under each key)."""
    keys = state_dict_keys(module)
    named: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    return {k: v for k, v in named.items() if k in keys}


def full_state_dict(
    source: nn.Module | HoldsStrategy, select: Callable[[str], bool] | None = None
) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as full CPU tensors under single-process keys.

    ``source``: an engine, or a model (the user's module, or a wrapper of it). Given an engine
    whose strategy keeps the weights it steps apart from the parameters (the fp32 masters of
    ZeRO with bf16/fp16), the parameters are those weights, bitwise; given a model they are the
    module's own parameters (bf16/fp16 there). Collective (every rank of the layout must call
    it): a sharded parameter is gathered along the axes of its placement's spec and its padding
    dropped, a pipeline stage's parameter is sent from its stage, released storage is gathered
    first. Every rank returns the same dict. ``select``: only the keys it accepts (the rest are
    neither gathered nor returned).
    """
    with streamed_full_state(source, select) as stream:
        return dict(stream)


@dataclass(frozen=True)
class FullEntry:
    """One tensor of a full state: its single-process ``key``, full ``shape`` and ``dtype``."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class FullStateStream:
    """:func:`full_state_dict`'s tensors one at a time: ``module`` (the user's), ``entries``
    (every key with its full shape and dtype, in the order iteration gives them) and, when
    iterated, ``(key, full CPU tensor)`` pairs, each gathered as it is reached (collective:
    every rank iterates in step; tied parameters are gathered once)."""

    def __init__(self, module: nn.Module, named: dict[str, torch.Tensor], values: dict[int, torch.Tensor]) -> None:
        self.module, self._named, self._values = module, named, values
        self.entries = [
            FullEntry(key, placement_of(t).full_shape(t), values.get(id(t), t).dtype) for key, t in named.items()
        ]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        counts = Counter(id(t) for t in self._named.values())
        kept: dict[int, torch.Tensor] = {}  # tied parameters, gathered once
        for key, tensor in self._named.items():
            full = kept.get(id(tensor))
            if full is None:
                value = self._values.get(id(tensor), tensor)
                full = _full_tensor(value, placement_of(tensor)).to("cpu", copy=True)
                if counts[id(tensor)] > 1:
                    kept[id(tensor)] = full
            yield key, full


@contextmanager
def streamed_full_state(
    source: nn.Module | HoldsStrategy, select: Callable[[str], bool] | None = None
) -> Iterator[FullStateStream]:
    """:func:`full_state_dict` one tensor at a time, for writers that keep no more than one
    full tensor (collective; iterate the stream inside the block). Weights the strategy keeps
    apart (fp32 masters) are gathered on entry, and released storage (ZeRO-3's chunks) stays
    gathered for the block, as :func:`full_state_dict` does."""
    module, strategy = _module_and_strategy(source)
    named = _named_tensors(module)
    if select is not None:
        named = {key: tensor for key, tensor in named.items() if select(key)}
    weights = strategy.full_precision_weights() if strategy is not None else None
    values = {id(p): value for p, value in weights or ()}
    with _storage_gathered(t for t in named.values() if id(t) not in values):
        yield FullStateStream(module, named, values)


@contextmanager
def _storage_gathered(tensors: Iterable[torch.Tensor]) -> Iterator[list[ReleasableStorage]]:
    """Every one of ``tensors`` readable inside the block (released storage gathered)."""
    storages = storages_of(tensors)
    with ExitStack() as stack:
        for storage in storages:
            stack.enter_context(storage.gathered())
        yield storages


def _mesh(placement: Placement, key: str) -> ParallelContext:
    if placement.mesh is None:
        raise ValueError(f"{key}: its placement names no parallel context to gather or shard it with")
    return placement.mesh


def _full_tensor(tensor: torch.Tensor, placement: Placement) -> torch.Tensor:
    """The full value of one parameter (``tensor``: its value on this rank, placed by
    ``placement``): gathered over the tensor axes that split it, and fetched from the pipeline
    stage that trains it."""
    full = tensor.detach()
    if full.is_meta:  # a deferred model's parameter of another pipeline stage: received below
        full = allocate(full, _mesh(placement, "a parameter").device)
    if placement.shard is not None:
        full = gather_full(full, placement.shard, _mesh(placement, "a sharded tensor"))
    mesh = placement.mesh
    if placement.stage is not None and mesh is not None and mesh.size("pipeline") > 1:
        full = comm.broadcast(full.clone(), mesh.group("pipeline"), src=placement.stage)
    return full


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor], *, partial: bool = False) -> None:
    """Copy a full state dict (single-process keys) into ``model`` in any layout; every key of
    the model must be present (unless ``partial``: those given, an adapter's), and no other."""
    module = _unwrap(model)
    named = _named_tensors(module)
    missing, unexpected = sorted(set(named) - set(state)), sorted(set(state) - set(named))
    if (missing and not partial) or unexpected:
        raise KeyError(f"state dict does not match the model: missing {missing}, unexpected {unexpected}")
    named = {key: tensor for key, tensor in named.items() if key in state}
    with torch.no_grad(), _storage_gathered(named.values()) as storages:
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
