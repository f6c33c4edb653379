"""docs/architecture.md's walk-through: the strategy written there, run as written, trains to the
same answer as DDP (through tessera.initialize) and as one process."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

import tessera
from tessera.parallel.data import distributed_loader
from tessera.checkpoint import full_state_dict
from tessera.engine.options import TrainingOptions
from tessera.testing import tolerance, use_layout
from tests.dist.test_engine import GLOBAL_BATCH, make_dataset, make_model, make_optimizer, reference_run

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
STEPS = 8


def walkthrough_code() -> str:
    """The python block that follows the walk-through marker in the doc."""
    text = DOC.read_text()
    found = re.search(r"<!-- walkthrough:[^>]*-->\s*```python\n(.*?)```", text, re.S)
    assert found, "docs/architecture.md lost its walk-through block"
    return found.group(1)


def body_walkthrough(accumulation: int) -> dict:
    namespace: dict = {}
    exec(compile(walkthrough_code(), str(DOC), "exec"), namespace)  # the doc's code, as written
    results = {}
    for side in ("walkthrough", "ddp"):
        ctx = use_layout(config={"gradient_accumulation": accumulation})
        model = make_model()
        optimizer = make_optimizer(model, "adamw")
        micro = GLOBAL_BATCH // (ctx.size("data") * accumulation)
        loader = DataLoader(make_dataset(), batch_size=micro, shuffle=False)
        if side == "walkthrough":
            options = TrainingOptions(gradient_accumulation=accumulation)
            engine = namespace["engine_with_one_allreduce"](model, optimizer, nn.CrossEntropyLoss(), ctx, options)
            loader = distributed_loader(loader, ctx.group("data"), seed=42)
        else:
            engine, loader, _, _ = tessera.initialize(model, optimizer, nn.CrossEntropyLoss(), loader)
        it = iter(loader)
        losses = [engine.train_batch(it) for _ in range(STEPS)]
        results[side] = (engine.strategy.name, losses, full_state_dict(model))
    return results


def test_the_walkthrough_strategy_trains_to_the_single_process_answer(pools):
    expected_losses, expected_state = reference_run(steps=STEPS)
    for accumulation in (1, 2):
        out = pools.run(2, body_walkthrough, accumulation)[0]
        assert out["walkthrough"][0] == "one-allreduce" and out["ddp"][0] == "ddp"
        for side in ("walkthrough", "ddp"):
            _, losses, state = out[side]
            tol = tolerance(steps=STEPS)  # make_model(): about one block's depth
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), **tol)
            for key, value in expected_state.items():
                torch.testing.assert_close(state[key], value, **tol, msg=f"{side}: {key}")
