"""Quantized frozen bases in plain PyTorch: int8 per output channel and 4-bit NormalFloat (NF4,
Dettmers et al., 2023) with blockwise absmax scales, optionally double-quantized. The codes are
dequantized to the compute dtype at each use; nothing is compiled. The int8 primitives
(:func:`quantize_weight`) are also the serving quantizer's (``tessera.inference.quantize``).

- int8: ``W[o, :] ~ code[o, :] * scale[o]``, ``scale[o] = max|W[o, :]| / 127``, codes rounded to
  nearest in ``[-127, 127]``.
- NF4: the weight, flattened, in blocks of ``block`` (64) elements; each block's absmax ``s``
  scales it into ``[-1, 1]`` and each element takes the index of the nearest of the 16 NF4
  levels (:data:`NF4_LEVELS`, derived here from the normal distribution's quantiles as the
  paper defines them), two indices to a byte. With ``double_quant`` the fp32 absmaxes are
  themselves stored as int8 codes with one fp32 scale per 256 of them, less their mean (the
  paper's second quantization).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tessera.errors import ConfigError

FORMATS = ("int8", "nf4")


def _nf4_levels() -> torch.Tensor:
    """The 16 NF4 levels: 8 positive quantiles of N(0, 1) between probabilities 1/2 and
    ``offset``, 7 negative ones, and an exact zero, normalised to ``[-1, 1]`` (QLoRA's
    construction, ``offset = (1 - 1/(2*15) + 1 - 1/(2*16)) / 2``)."""
    offset = 0.5 * ((1 - 1 / 30) + (1 - 1 / 32))
    normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))
    positive = normal.icdf(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -normal.icdf(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    levels = torch.cat([positive, torch.zeros(1, dtype=torch.float64), negative]).sort().values
    return (levels / levels.abs().max()).float()


NF4_LEVELS = _nf4_levels()


QMAX = 127  # symmetric: -128 is left out so that q and -q are both representable


def quantize_weight(weight: torch.Tensor, out_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[out, in]`` (``out_dim=0``) or ``[in, out]`` (``out_dim=1``) -> ``(q, scale)``:
    ``q`` int8 of the same shape, ``scale [out]`` float32, symmetric per output channel."""
    w = weight.detach().float()
    in_dim = 1 - out_dim
    scale = w.abs().amax(dim=in_dim) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero channel (padding): q = 0
    q = torch.round(w / scale.unsqueeze(in_dim)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, out_dim: int) -> torch.Tensor:
    """``q * scale`` along the output channels: float32 of ``q``'s shape."""
    return q.float() * scale.float().unsqueeze(1 - out_dim)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes int8 [out, in], scales fp32 [out])`` of a ``[out, in]`` weight."""
    return quantize_weight(weight, 0)


def quantize_nf4(weight: torch.Tensor, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed uint8 codes [ceil(n / 2)], absmax fp32 [ceil(n / block)])`` of ``weight``
    flattened (``n`` elements; the last block padded with zeros)."""
    flat = weight.detach().float().reshape(-1)
    n = flat.numel()
    padded = F.pad(flat, (0, (-n) % block)).view(-1, block)
    absmax = padded.abs().amax(dim=1)
    scaled = padded / absmax.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    levels = NF4_LEVELS.to(flat.device)
    codes = (scaled.reshape(-1, 1) - levels[None, :]).abs().argmin(dim=1).to(torch.uint8)[:n]
    codes = F.pad(codes, (0, n % 2))
    return (codes[0::2] << 4 | codes[1::2]).contiguous(), absmax


