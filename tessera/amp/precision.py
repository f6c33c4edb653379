"""Autocast contexts. Parameters (the master weights) stay fp32; matmuls run in the compute dtype."""

from __future__ import annotations

import contextlib

import torch

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(name: str) -> torch.dtype:
    """torch dtype for a config name: fp32, bf16 or fp16."""
    if name not in _DTYPES:
        raise ValueError(f"unknown precision {name!r}; allowed: {', '.join(_DTYPES)}")
    return _DTYPES[name]


def autocast(name: str, device: torch.device) -> contextlib.AbstractContextManager[None]:
    """Autocast to the dtype ``name`` on ``device``; a no-op for fp32."""
    if name == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=compute_dtype(name))


def autocast_operands(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` (a matmul's floating operands) in the running autocast's dtype, as autocast
    casts the operands of ``F.linear``; unchanged outside autocast. For products autocast does
    not see: a custom autograd function, an in-place ``addmm_``. The casts are differentiable,
    so fp32 parameters still get fp32 gradients."""
    if not tensors:
        return tensors
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)
