"""The engine's scheduling on the device: prefix caching, preemption, prompts prefilled in chunks,
``n`` sequences sharing a prefill (the copies on write of device blocks) and log-probabilities
give, on the GPU, the tokens each request gets alone on the CPU (greedy, each choice clear of
rounding) and log-probabilities within fp32's tolerance of the CPU's."""

from __future__ import annotations

import pytest
import torch

from tessera.context import ParallelContext
from tessera.inference.engine import CacheOptions, InferenceEngine
from tessera.inference.models import GPTRunner
from tessera.inference.params import SamplingParams
from tests.unit.test_inference_scheduling import FIELDS, GREEDY, prompts


def _engine(model: torch.nn.Module, device: torch.device, **options) -> InferenceEngine:
    ctx = ParallelContext.alone(device)
    return InferenceEngine(GPTRunner(model, 0, FIELDS["n_layers"] + 2, ctx), ctx, CacheOptions(**options))


def test_scheduling_on_the_device_gives_the_cpus_tokens_and_logprobs(device):
    from tessera.models import gpt

    torch.manual_seed(0)
    cpu = gpt("tiny", **FIELDS).eval()
    model = gpt("tiny", **FIELDS).eval()
    model.load_state_dict(cpu.state_dict())
    model.to(device)
    batch = prompts()
    alone = [_engine(cpu, torch.device("cpu"), num_blocks=64, block_size=4).generate([p], GREEDY)[0] for p in batch]
    tight = _engine(model, device, num_blocks=30, block_size=4, max_prefill_tokens=16)
    results = tight.generate(batch, GREEDY, arrivals=[0, 0, 1, 3, 5, 5, 9, 20])
    assert [r.tokens for r in results] == [r.tokens for r in alone]
    for got, want in zip(results, alone, strict=True):
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert tight.scheduler is not None and tight.scheduler.preemptions > 0 and tight.scheduler.blocks.hit_blocks > 0
    e = _engine(model, device, num_blocks=64, block_size=4)
    e.add_request("r", batch[0], SamplingParams(max_tokens=8, temperature=0.0, n=3))
    many: dict[int, list[int]] = {}
    while e.scheduler is not None and e.scheduler.has_work:
        for out in e.step():
            if out.token is not None:
                many.setdefault(out.index, []).append(out.token)
    assert [many[j] for j in range(3)] == [alone[0].tokens[:8]] * 3
