"""Loading a sharded checkpoint into any layout.

``load(path, engine)`` asks the strategy what this rank holds now (``checkpoint_tensors``: the
views under the new layout) and fills each tensor from the pieces that overlap it
(``tessera.checkpoint.placing``); optimizer states are rebuilt under their parameters' views and
handed to the optimizer's own ``load_state_dict``. Random states come back only under the same
layout; the scheduler, the engine's counters and the data position always do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tessera.checkpoint.background import wait_for_saves
from tessera.checkpoint.format import CheckpointError, dtype_of, read_index, reading
from tessera.checkpoint.holding import aliases, optimizer_params
from tessera.checkpoint.placing import fill
from tessera.checkpoint.protocols import TrainingState
from tessera.checkpoint.runstate import layout_of, restore_float, restore_rng
from tessera.context.views import HeldTensor
from tessera.parallel.strategy import state_dict_keys

# optimizer settings that choose a kernel, not the arithmetic: the loading optimizer keeps its own
_KERNEL_KEYS = ("fused", "foreach", "capturable", "differentiable")


def load(path: str | Path, engine: TrainingState, *, dataloader: Any = None) -> int:
    """Load the checkpoint folder ``path`` into ``engine`` (any layout; collective) and, if
    given, ``dataloader``'s position; returns the step it was saved at."""
    wait_for_saves()
    folder = Path(path)
    index = read_index(folder)
    with engine.strategy.checkpoint_session():
        _load_tensors(folder, index, engine)
    engine.load_state_dict(index["engine"])
    scheduler = engine.lr_scheduler
    if scheduler is not None and index.get("scheduler") is not None:
        scheduler.load_state_dict(index["scheduler"])
    if dataloader is not None and index.get("dataloader") is not None:
        dataloader.load_state_dict(index["dataloader"])
    return int(index["step"])


def _load_tensors(folder: Path, index: dict[str, Any], engine: TrainingState) -> None:
    """The model's and optimizer's tensors and the random states (inside the strategy's
    checkpoint session)."""
    strategy, ctx = engine.strategy, engine.ctx
    held: list[HeldTensor] = strategy.checkpoint_tensors()
    tensors = index["tensors"]
    _check_model(engine.module, held, tensors, folder)
    with reading(folder) as reader:
        for h in held:
            fill(reader, f"model/{h.key}", tensors[f"model/{h.key}"], h.tensor, h.view)
        _load_optimizer(strategy.optimizer, held, index, reader)
        same_layout = index["layout"] == layout_of(ctx)
        if same_layout:
            prefix = f"rng/rank{ctx.rank}/"
            rng = {
                name[len(prefix) :]: reader.read(name, entry["pieces"][0])
                for name, entry in tensors.items()
                if name.startswith(prefix)
            }
            restore_rng(ctx, rng, index["ranks"][str(ctx.rank)]["rng"])
    strategy.checkpoint_loaded()


def _check_model(module: torch.nn.Module, held: list[HeldTensor], tensors: dict[str, Any], folder: Path) -> None:
    """Fail, naming them, on keys the checkpoint lacks or has beyond the model, and on shapes."""
    expected = state_dict_keys(module) - set(aliases(module))
    stored = {name[len("model/") :] for name in tensors if name.startswith("model/")}
    missing, unexpected = sorted(expected - stored), sorted(stored - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {folder} does not fit the model: missing {_listed(missing)}, unexpected {_listed(unexpected)}"
        )
    wrong = [
        f"{h.key}: checkpoint {tuple(tensors[f'model/{h.key}']['shape'])}, model {h.view.full_shape}"
        for h in held
        if tuple(tensors[f"model/{h.key}"]["shape"]) != h.view.full_shape
    ]
    if wrong:
        raise CheckpointError(f"checkpoint {folder} does not fit the model: shapes differ: {'; '.join(wrong)}")


def _listed(keys: list[str], at_most: int = 8) -> str:
    shown = ", ".join(keys[:at_most])
    return f"[{shown}{', ...' if len(keys) > at_most else ''}] ({len(keys)})" if keys else "none"


def _load_optimizer(optimizer: Any, held: list[HeldTensor], index: dict[str, Any], reader: Any) -> None:
    """Rebuild this rank's optimizer state (its pieces or blocks) and hyperparameters, and load
    it through the optimizer's own ``load_state_dict`` (which places the tensors)."""
    tensors = index["tensors"]
    saved_groups = index["optimizer"]["param_groups"]
    other = index["optimizer"].get("other", {})
    names_of: dict[str, list[str]] = {}
    for name in tensors:
        if name.startswith("optim/"):
            key, state = name[len("optim/") :].rsplit("/", 1)
            names_of.setdefault(key, []).append(state)
    by_id = {id(h.tensor): h for h in held}
    current = optimizer.state_dict()
    if len(current["param_groups"]) != len(saved_groups):
        raise CheckpointError(
            f"the optimizer has {len(current['param_groups'])} parameter groups, the checkpoint {len(saved_groups)}"
        )
    states: dict[int, dict[str, Any]] = {}
    for i, param in enumerate(optimizer_params(optimizer)):
        h = by_id.get(id(param))
        if h is None or (h.key not in names_of and h.key not in other):
            continue
        entry: dict[str, Any] = {}
        for state_name in names_of.get(h.key, []):
            name = f"optim/{h.key}/{state_name}"
            stored = tensors[name]
            if stored["shape"] == []:
                entry[state_name] = reader.read(name, stored["pieces"][0]).clone()
            else:
                value = torch.empty(h.tensor.shape, dtype=dtype_of(stored["dtype"]))
                fill(reader, name, stored, value, h.view)
                entry[state_name] = value
        entry.update({k: restore_float(v) for k, v in other.get(h.key, {}).items()})
        states[i] = entry
    for group, saved in zip(current["param_groups"], saved_groups):
        group.update({k: _group_value(group.get(k), v) for k, v in saved.items() if k not in _KERNEL_KEYS})
    current["state"] = states
    optimizer.load_state_dict(current)


def _group_value(current: Any, saved: Any) -> Any:
    """A saved hyperparameter in the type the optimizer holds it (tuples stay tuples)."""
    if isinstance(current, tuple) and isinstance(saved, list):
        return tuple(saved)
    return restore_float(saved)
