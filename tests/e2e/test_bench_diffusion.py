"""``tessera bench diffusion``'s UNet rows at tiny sizes on 2 ranks: plain DDP, ZeRO-3 with
checkpointed blocks and Gemini with its model state on disk train the same UNet on the same
batches to the same losses and give rows against DDP (the memory ratios themselves come from the
bench's fresh processes, docs/benchmarks.md); the widest-UNet search stops at the first width
over the budget."""

from __future__ import annotations

import pytest

from tessera.bench import diffusion
from tessera.bench.diffusion_sides import UNetCase
from tests.e2e.test_bench import check

TINY = UNetCase(width=16, image_size=16, batch=4, steps=2, lr=1e-3)


def test_bench_diffusion_unet_rows(tmp_path, pools):
    sides = ("ddp", "zero3+ckpt", "gemini")
    rows, found = diffusion.unet_rows(TINY, sides, ranks=2, pools=pools)
    metrics = ("peak_rss_mib", "setup_peak_mib", "step_time_s")
    data = check(rows, tmp_path, set(metrics))
    assert [(row["name"], row["metric"]) for row in data] == [
        (f"unet w16 {side} x2", metric) for side in sides[1:] for metric in metrics
    ]
    assert all(row["anchor"] == "torch DDP" for row in data)
    reference = found["ddp"]["losses"]
    assert len(reference) == 2
    for side in sides[1:]:  # the same weights, batches and noise: DDP's losses (fp32, summed in other orders)
        assert found[side]["losses"] == pytest.approx(reference, rel=1e-5), side
        assert found[side]["parameters"] == found["ddp"]["parameters"]
    assert diffusion.lowest(found) in sides[1:]


def test_the_widest_unet_search_stops_at_the_first_width_over_the_budget(monkeypatch):
    peaks = {16: 100, 32: 200, 48: 300, 64: 400}
    monkeypatch.setattr(diffusion, "run_side", lambda side, case, ranks, pools: {
        "peak": peaks[case.width], "parameters": case.width**2})  # fmt: skip
    search = diffusion.Widest(budget=250, widths=(16, 32, 48, 64))
    params, seen = diffusion.widest("zero3", search, TINY)
    assert params == 32**2 and seen == {16: 100, 32: 200, 48: 300}
    rows, _ = diffusion.widest_rows("zero3", search, TINY, ranks=2)
    assert rows[0].name == "largest unet zero3 under 0 MiB/rank x2" and rows[0].ratio == 1.0


def test_a_side_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match="the UNet rows compare with plain DDP"):
        diffusion.unet_rows(TINY, ("zero3",), ranks=2)
