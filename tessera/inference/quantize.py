"""Int8 weight-only quantization of a model's linear layers, for serving.

Each linear layer's weight becomes an int8 tensor and a float32 scale per output channel
(symmetric: ``scale = max|w| / 127`` over the input dimension, ``q = round(w / scale)``), kept
as the buffers ``weight_int8`` and ``weight_scale``; the activations stay in the model's dtype.
Before each call the layer's ``weight`` is rebuilt as ``q * scale`` in its input's dtype, and
dropped after it, so only the int8 copy stays resident: weights take about a quarter of their
fp32 bytes (half of bf16), and each call pays one dequantization per layer.

Linear layers of any layout are recognised: ``nn.Linear``, ``transformers``' ``Conv1D``
(weight ``[in, out]``) and tessera's tensor-parallel linears, whose weight is this rank's block
(its scales are computed on that block). Embeddings, a weight shared with another module (a
head tied to the embedding) and what ``skip`` names keep full precision. A quantized model is
for inference: quantize after loading weights and casting the model to its serving dtype
(a later ``.to(dtype)`` would round the scales too), and save checkpoints before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from tessera.hf.grid import GridHead, GridLinear
from tessera.hf.layers import ColumnParallel, RowParallel, VocabHead, is_conv1d
from tessera.lora.quant import dequantize_weight, quantize_weight
from tessera.parallel.tensor.tp1d.layers import Classifier1D, Linear1D_Col, Linear1D_Row, VocabParallelClassifier1D
from tessera.parallel.tensor.tp2d.layers import Classifier2D, Linear2D
from tessera.parallel.tensor.tp3d.layers import Classifier3D, Linear3D, VocabParallelClassifier3D

__all__ = ["QuantReport", "dequantize_weight", "output_dim", "quantize_int8", "quantize_weight"]

# Linear layers whose weight is [out, in] (or this rank's block of it): the 2D and 2.5D classes
# (Linear2p5D, VocabParallelClassifier2D, ...) subclass Linear2D or Classifier2D.
_OUTPUTS_FIRST: tuple[type[nn.Module], ...] = (
    nn.Linear,
    VocabHead,
    GridHead,
    Linear1D_Col,
    Linear1D_Row,
    Classifier1D,
    VocabParallelClassifier1D,
    Linear2D,
    Classifier2D,
    Linear3D,
    Classifier3D,
    VocabParallelClassifier3D,
)
# Stand-ins built from an nn.Linear or a Conv1D, which keep the Conv1D's [in, out] (``transposed``).
_EITHER_WAY: tuple[type[nn.Module], ...] = (ColumnParallel, RowParallel, GridLinear)


@dataclass
class QuantReport:
    """What :func:`quantize_int8` did: the modules quantized, those holding a weight that kept
    full precision (name -> why), and the bytes of the model's parameters and buffers."""

    quantized: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    bytes_before: int = 0
    bytes_after: int = 0

    def summary(self) -> str:
        """One line for a log."""
        mib = 2**20
        return (
            f"int8: {len(self.quantized)} linear layers quantized, {len(self.skipped)} weights kept; "
            f"{self.bytes_before / mib:.1f} MiB -> {self.bytes_after / mib:.1f} MiB"
        )


def output_dim(module: nn.Module) -> int | None:
    """Which dimension of ``module.weight`` holds the output channels (None: not a linear layer)."""
    if is_conv1d(module):
        return 1
    if isinstance(module, _EITHER_WAY):
        return 1 if module.transposed else 0
    if isinstance(module, _OUTPUTS_FIRST):
        return 0
    return None


def _input_dtype(args: tuple[Any, ...], kwargs: dict[str, Any], default: torch.dtype) -> torch.dtype:
    """The dtype of a call's first floating-point tensor argument (``default`` if none)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.dtype
    return default


def _attach_weight(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, out_dim: int, dtype: torch.dtype
) -> None:
    """Forward pre-hook: ``module.weight`` = the dequantized weight in the input's dtype. It is
    registered as a parameter, not a plain attribute, because some layers read their weights
    through ``named_parameters`` (tessera.hf.grid's layers pass them to ``functional_call``)."""
    weight = dequantize_weight(module.get_buffer("weight_int8"), module.get_buffer("weight_scale"), out_dim)
    weight = weight.to(_input_dtype(args, kwargs, dtype))
    module._parameters["weight"] = nn.Parameter(weight, requires_grad=False)


def _drop_weight(module: nn.Module, args: Any, output: Any) -> None:
    """Forward hook (also run when the forward raises): free the dequantized weight."""
    module._parameters.pop("weight", None)


def _quantize_module(module: nn.Module, out_dim: int) -> None:
    """Replace ``module``'s weight parameter by int8 and scale buffers and the hooks that use them."""
    weight = module._parameters["weight"]
    assert weight is not None
    q, scale = quantize_weight(weight, out_dim)
    del module._parameters["weight"]
    module.register_buffer("weight_int8", q)
    module.register_buffer("weight_scale", scale)
    module.register_forward_pre_hook(partial(_attach_weight, out_dim=out_dim, dtype=weight.dtype), with_kwargs=True)
    module.register_forward_hook(_drop_weight, always_call=True)


def _module_bytes(model: nn.Module) -> int:
    """Bytes of the distinct parameters and buffers of ``model``."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _holders(model: nn.Module) -> dict[int, list[str]]:
    """For each parameter (by identity), the names of the modules that hold it."""
    holders: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for param in module._parameters.values():
            if param is not None:
                holders.setdefault(id(param), []).append(name)
    return holders


def _why_kept(
    name: str, module: nn.Module, weight: torch.Tensor, holders: dict[int, list[str]], parent: nn.Module | None
) -> str | None:
    """Why ``module``'s weight keeps full precision (None: it is quantized)."""
    if isinstance(module, nn.Embedding) or "Embedding" in type(module).__name__:
        return "embedding"
    if output_dim(module) is None:
        return f"not a linear layer ({type(module).__name__})"
    others = [other for other in holders[id(weight)] if other != name]
    if others:
        return f"weight shared with {', '.join(others)}"
    if weight.dim() != 2:
        return f"weight is {weight.dim()}-D"
    if not weight.is_floating_point() or weight.is_meta:
        return f"weight is {weight.dtype} on {weight.device.type}"
    if isinstance(parent, nn.MultiheadAttention):  # it passes out_proj.weight to its kernel itself
        return "nn.MultiheadAttention reads this weight without calling the layer"
    return None


def quantize_int8(model: nn.Module, *, skip: Callable[[str, nn.Module], bool] | None = None) -> QuantReport:
    """Quantize ``model``'s linear layers in place to int8 weights with a float32 scale per
    output channel (see the module docstring); ``skip(name, module)`` True keeps a layer as it
    is. Returns what was quantized, what was kept and why, and the bytes before and after."""
    report = QuantReport(bytes_before=_module_bytes(model))
    holders = _holders(model)
    modules = dict(model.named_modules())
    for name, module in modules.items():
        weight = module._parameters.get("weight")
        if weight is None:
            continue
        parent = modules.get(name.rpartition(".")[0]) if name else None
        why = _why_kept(name, module, weight, holders, parent)
        if why is None and skip is not None and skip(name, module):
            why = "skip() said so"
        if why is not None:
            report.skipped[name] = why
            continue
        out_dim = output_dim(module)
        assert out_dim is not None
        _quantize_module(module, out_dim)
        report.quantized.append(name)
    report.bytes_after = _module_bytes(model)
    return report
