"""``tessera bench ckpt`` runs end to end at a tiny size and writes well-formed rows; both sides
write the same bytes (speed is measured by the benchmark, never asserted here)."""

from __future__ import annotations

from tessera.bench import ckpt
from tests.e2e.test_bench import check


def test_bench_ckpt_rows(tmp_path, pools):
    w = ckpt.Workload(preset="tiny", seq_len=16, micro_batch=2, reps=1, widths=(("zero3", 64),), stall_ranks=2)
    rows = ckpt.run(ranks=2, w=w, root=str(tmp_path), pools=pools)
    data = check(rows, tmp_path, {"save_time_s", "load_time_s", "bytes_per_rank", "bytes_total", "async_stall_s"})
    names = {row["name"] for row in data}
    assert names == {"ddp dp2 gpt-tiny", "zero3 dp2 gpt-tiny", "zero3 dp2 gpt-tiny d64"}
    stalls = {row["name"] for row in data if row["metric"] == "async_stall_s"}
    assert stalls == names  # each layout's, and the other width's alone
    for row in data:
        if row["metric"] == "bytes_total":  # the same tensors on both sides
            assert 0.9 < row["ratio"] < 1.1, row
        if row["metric"] == "bytes_per_rank" and row["anchor"].startswith("state share"):
            assert 1.0 <= row["ratio"] < 1.1, row  # the rank's share, plus its report (and the index)
    assert list(tmp_path.glob("tessera-bench-ckpt-*")) == []  # the checkpoints are removed
