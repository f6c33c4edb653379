"""``tessera bench hf`` runs end to end at a tiny size and writes well-formed rows; every side
trains the same model on the same batches to the same losses (speed is measured by the
benchmark, never asserted here)."""

from __future__ import annotations

import pytest

from tessera.bench import hf
from tessera.testing import tolerance
from tests.e2e.test_bench import check


def test_bench_hf_rows(tmp_path, pools):
    w = hf.Workload(hidden=64, layers=2, intermediate=128, seq=16, batch=2, ranks=2, distinct_batches=2)
    report: dict = {}
    rows = hf.run(w, blocks=2, steps=1, report=report, pools=pools)
    data = check(rows, tmp_path, {"step_time_s", "tokens_per_s", "collectives_per_step", "loss_first", "loss_last"})
    anchors = {row["anchor"] for row in data}
    ds = hf.deepspeed_available()  # CI does not install the bench extra: then its rows are absent
    assert anchors == ({hf.TORCH, hf.DEEPSPEED} if ds else {hf.TORCH}), (anchors, report["errors"])
    assert {row["name"] for row in data} == {"hf llama h64 l2 v1000 tp2 b2x16"}
    # a warm-up step, two timed ones and a counted one, the same losses on every side
    assert all(len(losses) == 4 for losses in report["losses"].values())
    for row in data:  # the ratio of the sides' losses: 2 layers, after at most 4 steps
        if row["metric"].startswith("loss"):
            assert abs(row["ratio"] - 1.0) <= 2 * tolerance(blocks=2, steps=4)["rtol"], row
    assert report["losses"][hf.TESSERA][-1] < report["losses"][hf.TESSERA][0]  # it trains
    # per layer one all-reduce forward and one backward per block (attention, MLP); the embedding's
    # forward, the head's input gradient and the logits' all-gather
    counted = {row["anchor"]: row["value"] for row in data if row["metric"] == "collectives_per_step"}
    assert set(counted.values()) == {4 * w.layers + 3}, counted


def test_bench_hf_refuses_sides_that_train_something_else():
    ours = [6.9, 6.8, 6.7]
    assert hf.check_losses({hf.TESSERA: ours, hf.TORCH: list(ours)}) == {hf.TORCH: 0.0}
    with pytest.raises(RuntimeError, match="first-step losses"):
        hf.check_losses({hf.TESSERA: ours, hf.TORCH: [6.91, 6.8, 6.7]})
    with pytest.raises(RuntimeError, match="largest difference over 3 steps"):
        hf.check_losses({hf.TESSERA: ours, hf.TORCH: [6.9, 6.8, 6.8]})
