"""Resharding: a checkpoint saved under one layout loads into any other, optimizer states
included. Saved under pp2 x tp2 (1d) x dp2 with ZeRO-1 after 3 steps, it loads under dp4 with
ZeRO-3, 3d tp8, 2d tp4, 2.5d tp8 depth 2 and one process; the next 3 steps there match the
uninterrupted run's (``tessera.testing.tolerance``), losses and final weights. And back: ZeRO-3 dp4 to
pp2 x tp2 x dp2 with ZeRO-1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera.checkpoint import full_state_dict, load, save
from tessera.testing import tolerance
from tests.dist.test_checkpoint_resume import BUCKET_MB, setup

# a few AdamW steps give every optimizer state a value; the StepLR of setup() (step_size 4) lowers
# the rate during the steps after the load, so the scheduler's state is compared too
BEFORE, AFTER = 3, 3

PP_TP_DP_ZERO1 = (
    8,
    {
        "parallel": {
            "data": 2,
            "tensor": {"size": 2, "mode": "1d"},
            "pipeline": {"size": 2, "schedule": "1f1b", "microbatches": 2},
        },
        "zero": {"stage": 1, "chunk_mb": BUCKET_MB},
    },
)
ZERO3_DP4 = (4, {"parallel": {"data": 4}, "zero": {"stage": 3, "chunk_mb": BUCKET_MB}})
TARGETS = {
    "zero3-dp4": ZERO3_DP4,
    "3d-tp8": (8, {"parallel": {"data": 1, "tensor": {"size": 8, "mode": "3d"}}}),
    "2d-tp4": (4, {"parallel": {"data": 1, "tensor": {"size": 4, "mode": "2d"}}}),
    "2.5d-tp8-depth2": (8, {"parallel": {"data": 1, "tensor": {"size": 8, "mode": "2.5d", "depth": 2}}}),
    "one-process": (1, {"parallel": {"data": 1}}),
}


def train_save_continue(config: dict, path: str):
    """BEFORE steps, a save, AFTER more: the uninterrupted run's last AFTER losses and final weights."""
    engine, loader, scheduler = setup(config, dropout=0.0)
    loader.sampler.set_epoch(0)
    it = iter(loader)
    for _ in range(BEFORE):
        engine.train_batch(it)
        scheduler.step()
    save(path, engine, dataloader=loader)
    return go_on(engine, it, scheduler)


def load_continue(config: dict, path: str):
    engine, loader, scheduler = setup(config, dropout=0.0)
    assert load(path, engine, dataloader=loader) == BEFORE
    return go_on(engine, iter(loader), scheduler)


def go_on(engine, it, scheduler):
    """The next AFTER steps: their losses and the final weights (rank 0)."""
    losses = []
    for _ in range(AFTER):
        losses.append(engine.train_batch(it))
        scheduler.step()
    state = full_state_dict(engine.model)
    return (losses, state) if engine.ctx.rank == 0 else None


@pytest.fixture(scope="module")
def saved_pp_tp_dp(pools, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("reshard") / "pp2-tp2-dp2-zero1")
    ranks, config = PP_TP_DP_ZERO1
    return path, pools.run(ranks, train_save_continue, config, path, timeout=600)[0]


def assert_matches(result, expected):
    losses, state = result
    expected_losses, expected_state = expected
    tol = tolerance(blocks=2, steps=BEFORE + AFTER)  # build() of test_checkpoint_resume: 2 blocks
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), **tol)
    assert state.keys() == expected_state.keys()
    for key in state:
        torch.testing.assert_close(state[key], expected_state[key], **tol, msg=key)


@pytest.mark.parametrize("target", list(TARGETS))
def test_pp_tp_dp_zero1_checkpoint_loads_into(pools, saved_pp_tp_dp, target):
    path, expected = saved_pp_tp_dp
    ranks, config = TARGETS[target]
    assert_matches(pools.run(ranks, load_continue, config, path, timeout=600)[0], expected)


def test_zero3_dp4_checkpoint_loads_into_pp_tp_dp_zero1(pools, tmp_path: Path):
    path = str(tmp_path / "zero3-dp4")
    expected = pools.run(ZERO3_DP4[0], train_save_continue, ZERO3_DP4[1], path, timeout=600)[0]
    ranks, config = PP_TP_DP_ZERO1
    assert_matches(pools.run(ranks, load_continue, config, path, timeout=600)[0], expected)
