"""Real memory for the meta-device tensors of a deferred model that a rank keeps (the values
come later, from tessera.init)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def allocate(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Uninitialised memory of ``tensor``'s shape and dtype on ``device``."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=device)


def set_data(param: nn.Parameter, value: torch.Tensor) -> None:
    """``param.data = value``, also from the meta device to a real one (which ``.data`` refuses):
    the parameter stays the same object (the optimizer's, with its attributes)."""
    if not param.is_meta or value.is_meta:
        param.data = value
        return
    # swap in an empty real parameter, then set its data as for any parameter: the parameter
    # keeps a version counter of its own (not the one of ``value``'s base, a ZeRO chunk say,
    # whose in-place gathers would otherwise look like changes to the parameter to autograd)
    real = nn.Parameter(torch.empty(0, dtype=value.dtype, device=value.device), requires_grad=param.requires_grad)
    real.__dict__.update(param.__dict__)
    torch.utils.swap_tensors(param, real)
    param.data = value


def allocate_module(module: nn.Module, device: torch.device, keeps: Callable[[torch.Tensor], bool]) -> None:
    """Give every meta parameter that ``keeps`` and every meta buffer of ``module`` real
    (uninitialised) memory on ``device``, in place: parameter objects stay the same objects."""
    with torch.no_grad():
        for owner in module.modules():
            for param in owner._parameters.values():
                if param is not None and param.is_meta and keeps(param):
                    set_data(param, allocate(param, device))
            for name, buffer in owner._buffers.items():
                if buffer is not None and buffer.is_meta:
                    owner._buffers[name] = allocate(buffer, device)
            for attr, value in list(vars(owner).items()):
                if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and value.is_meta:
                    setattr(owner, attr, allocate(value, device))


def to_device(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)`` for its real tensors; meta ones stay (they are made in place later)."""
    module._apply(lambda t: t if t.is_meta else t.to(device))
