"""Quantized frozen bases against references written here from the definitions: int8 per output
channel (absmax / 127, round to nearest) and NF4 (the 16 levels as printed in the QLoRA paper,
Dettmers et al. 2023, appendix E; blockwise absmax over 64 elements, nearest level); double
quantization of the absmaxes; a quantized layer's forward; and the refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tessera.lora
from tessera.errors import ConfigError
from tessera.lora.quant import (
    NF4_LEVELS,
    QuantizedLinear,
    dequantize_absmax,
    nf4_codes,
    quantize,
    quantize_absmax,
    quantize_int8,
    quantize_nf4,
)

# the NF4 data type as printed in the QLoRA paper (appendix E)
PAPER_NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
]  # fmt: skip


def reference_nf4(weight: torch.Tensor, block: int = 64) -> tuple[list[int], list[float]]:
    """Element by element: each block's absmax, each element's nearest paper level (its index),
    and the dequantized value level * absmax."""
    flat = weight.reshape(-1).tolist()
    codes, values = [], []
    for start in range(0, len(flat), block):
        chunk = flat[start : start + block]
        absmax = max(abs(v) for v in chunk)
        for v in chunk:
            index = min(range(16), key=lambda i: abs(v / absmax - PAPER_NF4[i]))
            codes.append(index)
            values.append(PAPER_NF4[index] * absmax)
    return codes, values


def test_nf4_levels_are_the_papers():
    torch.testing.assert_close(NF4_LEVELS, torch.tensor(PAPER_NF4), rtol=0, atol=1e-6)


def test_nf4_codes_and_values_equal_the_reference():
    weight = torch.randn(48, 40, generator=torch.Generator().manual_seed(0))  # 1,920 = 30 blocks
    packed, _ = quantize_nf4(weight)
    codes, values = reference_nf4(weight)
    assert nf4_codes(packed, weight.numel()).tolist() == codes
    layer = nn.Linear(40, 48, bias=False)
    layer.weight.data.copy_(weight)
    dequantized = QuantizedLinear(layer, "nf4").weight_value()
    torch.testing.assert_close(dequantized.reshape(-1), torch.tensor(values), rtol=1e-6, atol=0)
    assert packed.numel() == weight.numel() // 2 and packed.dtype == torch.uint8  # two codes a byte


def test_int8_per_output_channel_equals_the_formula():
    weight = torch.randn(6, 10, generator=torch.Generator().manual_seed(1))
    codes, scales = quantize_int8(weight)
    for o in range(6):
        scale = max(abs(v) for v in weight[o].tolist()) / 127
        assert scales[o].item() == pytest.approx(scale, rel=1e-6)
        assert codes[o].tolist() == [max(-127, min(127, round(v / scale))) for v in weight[o].tolist()]


def test_double_quantized_absmaxes_stay_within_one_step_of_their_group():
    absmax = torch.rand(300, generator=torch.Generator().manual_seed(2)) + 0.5
    codes, scales, mean = quantize_absmax(absmax)
    back = dequantize_absmax(codes, scales, mean)
    step = scales.repeat_interleave(256)[:300]
    assert ((back - absmax).abs() <= step / 2 + 1e-7).all()
    assert codes.dtype == torch.int8 and scales.numel() == 2


def test_a_quantized_adapted_layer_computes_with_the_dequantized_weight():
    layer = nn.Linear(64, 32)
    model = nn.Sequential(layer)
    tessera.lora.apply(model, rank=4, targets=("0",))
    quantize(model, "nf4", double_quant=True)
    base = model[0].base_layer
    assert isinstance(base, QuantizedLinear) and not any(p.requires_grad for p in base.parameters())
    x = torch.randn(3, 64)
    expected = x @ base.weight_value().t() + layer.bias
    torch.testing.assert_close(model(x), expected)  # B starts at zero: the adapter adds nothing yet


def test_quantize_needs_adapters_first():
    with pytest.raises(ConfigError, match="apply LoRA first"):
        quantize(nn.Sequential(nn.Linear(4, 4)))


def test_a_quantized_layer_keeps_no_full_precision_weight_for_the_backward():
    layer = QuantizedLinear(nn.Linear(256, 128, bias=False), "nf4")
    x = torch.randn(2, 256, requires_grad=True)
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    assert sum(saved) < 256 * 128 * 4 // 8, saved  # nothing near the fp32 weight's 128 KiB waits for the backward
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(2, 128) @ layer.weight_value())


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_merged_weights_fold_the_adapters_into_the_dequantized_base(fmt):
    """GPT-2's Conv1D layers keep [in, out] weights: the merged weight takes that shape back."""
    import transformers

    from tessera.hf.adapters import merged_state_dict

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    tessera.lora.apply(model, rank=4, targets=("c_attn", "c_fc"))
    quantize(model, fmt)
    for _, layer in tessera.lora.adapters(model):
        nn.init.normal_(layer.lora_B.weight, std=0.1)
    plain = transformers.GPT2LMHeadModel(config)
    plain.load_state_dict(merged_state_dict(model))  # the plain model's keys and shapes
    ids = torch.randint(0, 64, (2, 8))
    model.eval(), plain.eval()
    torch.testing.assert_close(plain(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)
