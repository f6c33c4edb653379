"""The benchmarks run end to end at tiny sizes and write well-formed rows (speed is measured by
`tessera bench`, never asserted here)."""

from __future__ import annotations

import argparse
import json

import pytest

from tessera.bench import dp, gemini, pp, tp, zero
from tessera.bench.report import Row, write_rows
from tessera.testing import within

FIELDS = {"name", "metric", "value", "anchor", "anchor_value", "ratio"}


def check(rows, tmp_path, metrics):
    path = tmp_path / "rows.json"
    write_rows(rows, path)
    data = json.loads(path.read_text())
    assert data and all(set(row) == FIELDS for row in data)
    assert {row["metric"] for row in data} >= metrics
    assert all(row["value"] > 0 and row["anchor_value"] > 0 for row in data if row["metric"] != "comm_bytes")
    return data


def test_bench_dp_rows(tmp_path, pools):
    rows = dp.run(ranks=2, micro_batch=2, seq_len=16, blocks=2, steps=1, pools=pools)
    check(rows, tmp_path, {"step_time_s", "samples_per_s"})


def test_bench_tp_rows(tmp_path, pools):
    data = check(tp.run(batch=4, seq=4, blocks=2, steps=1, ranks=4, pools=pools), tmp_path,
                 {"step_time_s", "activation_bytes", "param_bytes", "comm_bytes"})  # fmt: skip
    fractions = {row["name"].split()[2]: row["ratio"] for row in data if row["metric"] == "param_bytes"}
    # the memory columns, 1/P and 1/q^2, plus the small replicated norms and biases
    assert 0.25 <= fractions["1d"] < 0.251 and 0.25 <= fractions["2d"] < 0.251


def test_bench_tp_token_sweep_gives_the_crossover_against_1d(tmp_path, pools):
    rows = tp.run(seq=4, blocks=1, steps=1, ranks=4, tokens=[16, 64], pools=pools)
    data = check(rows, tmp_path, {"step_time_s", "activation_bytes", "comm_bytes", "crossover_tokens"})
    names = {row["name"] for row in data if row["metric"] == "comm_bytes"}
    assert names == {f"block h1024 {case} tp4 b{b}x4" for case in ("1d", "2d", "2d-keep") for b in (4, 16)}
    crossing = {row["name"]: row["value"] for row in data if row["metric"] == "crossover_tokens"}
    # the ledger formulas (tests/dist/test_tp_ledger.py) on this block: weight term / (1D's - 2D's bytes per token)
    assert crossing.keys() == {"block h1024 2d tp4", "block h1024 2d-keep tp4"}
    assert abs(crossing["block h1024 2d tp4"] - 37_775_360 / (24_576 - 11_280)) < 1e-6
    assert abs(crossing["block h1024 2d-keep tp4"] - 25_192_448 / (24_576 - 8_208)) < 1e-6
    kept = {row["name"].split()[2]: row["value"] for row in data if row["metric"] == "activation_bytes"}
    assert kept["2d-keep"] > kept["2d"]  # the blocks kept for backward


def test_tp_crossover_rows_come_from_the_comm_rows():
    def comm(case, batch, value):
        return Row(f"block h1024 {case} tp8 b{batch}x32", "comm_bytes", value, "tessera 1d tp8", 1)

    rows = [comm("1d", b, 1000 * b * 32) for b in (4, 32, 128)]  # 1D: 1000 bytes per token
    rows += [comm("3d", b, 500_000 + 500 * b * 32) for b in (4, 32, 128)]  # crosses at 1000 tokens
    rows += [comm("2.5d-d2", b, 2000 * b * 32) for b in (4, 32, 128)]  # never below 1D
    (row,) = tp.crossover_rows(rows)
    assert (row.name, row.metric, row.value, row.anchor_value) == ("block h1024 3d tp8", "crossover_tokens", 1000, 1028)
    with pytest.raises(ValueError, match="off the line"):
        tp.crossover_rows([*rows[:5], comm("3d", 128, 1)])


def test_bench_pp_rows(tmp_path, pools):
    # the bubble measured on stages that sleep 10 ms a unit, one step (the bench: 50 ms, the least of 3)
    rows = pp.run(ranks=[2], hidden=32, layers=4, micro_batch=2, microbatches=4, blocks=2, steps=1,
                  bubble_unit_s=0.01, bubble_repeats=1, pools=pools)  # fmt: skip
    data = check(rows, tmp_path, {"step_time_s", "bubble_pred", "bubble_measured"})
    assert {row["name"].split()[1] for row in data} == {"gpipe", "1f1b", "interleaved-v2", "zero_bubble"}


