"""Real memory for the meta-device tensors of a deferred model that a rank keeps (the values
come later, from tessera.init)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

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
    hooks, accumulated_hooks = param._backward_hooks, param._post_accumulate_grad_hooks
    real = nn.Parameter(torch.empty(0, dtype=value.dtype, device=value.device), requires_grad=param.requires_grad)
    real.__dict__.update(param.__dict__)
    torch.utils.swap_tensors(param, real)
    param.data = value
    # gradient hooks registered while the parameter was meta (a replicated table's all-reduce
    # over the tensor group, say) sit on the swapped-out tensor's autograd record: setting the
    # hook dicts again attaches them to this one (their handles still remove them)
    if hooks:
        param._backward_hooks = hooks
    if accumulated_hooks:
        param._post_accumulate_grad_hooks = accumulated_hooks


def module_tensors(module: nn.Module) -> Iterator[tuple[str, nn.Module, str, str, torch.Tensor]]:
    """``(key, owner, attribute, kind, tensor)`` for every parameter, buffer and plain tensor
    attribute of ``module``'s modules (kind ``"parameter"``, ``"buffer"`` or ``"attribute"``),
    each tensor once (a tied one under its first key)."""
    seen: set[int] = set()
    for prefix, owner in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        tensors = [("parameter", a, t) for a, t in owner._parameters.items()]
        tensors += [("buffer", a, t) for a, t in owner._buffers.items()]
        tensors += [("attribute", a, t) for a, t in vars(owner).items() if type(t) is torch.Tensor]
        for kind, attr, t in tensors:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                yield dot + attr, owner, attr, kind, t


def allocate_module(module: nn.Module, device: torch.device, keeps: Callable[[torch.Tensor], bool]) -> None:
    """Give every meta parameter that ``keeps`` and every meta buffer and tensor attribute of
    ``module`` real (uninitialised) memory on ``device``, in place: parameter objects stay the
    same objects."""
    with torch.no_grad():
        for _, owner, attr, kind, t in list(module_tensors(module)):
            if not t.is_meta:
                continue
            if kind == "parameter":
                if keeps(t):
                    set_data(t, allocate(t, device))  # type: ignore[arg-type]
            elif kind == "buffer":
                owner._buffers[attr] = allocate(t, device)
            else:
                setattr(owner, attr, allocate(t, device))


def to_device(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)`` for its real tensors; meta ones stay (they are made in place later)."""
    module._apply(lambda t: t if t.is_meta else t.to(device))
