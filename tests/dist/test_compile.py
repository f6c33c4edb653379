"""Compiled training equals eager training (contract 12): the same run, eager then with the
model's blocks compiled, on the same ranks; 20 steps, losses within fp32's 1e-5 relative and
final weights within 1e-5 relative in norm, and the comm ledger the same (every collective
still counted). The compiled runs report what dynamo did: graphs captured, and where asked, no
graph break inside a GPT block."""

from __future__ import annotations

import dataclasses
import tempfile
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import tessera
from tessera import comm
from tessera.checkpoint import full_state_dict
from tessera.models import NextTokenLoss, gpt
from tessera.testing import use_layout
from tests.golden.strategies import GoldenRun, start

STEPS = 20
PP = dict(accumulation=1, microbatches=4)


@dataclasses.dataclass(frozen=True)
class Case:
    run: GoldenRun
    backend: str = (
        "aot_eager"  # inductor where it matters most; aot_eager (the captured graphs, torch's kernels) elsewhere
    )
    no_break: bool = False  # a GPT block compiles to one graph, without a break
    # Gemini's auto placement reacts to the working set, which a block gathered whole changes:
    # its parameter gathers may differ by the odd re-gather (all other collectives are the same)
    exact_gathers: bool = True


CASES: dict[str, Case] = {
    "dp2": Case(GoldenRun(2, data=2), "inductor", no_break=True),
    "zero1-dp2": Case(GoldenRun(2, data=2, zero_stage=1)),
    "zero2-dp2": Case(GoldenRun(2, data=2, zero_stage=2)),
    "zero3-dp2": Case(GoldenRun(2, data=2, zero_stage=3), "inductor", no_break=True),
    "gemini-host-dp2": Case(GoldenRun(2, data=2, gemini="auto-host-2x"), exact_gathers=False),
    "tp1d-tp2-sp": Case(GoldenRun(2, tensor=2, sequence_parallel=True), "inductor", no_break=True),
    # the grid modes and experts take one micro-batch a step (the others show accumulation): a
    # quarter or eighth of a core per rank makes their steps the slowest of the file
    "tp2d-tp4": Case(GoldenRun(4, tensor=4, mode="2d", accumulation=1), no_break=True),
    "tp2.5d-tp8-depth2": Case(GoldenRun(8, tensor=8, mode="2.5d", depth=2, accumulation=1), no_break=True),
    "tp3d-tp8": Case(GoldenRun(8, tensor=8, mode="3d", accumulation=1), no_break=True),
    "pp2-1f1b": Case(GoldenRun(2, pipeline=2, schedule="1f1b", **PP)),
    "pp2-zero-bubble": Case(GoldenRun(2, pipeline=2, schedule="zero_bubble", **PP)),
    "sp2-ring": Case(GoldenRun(2, sequence=2, sequence_mode="ring")),
    "sp2-all_to_all": Case(GoldenRun(2, sequence=2, sequence_mode="all_to_all")),
    "recompute-full-dp2": Case(GoldenRun(2, data=2, recompute="full")),
    "recompute-selective-dp2": Case(GoldenRun(2, data=2, recompute="selective")),
    "ep2-dp2": Case(GoldenRun(2, data=2, expert=2, accumulation=1)),
}


@pytest.fixture(scope="module", autouse=True)
def _fresh_ranks_afterwards(pools):
    """Compiling grows a rank's heap for good (dynamo's and inductor's caches, freed arenas that
    stay resident): the tests after these get fresh ranks, as tests that measure memory expect."""
    yield
    for world_size in sorted({case.run.ranks for case in CASES.values()}):
        pools.get(world_size).close()


def _train(run: GoldenRun) -> dict[str, Any]:
    torch._dynamo.reset()  # a pool's ranks outlive a test: start each compiled run from empty caches
    with tempfile.TemporaryDirectory() as offload:
        engine, model, loader = start(run, offload)
        it = iter(loader)
        losses = []
        with comm.ledger() as counted:
            for _ in range(STEPS):
                try:
                    losses.append(engine.train_batch(it))
                except StopIteration:  # the data are 8 steps long: go round again
                    it = iter(loader)
                    losses.append(engine.train_batch(it))
        weights = {k: v.clone() for k, v in full_state_dict(model).items()}
        report = engine.compile_report.as_dict() if engine.compile_report is not None else None
        engine.strategy.close()
    return {"losses": losses, "weights": weights, "report": report, "ledger": counted.summary()}


def _eager_and_compiled(name: str) -> dict[str, Any]:
    case = CASES[name]
    eager = _train(case.run)
    compiled = _train(dataclasses.replace(case.run, compile=case.backend))
    return {"eager": eager, "compiled": compiled}


@pytest.mark.parametrize("name", sorted(CASES, key=lambda n: (CASES[n].run.ranks, n)))
def test_compiled_training_equals_eager(pools, name):
    case = CASES[name]
    results = pools.run(case.run.ranks, _eager_and_compiled, name, timeout=600)
    for result in results:
        eager, compiled = result["eager"], result["compiled"]
        torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=1e-5, atol=0)
        for key, value in eager["weights"].items():  # relative in norm: Adam's steps amplify tiny differences
            drift = float((compiled["weights"][key] - value).norm() / value.norm())
            assert drift <= 1e-5, f"{name}: {key} moved {drift:.2e} (relative, in norm) from the eager run's"
        # every collective of the eager run, counted under compile too: the same calls and bytes
        if not case.exact_gathers:
            for summary in (compiled["ledger"], eager["ledger"]):
                assert summary.pop(("all_gather", "data"))["calls"] > 0
        assert compiled["ledger"] == eager["ledger"]
        report = compiled["report"]
        assert report, "the compiled run reports its regions"
        assert set(report) <= {"blocks.0", "blocks.1"} and report  # a pipeline stage runs its own blocks
        assert sum(stats["graphs"] for stats in report.values()) >= 1, report  # blocks of one shape share a graph
        for region, stats in report.items():
            assert not stats["eager"], (region, stats)
            if case.no_break:
                assert stats["graph_breaks"] == {}, (region, stats["graph_breaks"])


def _train_transformers(family: str, backend: str) -> dict[str, Any]:
    from tests.dist import test_hf_tensor as hf_case

    torch._dynamo.reset()
    config: dict[str, Any] = {"parallel": {"tensor": {"size": 2, "mode": "1d"}}}
    if backend:
        config["compile"] = {"enabled": True, "backend": backend}
    use_layout(tensor=2, config=config)
    model = hf_case.build(family)
    engine, *_ = tessera.initialize(model, hf_case.optimizer_of(model), hf_case.loss_of)
    losses = [float(engine.train_batch(iter([(x, y)]))) for x, y in hf_case.batches()]
    report = engine.compile_report.as_dict() if engine.compile_report is not None else {}
    engine.strategy.close()
    return {"losses": losses, "report": report}


def _transformers_eager_and_compiled(family: str) -> tuple[dict[str, Any], dict[str, Any]]:
    return _train_transformers(family, ""), _train_transformers(family, "aot_eager")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_compiled_transformers_model_under_its_tensor_policy_trains_as_eager(pools, family):
    """The layers a Hugging Face policy builds (1D tp2) compile per decoder layer, without a break."""
    for eager, compiled in pools.run(2, _transformers_eager_and_compiled, family, timeout=300):
        torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=1e-5, atol=0)
        layers = "transformer.h" if family == "gpt2" else "model.layers"
        assert set(compiled["report"]) == {f"{layers}.0", f"{layers}.1"}
        assert all(s["graphs"] >= 1 and not s["graph_breaks"] and not s["eager"] for s in compiled["report"].values())
