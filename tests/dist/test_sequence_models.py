"""The GPT trained under sequence parallelism, in every mode and combined with data, 1D tensor and
pipeline parallelism and with ZeRO, gives the single-process losses and weights."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import tessera
from tessera import comm
from tessera.checkpoint import full_state_dict
from tessera.parallel.sequence import MODES
from tessera.testing import use_layout
from tests.dist.test_pipeline_models import assert_same_run
from tests.dist.test_tp_models import GLOBAL_BATCH, STEPS, build, criterion, dataset, train

# name: (pool size, layout, extra config)
LAYOUTS = {
    "sp2-dp2": (4, dict(sequence=2, data=2), {}),
    "sp2-tp2": (4, dict(sequence=2, tensor=2), {}),
    "sp2-tp2-sp": (4, dict(sequence=2, tensor=2), {"sequence_parallel": True}),
    "sp2-pp2": (4, dict(sequence=2, pipeline=2), {"schedule": "1f1b", "microbatches": 2}),
    "sp4-zero2": (4, dict(sequence=4), {"zero": 2}),
}


def train_sequence(mode: str, layout: dict, extra: dict):
    pipeline = {"size": layout.get("pipeline", 1)}
    if "schedule" in extra:
        pipeline.update(schedule=extra["schedule"], microbatches=extra["microbatches"])
    config = {
        "parallel": {
            "data": layout.get("data"),
            "sequence": {"size": layout["sequence"], "mode": mode},
            "tensor": {"size": layout.get("tensor", 1), "sequence_parallel": extra.get("sequence_parallel", False)},
            "pipeline": pipeline,
        },
        "zero": {"stage": extra.get("zero", 0)},
    }
    ctx = use_layout(**layout, config=config)
    model = build("gpt")
    initial = full_state_dict(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    micro = extra.get("microbatches", 1)
    loader = DataLoader(dataset("gpt"), batch_size=GLOBAL_BATCH // (ctx.size("data") * micro))
    engine, loader, _, _ = tessera.initialize(model, optimizer, criterion("gpt"), loader)
    it = iter(loader)
    with comm.ledger() as sent:
        losses = [engine.train_batch(it)]
    # attention crossed the sequence axis: transfers around the ring, or all-to-alls
    assert sent.calls(axis="sequence") >= 2 * len(model.blocks), sent
    losses += [engine.train_batch(it) for _ in range(STEPS - 1)]
    final = full_state_dict(model)
    return losses, (initial, final) if ctx.rank == 0 else None


@pytest.fixture(scope="module")
def reference():
    return train("gpt", None)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gpt_trains_to_the_single_process_answer(pools, reference, name, mode):
    ranks, layout, extra = LAYOUTS[name]
    results = pools.run(ranks, train_sequence, mode, layout, extra, timeout=600)
    assert_same_run(results[0], reference)
    assert all(r[0] == results[0][0] for r in results), "every rank reports the same loss"


class _Masks(torch.nn.Module):
    """What dropout does to ones, for this rank's tokens."""

    def __init__(self) -> None:
        super().__init__()
        from tessera import nn as tnn

        self.scale = torch.nn.Parameter(torch.ones(()))
        self.drop = tnn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.ones(x.shape[0], x.shape[1], 32)) * self.scale


def body_masks():
    ctx = use_layout(sequence=2, config={"parallel": {"sequence": {"size": 2, "mode": "ring"}}})
    model = _Masks()
    engine, *_ = tessera.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    engine.train()
    masks = engine(torch.zeros(2, 16, dtype=torch.long)).detach()
    both = comm.all_gather(masks.unsqueeze(0), ctx.group("sequence"), dim=0)
    return not torch.equal(both[0], both[1]), masks.shape[1]


def test_dropout_draws_masks_of_their_own_on_each_sequence_rank(pools):
    # each rank holds other tokens of the same sequences: equal masks would tie them together
    assert pools.run(2, body_masks) == [(True, 8), (True, 8)]
