"""Asynchronous saves on 2 ranks (data-parallel replicas sharing the writing, and ZeRO-3
pieces): each holds the values of its call while training goes on, also when the ranks keep
their share of the save from the previous one."""

from __future__ import annotations

import pytest
import torch

from tessera.checkpoint import full_state_dict, load, save, sharded
from tests.dist.test_checkpoint_resume import BUCKET_MB, setup

LAYOUTS = {
    "dp2": {"parallel": {"data": 2}},
    "zero3-dp2": {"parallel": {"data": 2}, "zero": {"stage": 3, "bucket_mb": BUCKET_MB}},
}


def save_while_training(config: dict, root: str):
    engine, loader, scheduler = setup(config, dropout=0.0)
    it = iter(loader)
    states = []
    exchanges = []
    real_exchange = sharded._exchange
    sharded._exchange = lambda data, ctx: exchanges.append(1) or real_exchange(data, ctx)  # type: ignore[assignment]
    try:
        for n in range(3):
            engine.train_batch(it)
            scheduler.step()
            states.append(full_state_dict(engine.model))
            handle = save(f"{root}/s{n}", engine, blocking=False)
            engine.train_batch(it)  # while the files are written
            handle.wait()
    finally:
        sharded._exchange = real_exchange  # type: ignore[assignment]
    loaded = []
    for n in range(3):
        other, _, _ = setup(config, dropout=0.0)
        load(f"{root}/s{n}", other)
        loaded.append(full_state_dict(other.model))
    kept = sharded._kept[0].staging is not None
    return (states, loaded, kept, len(exchanges)) if engine.ctx.rank == 0 else None


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_asynchronous_saves_hold_the_values_of_their_call(pools, tmp_path, layout):
    states, loaded, kept, exchanges = pools.run(2, save_while_training, LAYOUTS[layout], str(tmp_path), timeout=300)[0]
    assert kept and exchanges <= 1  # the later saves keep the first one's plan
    for expected, got in zip(states, loaded):
        assert got.keys() == expected.keys()
        for key in expected:
            assert torch.equal(got[key], expected[key]), key
    assert any(not torch.equal(states[0][k], states[1][k]) for k in states[0])  # training moved on
