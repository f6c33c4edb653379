"""``tessera bench rlhf-generate`` runs end to end at a tiny size and writes well-formed rows whose
ratio is taken against the full forward per token measured in the same run, after both sides
gave the same greedy tokens (speed is measured by the benchmark, never asserted here)."""

from __future__ import annotations

import statistics

import pytest

from tessera.bench import rlhf_generate as bench
from tessera.bench.report import Row
from tessera.cli import BENCH_TARGETS, build_parser
from tests.e2e.test_bench import check

TINY = bench.Workload(
    prompt=4, new_tokens=6, batches=(1, 3), repeats=2, overrides=dict(d_model=32, n_layers=2, n_heads=4)
)


def test_bench_rlhf_generate_rows(tmp_path):
    report: dict = {}
    data = check(bench.run(TINY, report), tmp_path, {"tokens_per_s"})
    names = [f"rlhf-generate gpt-tiny 4+6 b{b}" for b in (1, 3)]
    assert [row["name"] for row in data] == names and {row["anchor"] for row in data} == {bench.ANCHOR}
    for row, batch in zip(data, (1, 3)):
        result = report[row["name"]]
        greedy = result["greedy"]
        assert greedy[bench.TESSERA] == greedy[bench.ANCHOR] and len(greedy[bench.TESSERA]) == batch
        assert all(len(tokens) == 6 for tokens in greedy[bench.TESSERA])
        seconds = result["seconds"]
        assert all(len(times) == 2 for times in seconds.values())
        assert row["value"] == pytest.approx(batch * 6 / statistics.median(seconds[bench.TESSERA]))
        assert row["anchor_value"] == pytest.approx(batch * 6 / statistics.median(seconds[bench.ANCHOR]))


def test_bench_rlhf_generate_refuses_sides_that_generate_different_tokens():
    bench.check_tokens(2, {bench.TESSERA: [[1, 2], [3]], bench.ANCHOR: [[1, 2], [3]]})
    with pytest.raises(RuntimeError, match=r"batch 2, prompt 1: .* from token 1 \(\[4\] against \[5\]\)"):
        bench.check_tokens(2, {bench.TESSERA: [[1, 2], [3, 4]], bench.ANCHOR: [[1, 2], [3, 5]]})


def test_bench_rlhf_generate_is_a_bench_target():
    args = build_parser().parse_args(["bench", "rlhf-generate", "--out", "rlhf-generate.json"])
    assert (args.target, args.out) == ("rlhf-generate", "rlhf-generate.json")
    assert BENCH_TARGETS["rlhf-generate"] == "tessera.bench.rlhf_generate:main"
    rows = bench.rows_of(TINY, 3, {bench.TESSERA: [0.1, 0.3, 0.2], bench.ANCHOR: [1.0, 2.0, 3.0]})
    assert rows == [Row("rlhf-generate gpt-tiny 4+6 b3", "tokens_per_s", 18 / 0.2, bench.ANCHOR, 18 / 2.0)]


def test_bench_rlhf_generate_inside_ppo_rows(tmp_path):
    report: dict = {}
    w = bench.Workload(
        prompt=4, new_tokens=6, repeats=2, ppo_batch=4, overrides=dict(d_model=32, n_layers=2, n_heads=4)
    )
    data = check(bench.ppo_rows(w, report), tmp_path, {"tokens_per_s", "steps_per_s"})
    tag = "rlhf-generate gpt-tiny 4+6 ppo b4"
    assert [row["name"] for row in data] == [f"{tag} rollout", f"{tag} step"]
    result = report[tag]
    for name in (bench.TESSERA, bench.ANCHOR):
        assert len(result["rollout_seconds"][name]) == len(result["step_seconds"][name]) == 2
        assert all(r < s for r, s in zip(result["rollout_seconds"][name], result["step_seconds"][name]))
    assert data[0]["value"] == pytest.approx(4 * 6 / statistics.median(result["rollout_seconds"][bench.TESSERA]))
    assert data[1]["anchor_value"] == pytest.approx(1 / statistics.median(result["step_seconds"][bench.ANCHOR]))
