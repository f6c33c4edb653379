"""``tessera bench moe`` runs end to end at a tiny size and writes well-formed rows whose ratios
are taken against the dense GPT measured in the same run; DeepSpeed-MoE's rows are there when
DeepSpeed is installed and absent, with the reason said, when it is not (speed is measured by
the benchmark, never asserted here)."""

from __future__ import annotations

import argparse
import statistics

import pytest

from tessera.bench import moe
from tessera.bench.report import Row
from tessera.models import gpt
from tessera.testing import tolerance
from tests.e2e.test_bench import check

# without capacity drops and auxiliary losses, where tessera's and DeepSpeed's MoE compute the same
TINY = moe.Workload(
    seq_len=16, micro_batch=2, distinct_batches=1,
    overrides=dict(d_model=32, n_layers=2, n_heads=4, d_ff=32, num_experts=4, moe_capacity_factor=None,
                   moe_aux_loss_weight=0.0, moe_z_loss_weight=0.0),
)  # fmt: skip


def test_bench_moe_rows(tmp_path, pools):
    report: dict = {}
    layout = moe.Layout(ranks=2, expert=2)
    ds = moe.deepspeed_available()  # CI does not install the bench extra: then its rows are absent
    rows = moe.run(TINY, [layout], blocks=2, steps=1, with_deepspeed=ds, report=report, pools=pools)
    data = check(rows, tmp_path, {"step_time_s", "tokens_per_s", "params_total", "params_active"})
    name = "ep2 dp2 gpt-tiny-moe b2x16"
    dense, deepspeed = "dense GPT ff96", "DeepSpeed-MoE ep2"  # 2 experts of 3 x d x 32: 2 x d x 96 dense
    assert {row["name"] for row in data} == {name}
    assert {row["anchor"] for row in data} == ({dense, deepspeed} if ds else {dense}), report[name]["errors"]
    # the ratios are against the sides' medians in this run
    result = report[name]
    median = {label: statistics.median(times) for label, times in result["times"].items()}
    assert all(len(times) == 2 for times in result["times"].values())
    by = {(row["metric"], row["anchor"]): row for row in data}
    step = by["step_time_s", dense]
    assert (step["value"], step["anchor_value"]) == (median[moe.TESSERA], median[moe.DENSE])
    tokens = by["tokens_per_s", dense]
    assert tokens["value"] == pytest.approx(2 * 16 * 2 / median[moe.TESSERA])
    assert tokens["ratio"] == pytest.approx(1 / step["ratio"])
    # 2 of 4 experts active: half the experts' weights idle; the dense MLP's biases against the router
    total, active = by["params_total", dense], by["params_active", dense]
    assert total["anchor_value"] == active["anchor_value"]
    assert total["value"] - active["value"] == 2 * (3 * 32 * 32 * 4) / 2
    assert active["value"] - active["anchor_value"] == 2 * (32 * 4 - (96 + 32))
    # one warm-up and two timed steps on the same batch: it trains
    losses = result["losses"]
    assert all(len(values) == 3 for values in losses.values())
    assert losses[moe.TESSERA][-1] < losses[moe.TESSERA][0]
    if ds:  # the same weights and batches, no drops, no auxiliary losses: the same losses every step
        assert by["step_time_s", deepspeed]["anchor_value"] == median[moe.DEEPSPEED]
        bound = tolerance(blocks=2, steps=3)["rtol"]  # 2 layers, 3 steps
        assert result["worst"] <= bound, (losses[moe.TESSERA], losses[moe.DEEPSPEED])
    lines = moe.table(TINY, report).splitlines()
    assert len(lines) == 2 + (3 if ds else 2) and all(line.startswith(f"| {name} |") for line in lines[2:])


def test_bench_moe_rows_without_deepspeed_compare_with_the_dense_gpt_alone():
    result = {
        "times": {moe.TESSERA: [0.3, 0.2, 0.4], moe.DENSE: [0.1, 0.3, 0.2]},
        "losses": {moe.TESSERA: [5.5, 5.4], moe.DENSE: [5.5, 5.3]},
        "errors": {moe.DEEPSPEED: "RuntimeError: no all-to-all here"},
        "params": {moe.TESSERA: (100, 60), moe.DENSE: (58, 58)},
        "ranks": 2,
    }
    layout = moe.Layout(2, 2)
    rows = moe.rows_of(layout, TINY, result)
    name = "ep2 dp2 gpt-tiny-moe b2x16"
    assert rows == [
        Row(name, "step_time_s", 0.3, "dense GPT ff96", 0.2),
        Row(name, "tokens_per_s", 64 / 0.3, "dense GPT ff96", 64 / 0.2),
        Row(name, "params_total", 100.0, "dense GPT ff96", 58.0),
        Row(name, "params_active", 60.0, "dense GPT ff96", 58.0),
    ]
    table = moe.table(TINY, {name: result})
    assert f"| {name} | {moe.DEEPSPEED} | | | did not run: RuntimeError: no all-to-all here |" in table
    assert f"| {name} | tessera MoE | 100 | 60 | 0.3000 | 213 | 1.500 | 5.4000 |" in table


def test_bench_moe_says_when_deepspeed_is_absent(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(moe, "deepspeed_available", lambda: False)
    monkeypatch.setattr(moe, "run", lambda *args, **kwargs: calls.append((args, kwargs)) or [])
    assert moe.main(argparse.Namespace(ranks=4, out=None)) == 0
    (args, kwargs), = calls  # fmt: skip
    assert args[1] == [moe.Layout(4, 1), moe.Layout(4, 2), moe.Layout(4, 4)] and kwargs["with_deepspeed"] is False
    assert "DeepSpeed is not installed: its rows are absent" in capsys.readouterr().out


def test_the_dense_anchor_has_the_moe_active_parameters():
    for preset, width in (("tiny-moe", 768), ("small-moe", 1536)):  # 2 SwiGLU experts of d_ff: 3 x 2 x d_ff / 2
        config = moe.Workload(preset).moe_config()
        assert moe.dense_ff_dim(config) == width
    assert moe.dense_ff_dim(moe.Workload(overrides={"moe_activation": "gelu"}).moe_config()) == 2 * 256
    total, active = moe.parameter_counts(gpt("tiny-moe"))
    dense_total, dense_active = moe.parameter_counts(gpt("tiny-moe", num_experts=0, d_ff=768))
    assert dense_total == dense_active and total - active == 4 * 6 * (3 * 128 * 256)  # 6 idle experts a block
    assert active - dense_active == 4 * (128 * 8 - (768 + 128))  # the router against the dense MLP's biases
    with pytest.raises(ValueError, match="needs an MoE preset"):
        moe.Workload("tiny").moe_config()


def test_bench_moe_refuses_a_deepspeed_side_that_trains_something_else():
    ours = [5.5, 5.4, 5.3]
    assert moe.check_losses({moe.TESSERA: ours, moe.DENSE: [6.0, 5.0, 4.0]}) is None
    assert moe.check_losses({moe.TESSERA: ours, moe.DEEPSPEED: list(ours)}) == 0.0
    with pytest.raises(RuntimeError, match="first-step losses"):
        moe.check_losses({moe.TESSERA: ours, moe.DEEPSPEED: [5.51, 5.4, 5.3]})
    with pytest.raises(RuntimeError, match="largest difference over 3 steps"):
        moe.check_losses({moe.TESSERA: ours, moe.DEEPSPEED: [5.5, 5.4, 5.8]})