def nf4_codes(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The 4-bit indices, one per element, of packed codes."""
    return torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[:numel]


def dequantize_nf4(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    shape: tuple[int, ...],
    block: int = 64,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    n = math.prod(shape)
    values = NF4_LEVELS.to(packed.device)[nf4_codes(packed, n).long()]
    scales = absmax.repeat_interleave(block)[:n]
    return (values * scales).view(shape).to(dtype)


def quantize_absmax(absmax: torch.Tensor, group: int = 256) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Double quantization: ``(int8 codes, fp32 scale per group, the fp32 mean)`` of absmaxes."""
    mean = absmax.mean()
    centred = F.pad(absmax - mean, (0, (-absmax.numel()) % group)).view(-1, group)
    scales = centred.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
    codes = torch.round(centred / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return codes.reshape(-1)[: absmax.numel()], scales, mean


def dequantize_absmax(codes: torch.Tensor, scales: torch.Tensor, mean: torch.Tensor, group: int = 256) -> torch.Tensor:
    return codes.float() * scales.repeat_interleave(group)[: codes.numel()] + mean


class _DequantizedMatmul(torch.autograd.Function):
    """``x @ W.T`` with ``W`` dequantized for the product and dropped after it: the backward
    dequantizes again for the input's gradient, so the full-precision weight never waits in the
    autograd graph (the base is frozen: no weight gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
        ctx.layer, ctx.dtype = layer, x.dtype
        return F.linear(x, layer.weight_value(x.dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # under autocast the output, hence ``grad``, is in the autocast dtype while ``x`` was not
        return (grad @ ctx.layer.weight_value(grad.dtype)).to(ctx.dtype), None


class QuantizedLinear(nn.Module):
    """A frozen linear layer kept as ``fmt`` codes (``"int8"`` or ``"nf4"``), dequantized to the
    input's dtype at each forward. Built from an ``nn.Linear`` or a transformers ``Conv1D``
    (whose ``[in, out]`` weight is stored as ``[out, in]``; ``from_conv1d`` says so, for whoever
    writes the weight back in its layer's shape); its bias stays as it was, frozen."""

    #: the buffers that are the frozen weight: sharded and released between uses under ZeRO-3 and Gemini
    frozen_buffers = ("codes", "scales", "absmax", "absmax_codes", "absmax_scales", "absmax_mean")
    codes: torch.Tensor
    scales: torch.Tensor
    absmax: torch.Tensor
    absmax_codes: torch.Tensor
    absmax_scales: torch.Tensor
    absmax_mean: torch.Tensor
    bias: nn.Parameter | None

    def __init__(self, layer: Any, fmt: str = "nf4", block: int = 64, double_quant: bool = False) -> None:
        super().__init__()
        if fmt not in FORMATS:
            raise ConfigError(f"quantization {fmt!r}: expected one of {', '.join(FORMATS)}")
        conv1d = type(layer).__name__ == "Conv1D" and hasattr(layer, "nf")
        if not conv1d and not isinstance(layer, nn.Linear):
            raise TypeError(f"{type(layer).__name__} is not a linear layer to quantize")
        weight = layer.weight.detach().t() if conv1d else layer.weight.detach()  # [out, in]
        self.from_conv1d: bool = conv1d
        self.out_features: int = weight.shape[0]
        self.in_features: int = weight.shape[1]
        self.fmt, self.block, self.double_quant = fmt, block, double_quant
        self.bias = layer.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        # a base not made yet (deferred initialisation) gets codes of the right shapes on the
        # meta device: a loader fills them from the stored weight (values_from), shard by shard
        for name, value in self.values_from(layer.weight.detach()).items():
            self.register_buffer(name, value)

    def values_from(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """This layer's buffers quantized from ``weight`` as its base stores it (``[in, out]``
        for a ``Conv1D``): what a loader writes to quantize while loading, one layer at a time."""
        w = weight.t() if self.from_conv1d else weight
        if self.fmt == "int8":
            codes, scales = quantize_int8(w)
            return {"codes": codes, "scales": scales}
        packed, absmax = quantize_nf4(w, self.block)
        if not self.double_quant:
            return {"codes": packed, "absmax": absmax}
        a_codes, a_scales, mean = quantize_absmax(absmax)
        return {"codes": packed, "absmax_codes": a_codes, "absmax_scales": a_scales, "absmax_mean": mean}

    def weight_value(
        self, dtype: torch.dtype = torch.float32, buffers: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The dequantized ``[out, in]`` weight (of ``buffers``, this layer's buffers by name as a
        full state holds them, instead of its own)."""
        b = dict(self.named_buffers()) if buffers is None else buffers
        shape = (self.out_features, self.in_features)
        if self.fmt == "int8":
            return dequantize_weight(b["codes"], b["scales"], 0).to(dtype)
        if self.double_quant:
            absmax = dequantize_absmax(b["absmax_codes"], b["absmax_scales"], b["absmax_mean"])
        else:
            absmax = b["absmax"]
        return dequantize_nf4(b["codes"], absmax, shape, self.block, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _DequantizedMatmul.apply(x, self)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        dq = ", double_quant" if self.double_quant else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt}{dq}"


def quantize(model: nn.Module, fmt: str = "nf4", *, block: int = 64, double_quant: bool = False) -> nn.Module:
    """Replace the frozen base of every adapted layer of ``model`` (``tessera.lora.apply`` first)
    by its ``fmt`` quantization, in place."""
    from tessera.lora.layers import QUANTIZED_SPLIT, LoraLinear

    layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
    if not layers:
        raise ConfigError("quantize() quantizes the frozen bases of adapted layers: apply LoRA first")
    if any(layer.split != "none" for layer in layers):  # a tessera model built in a tensor-parallel layout
        raise ConfigError(QUANTIZED_SPLIT)
    for layer in layers:
        if not isinstance(layer.base_layer, QuantizedLinear):
            layer.base_layer = QuantizedLinear(layer.base_layer, fmt, block, double_quant)
            layer.transposed = False  # the codes hold [out, in] whatever the layer was
    return model


__all__ = [
    "FORMATS",
    "NF4_LEVELS",
    "QMAX",
    "QuantizedLinear",
    "dequantize_weight",
    "quantize",
    "quantize_int8",
    "quantize_nf4",
    "quantize_weight",
]
