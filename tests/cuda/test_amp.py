"""Autocast and dynamic loss scaling through the engine on the device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tessera
from tessera.amp import compute_dtype
from tessera.testing import use_layout

LR = 1e-2


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 5))  # fmt: skip


def batches(n: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 12, generator=g).to(device), torch.randint(0, 5, (16,), generator=g).to(device))
            for _ in range(n)]  # fmt: skip


def engine_for(device: torch.device, precision: dict) -> tuple[tessera.Engine, nn.Module]:
    use_layout(config={"mixed_precision": precision}, device=device)
    model = mlp()
    engine, _, _, _ = tessera.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR), nn.CrossEntropyLoss())
    return engine, model


def train(device: torch.device, precision: dict, steps: int = 20) -> list[float]:
    engine, _ = engine_for(device, precision)
    return [engine.train_batch(iter([b])) for b in batches(steps, device)]


# fp16 from 2^16 overflows on this model's first backward (tested below): start where it fits
PRECISIONS = {"bf16": {"dtype": "bf16"}, "fp16": {"dtype": "fp16", "initial_scale": 2.0**10}}


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_forward_runs_in_the_compute_dtype_and_the_weights_and_grads_stay_fp32(device, dtype):
    engine, model = engine_for(device, PRECISIONS[dtype])
    (x, y), = batches(1, device)  # fmt: skip
    out = engine(x)
    assert (out.dtype, out.device) == (compute_dtype(dtype), device)
    engine.backward(engine.criterion(out, y))
    for p in model.parameters():
        assert (p.dtype, p.device) == (torch.float32, device)
        assert p.grad is not None and (p.grad.dtype, p.grad.device) == (torch.float32, device)
    assert engine.step(), "the step was taken"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_training_tracks_fp32(device, dtype):
    reference = train(device, {"dtype": "fp32"})
    losses = train(device, PRECISIONS[dtype])
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, reference)]
    assert max(rel) < 2e-2, rel


def test_dynamic_scaling_skips_an_overflowing_step_backs_off_and_grows(device):
    engine, model = engine_for(device, {"dtype": "fp16", "initial_scale": 1024.0, "growth_interval": 2})
    log = []
    for step, (x, y) in enumerate(batches(6, device)):
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        if step == 3:
            next(model.parameters()).grad[0, 0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        stepped = engine.step()
        unchanged = all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        log.append((stepped, engine.scaler.scale, unchanged))
    stepped, scales, unchanged = zip(*log)
    assert stepped == (True, True, True, False, True, True)
    assert unchanged == (False, False, False, True, False, False)
    # x2 after every 2 clean steps, halved on the overflow, grown again after 2 clean ones
    assert scales == (1024.0, 2048.0, 2048.0, 1024.0, 1024.0, 2048.0)
    assert engine.scaler.skipped_steps == 1


def test_a_scale_too_large_for_fp16_overflows_until_it_has_backed_off(device):
    initial = 2.0**40  # the scaled loss's gradient overflows fp16 in the autocast backward
    engine, model = engine_for(device, {"dtype": "fp16", "initial_scale": initial})
    log = []
    for x, y in batches(60, device):
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        before = [p.detach().clone() for p in model.parameters()]
        stepped = engine.step()
        assert stepped != all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        log.append(stepped)
        if stepped:
            break
    skipped = log.index(True)
    assert skipped >= 10, "2^40 overflows fp16 (max 65504) for many halvings"
    assert log == [False] * skipped + [True]
    assert engine.scaler.scale == initial * 0.5**skipped
    assert engine.scaler.skipped_steps == skipped
