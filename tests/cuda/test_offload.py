"""ZeRO with ``offload_optimizer="cpu"`` on the device: masters and optimizer states live on the
host, the masters in pinned memory (so the copies to and from the device can run without
blocking); the answer is the one without offload."""

from __future__ import annotations

import pytest
import torch

from tessera.memory import pins_for
from tests.cuda.runs import assert_same_run, gpt_config, train_gpt

HOST = torch.device("cpu")
TOLERANCE = {"fp32": dict(rtol=1e-5, atol=1e-6), "bf16": dict(rtol=2e-2, atol=2e-2)}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_keeps_pinned_masters_on_the_host_and_the_same_answer(device, stage, dtype):
    on_device = train_gpt(device, gpt_config(dtype, stage=stage))
    got = train_gpt(device, gpt_config(dtype, stage=stage, offload="cpu"))
    engine = got[2]
    assert all(p.device == device for p in engine.module.parameters()), "the model stays on the device"
    pieces = [p for group in engine.optimizer.param_groups for p in group["params"]]
    assert pieces
    for piece in pieces:
        assert piece.device == HOST and piece.dtype == torch.float32
        assert piece.is_pinned() == pins_for(device), "masters cross the bus every step: pinned on CUDA"
    states = [v for s in engine.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert states and all(v.device == HOST for v in states)
    assert_same_run(got, on_device, **TOLERANCE[dtype])
