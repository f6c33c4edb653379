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