def test_bench_zero_rows(tmp_path, pools):
    losses = {}
    rows = zero.run(
        ranks=[2], preset="tiny", seq_len=16, micro_batch=2, blocks=2, steps=1, memory_steps=1, losses=losses,
        pools=pools,
    )  # fmt: skip
    data = check(rows, tmp_path, {"step_time_s", "peak_rss_setup_bytes", "peak_rss_train_bytes", "peak_rss_bytes"})
    ds = zero.deepspeed_available()  # CI does not install the bench extra: then its rows are absent
    expected = {("zero1", "DeepSpeed ZeRO-1"), ("zero2", "DeepSpeed ZeRO-2"), ("zero2", "torch FSDP2 no-reshard"),
                ("zero3", "torch FSDP2"), ("zero3", "DeepSpeed ZeRO-3"), ("offload", "DeepSpeed ZeRO-Offload")}  # fmt: skip
    pairs = {(row["name"].split()[0], row["anchor"].split(" (")[0]) for row in data if row["metric"] == "step_time_s"}
    assert pairs == {p for p in expected if ds or "DeepSpeed" not in p[1]}
    # every side took the same steps on the same data from the same weights: the same loss as
    # tessera's (fp32; DeepSpeed's CPU Adam rounds slightly differently)
    reference = losses["tessera zero1 dp2"]
    assert len(losses) == (10 if ds else 6)
    for side, value in losses.items():  # gpt("tiny"): 4 blocks, a warm-up, 2 timed and a memory step
        assert within(value, reference, blocks=4, steps=4), (side, value, reference)


def test_bench_zero_says_when_deepspeed_is_absent(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(zero, "deepspeed_available", lambda: False)
    monkeypatch.setattr(zero, "run", lambda **kwargs: calls.append(kwargs) or [])
    assert zero.main(argparse.Namespace(ranks=2, out=None)) == 0
    assert calls[0]["ranks"] == [2] and calls[0]["with_deepspeed"] is False
    assert "DeepSpeed is not installed: its rows are absent" in capsys.readouterr().out


def test_bench_gemini_rows(tmp_path, pools):
    from tessera.bench.zero_sides import Workload

    # the budget run at a tiny size: a GPT of 4x the host budget through the disk tier, on one rank
    run = gemini.BudgetRun(d_model=64, n_layers=4, seq_len=16, micro_batch=2, host_budget=800_000,
                           device_budget=2_000_000, steps=2)  # fmt: skip
    rows, outcome = gemini.budget_rows(run, pools)
    check(rows, tmp_path, {"peak_rss_bytes"})
    assert outcome["state_bytes"] >= 4 * run.host_budget
    assert outcome["gemini"]["report"]["disk_written_bytes"] > 0
    assert outcome["gemini"]["losses"] == outcome["reference"]["losses"], "the same losses as plain PyTorch"
    if not gemini.deepspeed_available():  # CI does not install the bench extra: no DeepSpeed rows
        return
    losses = {}
    rows = gemini.run(Workload("tiny", 16, 2), blocks=2, steps=1, memory_steps=1, rows_wanted=("cpu",), losses=losses,
                      pools=pools)  # fmt: skip
    data = check(rows, tmp_path, {"step_time_s", "peak_rss_bytes"})
    assert {row["anchor"] for row in data} == {"DeepSpeed ZeRO-3 cpu offload"}
    ours, theirs = losses["tessera gemini auto"], losses["DeepSpeed ZeRO-3 cpu offload"]
    assert within(ours, theirs, blocks=4, steps=4), (ours, theirs)  # as test_bench_zero_rows


def test_bench_gemini_largest_model_search(pools):
    import torch

    from tessera.bench.gemini_largest import Largest, largest

    search = Largest(budget=256 * 2**20, d_model=32, seq_len=16, layers=(1, 2), steps=1)
    params, seen = largest("tessera", search, pools=pools)
    assert set(seen) == {1, 2} and all(g is not None and 0 < g <= search.budget for g in seen.values()), seen
    with torch.device("meta"):
        assert params == sum(p.numel() for p in search.model(2).parameters()), "both sizes fit: the larger counts"
    # a budget nothing fits: the search stops at the first size and finds none
    params, seen = largest("tessera", Largest(budget=1, d_model=32, seq_len=16, layers=(1, 2), steps=1), pools=pools)
    assert params == 0 and list(seen) == [1]


def test_bench_recompute_rows(tmp_path, pools):
    from tessera.bench import recompute

    rows = recompute.run(blocks=2, steps=1, preset="tiny", batch=2, seq=32, pools=pools)
    data = check(rows, tmp_path, {"saved_bytes", "step_time_s"})
    saved = {row["name"].rsplit(" ", 1)[-1]: row["ratio"] for row in data if row["metric"] == "saved_bytes"}
    assert saved["full"] < saved["selective"] < 1.0, saved


def test_bench_sp_rows(tmp_path, pools):
    from tessera.bench import sp

    # 2 ranks only (the bench's 4-rank sides run the same code on a larger pool)
    search = sp.Search(budget=256 * 2**20, grain=64, max_length=128, bisections=0, d_model=32, ranks=(2,))
    rows, found = sp.longest_rows(search, pools)
    data = check(rows, tmp_path, {"tokens"})
    assert len(data) == 1 * 2 * 3  # one rank count x three modes x (vs one rank, vs tensor parallelism)
    assert all(set(seen) == {64, 128} for seen in found.values()), found  # both lengths fit a generous budget
    # tessera's side of the speed rows (torch's context_parallel pays ~10 s a rank on its first
    # call, so the peer runs in the bench, not here)
    for out in pools.run(2, sp.speed_body, 2, 1, 256, peer=False):
        assert set(out["times"]) == {"tessera ring"} and all(t > 0 for t in out["times"]["tessera ring"])
