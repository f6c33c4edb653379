"""``tessera bench serve`` runs end to end at a tiny size and writes well-formed rows: both
decode sides give the same greedy tokens (the run checks it), and the real server answers
concurrent streamed clients (speed is measured by the benchmark, never asserted here)."""

from __future__ import annotations

import pytest

from tessera.bench import serve
from tests.e2e.test_bench import check

TINY = serve.Workload(
    vocab=256, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, prompt=6, new_tokens=6,
    batches=(1, 3), repeats=2, clients=3, rounds=1,
)  # fmt: skip


def test_bench_serve_rows(tmp_path):
    data = check(serve.run(TINY), tmp_path, {"tokens_per_s", "ttft_median_s", "ttft_p90_s"})
    tag = "llama h32 l2 6+6"
    assert [(row["name"], row["metric"], row["anchor"]) for row in data] == [
        (f"decode {tag} b1", "tokens_per_s", serve.HF_GENERATE),
        (f"decode {tag} b3", "tokens_per_s", serve.HF_GENERATE),
        (f"serve {tag} c3", "ttft_median_s", serve.ALONE),
        (f"serve {tag} c3", "ttft_p90_s", serve.ALONE),
        (f"serve {tag} c3", "tokens_per_s", serve.ALONE),
    ]
    ttft = {row["metric"]: row for row in data if row["metric"].startswith("ttft")}
    assert ttft["ttft_median_s"]["value"] <= ttft["ttft_p90_s"]["value"] < 60


def test_bench_serve_refuses_sides_that_generate_something_else():
    same = [[1, 2, 3], [4, 5, 6]]
    serve.check_tokens(2, {serve.TESSERA: same, serve.HF_GENERATE: [list(t) for t in same]})
    with pytest.raises(RuntimeError, match="prompt 1: .* from token 2"):
        serve.check_tokens(2, {serve.TESSERA: same, serve.HF_GENERATE: [[1, 2, 3], [4, 5, 7]]})


def test_nearest_rank_quantile():
    values = [0.5, 0.1, 0.4, 0.2, 0.3, 0.9, 0.6, 0.8, 0.7, 1.0]
    assert serve.nearest_rank(values, 0.9) == 0.9
    assert serve.nearest_rank(values, 0.5) == 0.5
    assert serve.nearest_rank([2.0], 0.9) == 2.0
