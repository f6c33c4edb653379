"""The At-scale scenarios (docs/planner.md): a 70B LLaMA-shaped model on 1,024 simulated A100s, and
the Colossal-AI paper's 64-GPU ViT and GPT-3 settings. The best layout fits, beats the baselines
(pure ZeRO-3, pure 1D tensor parallelism, the layouts reported for the setting) by predicted step
time or they do not fit, and the table says why. How long planning takes is measured by
`tessera bench plan --scenarios` (docs/benchmarks.md), not asserted here."""

from __future__ import annotations

import pytest

from tessera.planner.scenarios import HARDWARE, SCENARIOS
from tessera.planner.search import Plan


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    return {name: scenario.run() for name, scenario in SCENARIOS.items()}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_best_layout_fits_and_beats_every_baseline(plans, name):
    result = plans[name]
    best = result.best
    assert best.fits and best.memory.peak <= result.cluster.device_memory
    assert best.layout.world == result.cluster.devices and best.layout.global_batch == result.workload.global_batch
    for label, baseline in result.baselines.items():
        assert baseline is not None, f"{name}: {label} has no layout that can run"
        assert not baseline.fits or best.time.step <= baseline.time.step, f"{name}: {label} is faster"
    table = result.table()
    reasons = result.reasons(0)
    for label in result.baselines:
        assert label in table
        assert any(r.startswith(f"vs {label}: ") or r == f"it is the {label} layout" for r in reasons), label


def test_the_70b_plan_shows_why_it_beats_pure_zero3_and_pure_1d(plans):
    result = plans["llama70b-1024"]
    reasons = dict(r.split(": ", 1) for r in result.reasons(0) if r.startswith("vs pure"))
    tp = next(label for label in result.baselines if label.startswith("pure 1D"))
    assert not result.baselines[tp].fits and reasons[f"vs {tp}"].startswith("fits (")  # 70B does not fit 8 ways
    zero3 = result.baselines["pure ZeRO-3"]
    assert zero3.fits and "shorter step" in reasons["vs pure ZeRO-3"]
    assert "across nodes" in reasons["vs pure ZeRO-3"]  # ZeRO-3's gathers cross InfiniBand


def test_the_paper_layouts_are_shown_beside_ours(plans):
    for name in ("colossal-vit-64", "colossal-gpt3-64"):
        result = plans[name]
        table = result.table()
        for label in result.reported:
            shown = [line for line in table.splitlines() if f"[{label}]" in line]
            assert len(shown) == 1, label
            assert shown[0].startswith("paper") or shown[0].split()[0].isdigit()  # below the ranking, or in it
    vit = plans["colossal-vit-64"]
    modes = {vit.baselines[f"paper: {m}"].layout.tensor_mode for m in ("1D tp64", "2D tp64", "2.5D tp64 d4", "3D tp64")}
    assert modes == {"1d", "2d", "2.5d", "3d"}


def test_hardware_figures_make_clusters():
    a100 = HARDWARE["a100-80gb"].cluster(1024, dtype="bf16")
    assert (a100.devices, a100.devices_per_node, a100.nodes) == (1024, 8, 128)
    assert a100.flops == 156e12 and a100.device_memory == 78 * 2**30
    assert a100.intra.bandwidth > 5 * a100.inter.bandwidth
