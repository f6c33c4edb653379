"""The planner's communication formulas are the comm ledger's: one training step of a tiny GPT
under a layout, on 4 ranks, moves per (op, axis) what ``tessera.planner.timing.step_traffic``
predicts for the busiest rank (bytes within 1%, calls exactly)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import tessera
from tessera import comm
from tessera.models import NextTokenLoss, gpt
from tessera.planner import Layout, Workload
from tessera.planner.spec import from_gpt_preset
from tessera.planner.timing import step_traffic
from tessera.testing import use_layout

SIZES = dict(vocab_size=64, max_seq_len=16, d_model=32, n_layers=4, n_heads=4)

LAYOUTS = {
    "tp2-sp-dp2-bf16": (Layout(data=2, tensor=2, sequence_parallel=True, micro_batch=4), "bf16"),
    "2d-tp4-ckpt": (Layout(tensor=4, tensor_mode="2d", checkpoint="full", micro_batch=4), "fp32"),
    "pp2-dp2-1f1b": (Layout(data=2, pipeline=2, microbatches=4, micro_batch=2), "fp32"),
    "sp2-ring-dp2-z2-acc2": (Layout(data=2, sequence=2, zero=2, microbatches=2, micro_batch=2), "fp32"),
    "dp4-z3-bf16": (Layout(data=4, zero=3, micro_batch=2), "bf16"),
}


def ledger_of_a_step(layout: Layout, dtype: str) -> dict[tuple[str, str], tuple[float, int]]:
    """This rank's ledger of the second training step (the first builds DDP's buckets)."""
    config = {**layout.to_config(), "mixed_precision": {"dtype": dtype}}
    use_layout(data=layout.data, tensor=layout.tensor, mode=layout.tensor_mode, pipeline=layout.pipeline,
               sequence=layout.sequence, config=config)  # fmt: skip
    torch.manual_seed(0)
    model = gpt("tiny", **SIZES)
    tokens = torch.randint(0, 64, (64, 17), generator=torch.Generator().manual_seed(7))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=layout.micro_batch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, loader, _, _ = tessera.initialize(model, optimizer, NextTokenLoss(), loader)
    batches = iter(loader)
    engine.train_batch(batches)
    with comm.ledger() as led:
        engine.train_batch(batches)
    return {key: (float(v["bytes"]), int(v["calls"])) for key, v in led.summary().items()}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_predicted_bytes_per_axis_are_the_ledgers(pools, name):
    layout, dtype = LAYOUTS[name]
    ranks = pools.run(4, ledger_of_a_step, layout, dtype, timeout=300)
    measured = {key: max(r.get(key, (0.0, 0)) for r in ranks) for r in ranks for key in r}
    predicted = step_traffic(from_gpt_preset("tiny", **SIZES), layout, Workload(global_batch=8, dtype=dtype))
    assert set(predicted) == set(measured), (sorted(predicted), sorted(measured))
    for key, (nbytes, calls) in measured.items():
        assert predicted[key].bytes == pytest.approx(nbytes, rel=0.01), (key, predicted[key], nbytes)
        assert predicted[key].calls == calls, (key, predicted[key], calls)
