"""LoRA on the device: quantizing a base on the GPU gives the CPU's codes, and 10 steps of LLaMA
with adapters on an NF4 base (double-quantized absmaxes) through the engine give the CPU run's
losses and adapters (fp32), or track them (bf16 autocast); the base stays codes on the device,
unchanged, with no gradient; one-rank ZeRO-3, which releases the frozen base's chunks between
uses, gives the plain engine's run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tessera
from tessera.lora.quant import QuantizedLinear, quantize
from tessera.testing import use_layout
from tests.dist.test_lora import adapted, batches, loss_of, optimizer_of

CPU = torch.device("cpu")


@pytest.mark.parametrize(("fmt", "double_quant"), [("int8", False), ("nf4", False), ("nf4", True)])
def test_quantizing_on_the_device_gives_the_cpus_codes(device, fmt, double_quant):
    torch.manual_seed(0)
    layer = nn.Linear(96, 80)
    on_cpu = QuantizedLinear(layer, fmt, double_quant=double_quant)
    on_device = QuantizedLinear(layer.to(device), fmt, double_quant=double_quant)
    for name, theirs in on_cpu.named_buffers():
        mine = dict(on_device.named_buffers())[name]
        assert mine.device == device, name
        if theirs.is_floating_point():  # double quantization's mean of the absmaxes: another order of sums
            torch.testing.assert_close(mine.cpu(), theirs, rtol=1e-5, atol=0, msg=name)
        elif name == "absmax_codes":  # ... which may tip a code rounded at a tie by one
            assert (mine.cpu().int() - theirs.int()).abs().max() <= 1, name
        else:  # the weight's codes: the nearest integer or level of the same scaled value
            assert torch.equal(mine.cpu(), theirs), name
    # one absmax code step (its group's scale) moves a block's values by at most that much
    step = on_cpu.absmax_scales.max().item() if double_quant else 0.0
    torch.testing.assert_close(on_device.weight_value().cpu(), on_cpu.weight_value(), rtol=1e-5, atol=1e-7 + step)


def lora_run(device: torch.device, dtype: str, stage: int = 0):
    use_layout(config={"mixed_precision": {"dtype": dtype}, "zero": {"stage": stage, "chunk_mb": 0.004}}, device=device)
    model = quantize(adapted("llama"), "nf4", double_quant=True)
    base = {k: v.clone() for k, v in model.state_dict().items() if ".lora_" not in k}
    engine, *_ = tessera.initialize(model, optimizer_of(model), loss_of)
    losses = [float(engine.train_batch(iter([(x, y)]))) for x, y in batches()]
    state = {k: v.detach().to("cpu", copy=True) for k, v in engine.model.state_dict().items()}
    return losses, state, base, engine


@pytest.fixture(scope="module")
def cpu_fp32():
    return lora_run(CPU, "fp32")


def check_run(got, expected, *, rtol: float, atol: float) -> None:
    losses, state, base, engine = got
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected[0]), rtol=rtol, atol=0)
    for key, value in expected[1].items():
        if ".lora_" in key:
            torch.testing.assert_close(state[key], value, rtol=rtol, atol=atol, msg=key)
    for key, value in base.items():
        assert torch.equal(state[key], value), f"the frozen base moved: {key}"
    codes = [m.codes for m in engine.model.modules() if isinstance(m, QuantizedLinear)]
    assert codes and all(c.device == engine.ctx.device for c in codes)
    frozen = [n for n, p in engine.model.named_parameters() if ".lora_" not in n]
    assert frozen and all(dict(engine.model.named_parameters())[n].grad is None for n in frozen)


def test_lora_on_an_nf4_base_on_the_device_matches_the_cpu_run(device, cpu_fp32):
    # fp32 on two devices: the same arithmetic in another summation order, over 10 AdamW steps
    check_run(lora_run(device, "fp32"), cpu_fp32, rtol=1e-4, atol=1e-5)


def test_bf16_lora_on_an_nf4_base_tracks_the_fp32_cpu_run(device, cpu_fp32):
    check_run(lora_run(device, "bf16"), cpu_fp32, rtol=3e-2, atol=3e-2)


def test_one_rank_zero3_with_a_released_frozen_base_on_the_device_matches_the_plain_engine(device):
    plain = lora_run(device, "fp32")
    got = lora_run(device, "fp32", stage=3)
    frozen = got[3].optimizer.frozen
    assert frozen.chunks and all(c.full.device == device for c in frozen.chunks)
    assert all(t.untyped_storage().nbytes() == 0 for t in frozen.tensors), "released between steps"
    check_run(got, plain, rtol=1e-5, atol=1e-6)
