"""Which states an optimizer keeps per element of a parameter: what a sharded optimizer that
keeps those states in its own buffers (Gemini's states parts) must hold for each shard."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tessera.errors import ConfigError


def state_streams(optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of the per-element states ``optimizer``'s kind keeps for a parameter, found by
    stepping a copy of it over a two-element parameter."""
    probe = nn.Parameter(torch.zeros(2))
    probe.grad = torch.ones(2)
    accepted = inspect.signature(type(optimizer).__init__).parameters
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    try:
        twin = type(optimizer)([probe], **settings)
        twin.step()
    except Exception as error:
        raise ConfigError(
            f"gemini: cannot tell which states {type(optimizer).__name__} keeps per parameter (building it as "
            f"{type(optimizer).__name__}(params, **optimizer.defaults) and stepping it failed: {error}); use an "
            "optimizer whose constructor takes its defaults back (torch.optim's, tessera.optim's)"
        ) from error
    return sorted(k for k, v in twin.state[probe].items() if isinstance(v, torch.Tensor) and v.shape == probe.shape)


class StreamStates:
    """``optimizer``'s per-element states kept in the caller's flat buffers: for a shard of
    ``n`` elements, stream ``k`` (``streams[k]``) of the parameter viewing ``[a, b)`` of the shard
    is ``buffer[k * n + a : k * n + b]``. Between steps the optimizer holds no state; its
    states that are not streams (a step count) are kept here per parameter."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.streams = state_streams(optimizer)
        self.scalars: dict[int, dict[str, Any]] = {}  # id(parameter) -> its states that are not streams

    def bind(self, params: Sequence[tuple[nn.Parameter, int, int]], buffer: torch.Tensor, n: int) -> None:
        """The optimizer's state of each ``(parameter, a, b)`` views ``buffer`` (plus its scalars)."""
        for p, a, b in params:
            state = dict(self.scalars.get(id(p), {}))
            for k, key in enumerate(self.streams):
                state[key] = buffer[k * n + a : k * n + b]
            self.optimizer.state[p] = state

    def unbind(self, params: Sequence[tuple[nn.Parameter, int, int]], buffer: torch.Tensor | None, n: int) -> None:
        """Take each parameter's state out of the optimizer: streams it made or was given (a
        first step, a loaded checkpoint) are copied into ``buffer``, scalars are kept."""
        for p, a, b in params:
            state = self.optimizer.state.pop(p, None)
            if not state:
                continue
            for k, key in enumerate(self.streams):
                value = state.get(key)
                view = buffer[k * n + a : k * n + b] if buffer is not None else None
                if value is not None and view is not None and value.data_ptr() != view.data_ptr():
                    view.copy_(value.reshape(-1))
            self.scalars[id(p)] = {k: v for k, v in state.items() if k not in self.streams}


def step_only(optimizer: torch.optim.Optimizer, group: int, params: list[nn.Parameter], empty: nn.Parameter) -> None:
    """One step of ``optimizer`` over ``params`` (of its parameter group ``group``) only; with
    none, over ``empty`` (a zero-element parameter, so that a rank holding nothing still meets
    the others' collectives, as LAMB's and LARS's norms make)."""
    groups = optimizer.param_groups
    saved = [g["params"] for g in groups]
    if not params:
        empty.grad = torch.zeros_like(empty)
        params = [empty]
    try:
        for index, g in enumerate(groups):
            g["params"] = params if index == group else []
        optimizer.step()
    finally:
        for g, kept in zip(groups, saved):
            g["params"] = kept
        optimizer.state.pop(empty, None)
        empty.grad = None


__all__ = ["StreamStates", "state_streams", "step_only"]
