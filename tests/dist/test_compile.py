"""Compiled training equals eager training (contract 12): the same run, eager then with the
model's blocks compiled, on the same ranks; 20 steps, losses and final weights within fp32's
1e-5 relative. The compiled runs report what dynamo did: graphs captured, and where asked, no
graph break inside a GPT block."""

from __future__ import annotations

import dataclasses
import tempfile
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import tessera
from tessera.checkpoint import full_state_dict
from tessera.models import NextTokenLoss, gpt
from tessera.testing import use_layout
from tests.golden.strategies import GEMINI, GoldenRun, dataset

STEPS = 20
PP = dict(accumulation=1, microbatches=4)

# name -> (layout, backend, whether a GPT block must compile without a graph break)
LAYOUTS: dict[str, tuple[GoldenRun, str, bool]] = {
    "dp2": (GoldenRun(2, data=2), "inductor", True),
    "zero1-dp2": (GoldenRun(2, data=2, zero_stage=1), "aot_eager", True),
    "zero2-dp2": (GoldenRun(2, data=2, zero_stage=2), "aot_eager", True),
    "zero3-dp2": (GoldenRun(2, data=2, zero_stage=3), "inductor", True),
    "gemini-host-dp2": (GoldenRun(2, data=2, gemini="auto-host-2x"), "aot_eager", False),
    "tp1d-tp2-sp": (GoldenRun(2, tensor=2, sequence_parallel=True), "inductor", True),
    "tp2d-tp4": (GoldenRun(4, tensor=4, mode="2d"), "aot_eager", False),
    "tp2.5d-tp8-depth2": (GoldenRun(8, tensor=8, mode="2.5d", depth=2), "aot_eager", False),
    "tp3d-tp8": (GoldenRun(8, tensor=8, mode="3d"), "aot_eager", False),
    "pp2-1f1b": (GoldenRun(2, pipeline=2, schedule="1f1b", **PP), "aot_eager", False),
    "pp2-zero-bubble": (GoldenRun(2, pipeline=2, schedule="zero_bubble", **PP), "aot_eager", False),
    "sp2-ring": (GoldenRun(2, sequence=2, sequence_mode="ring"), "aot_eager", False),
    "sp2-all_to_all": (GoldenRun(2, sequence=2, sequence_mode="all_to_all"), "aot_eager", False),
    "recompute-full-dp2": (GoldenRun(2, data=2, recompute="full"), "aot_eager", False),
    "recompute-selective-dp2": (GoldenRun(2, data=2, recompute="selective"), "aot_eager", False),
    "ep2-dp2": (GoldenRun(2, data=2, expert=2), "aot_eager", False),
}


def _train(run: GoldenRun) -> dict[str, Any]:
    torch._dynamo.reset()  # a pool's ranks outlive a test: start each compiled run from empty caches
    with tempfile.TemporaryDirectory() as offload:
        use_layout(data=run.data, pipeline=run.pipeline, tensor=run.tensor, mode=run.mode, depth=run.depth,
                   sequence=run.sequence, expert=run.expert, config=run.config(offload))  # fmt: skip
        torch.manual_seed(0)
        model = gpt(**run.model())
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
        loader = DataLoader(dataset(), batch_size=run.micro_batch())
        engine, loader, _, _ = tessera.initialize(model, optimizer, NextTokenLoss(), loader)
        assert loader is not None
        it = iter(loader)
        losses = []
        for _ in range(STEPS):
            try:
                losses.append(engine.train_batch(it))
            except StopIteration:  # the data are 8 steps long: go round again
                it = iter(loader)
                losses.append(engine.train_batch(it))
        weights = {k: v.clone() for k, v in full_state_dict(model).items()}
        report = engine.compile_report.as_dict() if engine.compile_report is not None else None
        engine.strategy.close()
    return {"losses": losses, "weights": weights, "report": report}


def _eager_and_compiled(name: str) -> dict[str, Any]:
    run, backend, _ = LAYOUTS[name]
    eager = _train(run)
    compiled = _train(dataclasses.replace(run, compile=backend))
    return {"eager": eager, "compiled": compiled}


@pytest.mark.parametrize("name", sorted(LAYOUTS, key=lambda n: (LAYOUTS[n][0].ranks, n)))
def test_compiled_training_equals_eager(pools, name):
    run, backend, no_break = LAYOUTS[name]
    results = pools.run(run.ranks, _eager_and_compiled, name, timeout=600)
    for result in results:
        eager, compiled = result["eager"], result["compiled"]
        torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=1e-5, atol=0)
        for key, value in eager["weights"].items():  # relative in norm: Adam's steps amplify tiny differences
            drift = float((compiled["weights"][key] - value).norm() / value.norm())
            assert drift <= 1e-5, f"{name}: {key} moved {drift:.2e} (relative, in norm) from the eager run's"
        report = compiled["report"]
        assert report, "the compiled run reports its regions"
        assert set(report) <= {"blocks.0", "blocks.1"} and report  # a pipeline stage runs its own blocks
        assert sum(stats["graphs"] for stats in report.values()) >= 1, report  # blocks of one shape share a graph
        for region, stats in report.items():
            assert not stats["eager"], (region, stats)
            if no_break:
                assert stats["graph_breaks"] == {}, (region, stats["graph_breaks"])
