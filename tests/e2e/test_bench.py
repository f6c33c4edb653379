"""The benchmarks run end to end at tiny sizes and write well-formed rows (speed is measured by
`tessera bench`, never asserted here)."""

from __future__ import annotations

import json

from tessera.bench import dp, pp, tp
from tessera.bench.report import write_rows

FIELDS = {"name", "metric", "value", "anchor", "anchor_value", "ratio"}


def check(rows, tmp_path, metrics):
    path = tmp_path / "rows.json"
    write_rows(rows, path)
    data = json.loads(path.read_text())
    assert data and all(set(row) == FIELDS for row in data)
    assert {row["metric"] for row in data} >= metrics
    assert all(row["value"] > 0 and row["anchor_value"] > 0 for row in data if row["metric"] != "comm_bytes")
    return data


def test_bench_dp_rows(tmp_path):
    check(dp.run(ranks=2, micro_batch=2, seq_len=16, blocks=2, steps=1), tmp_path, {"step_time_s", "samples_per_s"})


def test_bench_tp_rows(tmp_path):
    data = check(tp.run(batch=4, seq=4, blocks=2, steps=1, ranks=4), tmp_path,
                 {"step_time_s", "activation_bytes", "param_bytes", "comm_bytes"})  # fmt: skip
    fractions = {row["name"].split()[2]: row["ratio"] for row in data if row["metric"] == "param_bytes"}
    # the memory columns, 1/P and 1/q^2, plus the small replicated norms and biases
    assert 0.25 <= fractions["1d"] < 0.251 and 0.25 <= fractions["2d"] < 0.251


def test_bench_pp_rows(tmp_path):
    data = check(pp.run(ranks=[2], hidden=32, layers=4, blocks=2, steps=1), tmp_path, {"step_time_s"})
    assert {row["name"].split()[1] for row in data} == {"gpipe", "1f1b", "interleaved-v2", "zero_bubble"}
