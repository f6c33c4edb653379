"""``tessera bench compile`` runs end to end at a tiny size (``aot_eager``: no C++ build) and writes
well-formed rows whose ratios are taken against the sides measured in the same run: tessera's
engine eager and compiled, and FSDP2 with each block compiled beside ZeRO-3 (speed is measured
by the benchmark, never asserted here)."""

from __future__ import annotations

import argparse
import statistics

import pytest
import torch

from tessera.bench import compiled
from tessera.bench.compiled_sides import COMPILED, EAGER, FSDP2, STARTUP, Workload
from tessera.bench.report import Row
from tessera.cli import BENCH_TARGETS, build_parser
from tessera.engine.flops import flops_per_token, mfu
from tessera.errors import ConfigError
from tessera.models import gpt
from tests.e2e.test_bench import check

TINY = Workload(
    "tiny", seq_len=16, global_batch=4, backend="aot_eager", overrides=dict(d_model=32, n_layers=2, n_heads=4)
)


def test_bench_compile_rows(tmp_path, pools):
    report: dict = {}
    rows = compiled.run([TINY], ("zero3-dp2",), blocks=2, steps=1, peak_size=64, pools=pools, report=report)
    data = check(rows, tmp_path, {"tokens_per_s", "mfu", "step_time_s", "compile_cold_s", "compile_warm_s"})
    (result,) = report["results"]
    name = "zero3-dp2 gpt-tiny b4x16 aot_eager"
    assert {row["name"] for row in data} == {name} and not result.errors
    assert {(row["metric"], row["anchor"]) for row in data} == {
        ("tokens_per_s", EAGER), ("mfu", EAGER), ("step_time_s", EAGER), ("compile_cold_s", f"{EAGER} step"),
        ("compile_warm_s", "cold compile"), ("step_time_s", FSDP2), ("tokens_per_s", FSDP2), ("mfu", FSDP2),
        ("compile_cold_s", FSDP2), ("compile_warm_s", FSDP2),
    }  # fmt: skip
    # every side ran its eager step, its first compiled step and the timed blocks, from the same weights
    assert all(len(result.times[label]) == 2 for label in (EAGER, COMPILED, FSDP2))
    # tessera: its eager step and the eager blocks; its first compiled step and the compiled
    # blocks; FSDP2: its eager step, its first compiled step and its blocks
    assert {label: len(values) for label, values in result.losses.items()} == {EAGER: 3, COMPILED: 3, FSDP2: 4}
    assert result.losses[EAGER][0] == pytest.approx(result.losses[FSDP2][0], rel=1e-4)
    assert set(result.first) == set(result.warm) == {COMPILED, FSDP2, STARTUP}
    assert sum(stats["graphs"] for stats in result.report.values()) >= 1, result.report
    # the ratios are against the medians of this run
    by = {(row["metric"], row["anchor"]): row for row in data}
    tokens = 4 * 16
    ours = statistics.median(result.times[COMPILED])
    assert by["step_time_s", FSDP2]["value"] == ours
    assert by["step_time_s", FSDP2]["anchor_value"] == statistics.median(result.times[FSDP2])
    assert by["tokens_per_s", EAGER]["value"] == pytest.approx(tokens / ours)
    assert by["compile_cold_s", FSDP2]["value"] == pytest.approx(result.first[COMPILED] - ours)
    with torch.device("meta"):
        per_token = flops_per_token(TINY.model(), 16)
    assert by["mfu", EAGER]["value"] == pytest.approx(mfu(tokens / ours, per_token, 2, report["peak"]))
    assert report["peak"] == max(result.peaks) and len(result.peaks) == 2
    lines = report["table"].splitlines()
    assert len(lines) == 5 and all(line.startswith(f"| {name} |") for line in lines[2:])


def test_flops_per_token_counts_the_matmul_weights_once():
    with torch.device("meta"):
        model = gpt("gpt2", max_seq_len=128)
    # GPT-2 small: 124,439,808 parameters with 1,024 positions; without the position embedding
    # 123,653,376 (the tied embedding once), and attention's 12 L d s
    assert flops_per_token(model, 128) == 6 * 123_653_376 + 12 * 12 * 768 * 128
    assert mfu(100.0, 1e9, 2, 1e11) == pytest.approx(0.5)


def test_bench_compile_is_a_bench_target_with_a_selection():
    args = build_parser().parse_args(["bench", "compile", "--only", "dp2,gpt2", "--out", "compile.json"])
    assert (args.target, args.only, args.out) == ("compile", "dp2,gpt2", "compile.json")
    assert BENCH_TARGETS["compile"] == "tessera.bench.compiled:main"
    assert compiled.selection("dp2,gpt2") == ([compiled.WORKLOADS["gpt2"]], ("dp2",))
    assert compiled.selection("gpt2-medium") == ([compiled.WORKLOADS["gpt2-medium"]], compiled.LAYOUTS)
    assert compiled.selection(None) == ([compiled.WORKLOADS["gpt2"]], compiled.LAYOUTS)
    with pytest.raises(ConfigError, match=r"--only tp4: not a layout"):
        compiled.main(argparse.Namespace(only="tp4", out=None))
    result = compiled.Result("dp2", TINY, {EAGER: [0.2, 0.4, 0.3], COMPILED: [0.1, 0.2, 0.3]},
                             {COMPILED: 2.2}, {COMPILED: 0.5}, [1e9, 2e9])  # fmt: skip
    rows = compiled.rows_of(result, peak=2e9)
    name = "dp2 gpt-tiny b4x16 aot_eager"
    assert rows[0] == Row(name, "tokens_per_s", 64 / 0.2, EAGER, 64 / 0.3)
    assert rows[3:] == [Row(name, "compile_cold_s", 2.0, f"{EAGER} step", 0.3),
                        Row(name, "compile_warm_s", 0.5, "cold compile", 2.0)]  # fmt: skip
