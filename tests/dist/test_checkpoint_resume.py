"""Sharded checkpoints resume bitwise: train 3 steps, save, train 3 more; in fresh processes,
load and train the same 3: the losses and the final full state dicts are identical, bit for
bit. Dropout is on, the sampler shuffles and the learning rate steps down during the resumed
steps, so the random states, the data position and the scheduler must all come back (the test
fails if the random states or the data position do not)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import tessera
from tessera.checkpoint import full_state_dict, load, save
from tessera.models import NextTokenLoss, gpt
from tessera.optim import LAMB, LARS
from tessera.testing import use_layout

SEQ = 16
GLOBAL_BATCH = 8
BUCKET_MB = 0.016  # several chunks for the small GPT
# steps before the save and after it: the StepLR below (step_size 4) lowers the rate in the
# resumed steps, so its state must come back too
BEFORE, AFTER = 3, 3


def build(dropout: float = 0.1):
    torch.manual_seed(0)
    return gpt("tiny", vocab_size=64, max_seq_len=SEQ, d_model=32, n_layers=2, n_heads=4, dropout=dropout)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 64, (GLOBAL_BATCH * 40, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def layout(config: dict) -> dict:
    par = config.get("parallel", {})
    tensor = par.get("tensor", {})
    pipe = par.get("pipeline", {})
    return {
        "data": par.get("data"),
        "pipeline": pipe.get("size", 1),
        "tensor": tensor.get("size", 1),
        "mode": tensor.get("mode", "1d"),
        "depth": tensor.get("depth", 1),
    }


def make_optimizer(name: str, model):
    if name == "lamb":
        return LAMB(model.parameters(), lr=3e-3)
    if name == "lars":
        return LARS(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)


def setup(config: dict, dropout: float = 0.1, optimizer_name: str = "adamw"):
    """The engine, loader and scheduler of a run under ``config`` (on every rank)."""
    ctx = use_layout(config=config, **layout(config))
    model = build(dropout)
    optimizer = make_optimizer(optimizer_name, model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.8)
    micro = GLOBAL_BATCH // ctx.size("data")
    pipeline = config.get("parallel", {}).get("pipeline")
    if pipeline:
        micro //= pipeline["microbatches"]
    loader = DataLoader(dataset(), batch_size=micro, shuffle=True)
    engine, loader, _, scheduler = tessera.initialize(model, optimizer, NextTokenLoss(), loader, lr_scheduler=scheduler)
    return engine, loader, scheduler


def steps(engine, it, scheduler, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        losses.append(engine.train_batch(it))
        scheduler.step()
    return losses


def run_and_save(config: dict, path: str, optimizer_name: str = "adamw"):
    engine, loader, scheduler = setup(config, optimizer_name=optimizer_name)
    loader.sampler.set_epoch(0)
    it = iter(loader)
    steps(engine, it, scheduler, BEFORE)
    save(path, engine, dataloader=loader)
    losses = steps(engine, it, scheduler, AFTER)
    state = full_state_dict(engine.model)
    return (losses, state) if engine.ctx.rank == 0 else None


def resume(config: dict, path: str, optimizer_name: str = "adamw"):
    engine, loader, scheduler = setup(config, optimizer_name=optimizer_name)
    torch.manual_seed(1234)  # whatever the process drew before: the checkpoint's states win
    step = load(path, engine, dataloader=loader)
    assert step == BEFORE
    losses = steps(engine, iter(loader), scheduler, AFTER)
    state = full_state_dict(engine.model)
    return (losses, state) if engine.ctx.rank == 0 else None


def zero(stage: int, **extra) -> dict:
    return {"stage": stage, "chunk_mb": BUCKET_MB, **extra}


CASES = {
    "dp2": (2, {"parallel": {"data": 2}}),
    "zero1-dp2": (2, {"parallel": {"data": 2}, "zero": zero(1)}),
    "zero2-dp2": (2, {"parallel": {"data": 2}, "zero": zero(2)}),
    "zero3-dp2": (2, {"parallel": {"data": 2}, "zero": zero(3)}),
    "zero3-dp2-offload": (2, {"parallel": {"data": 2}, "zero": zero(3, offload_optimizer="cpu")}),
    "2d-tp4": (4, {"parallel": {"data": 1, "tensor": {"size": 4, "mode": "2d"}}}),
    "2.5d-tp8-depth2": (8, {"parallel": {"data": 1, "tensor": {"size": 8, "mode": "2.5d", "depth": 2}}}),
    "1f1b-pp2-dp2": (
        4,
        {"parallel": {"data": 2, "pipeline": {"size": 2, "schedule": "1f1b", "microbatches": 2}}},
    ),
    "bf16-zero2-dp2": (2, {"parallel": {"data": 2}, "zero": zero(2), "mixed_precision": {"dtype": "bf16"}}),
}


@pytest.fixture(scope="module")
def uninterrupted(pools, tmp_path_factory):
    """``uninterrupted(case, optimizer_name)``: the checkpoint's path and the uninterrupted run's
    losses and final state, run once per module (the bitwise and the control tests share them)."""
    runs: dict[tuple[str, str], tuple[str, tuple]] = {}

    def get(case: str, optimizer_name: str = "adamw") -> tuple[str, tuple]:
        if (case, optimizer_name) not in runs:
            ranks, config = CASES[case]
            path = str(tmp_path_factory.mktemp(f"{case}-{optimizer_name}") / "ckpt")
            result = pools.run(ranks, run_and_save, config, path, optimizer_name, timeout=600)[0]
            runs[case, optimizer_name] = path, result
        return runs[case, optimizer_name]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_resume_is_bitwise(pools, uninterrupted, case: str):
    ranks, config = CASES[case]
    path, (expected_losses, expected_state) = uninterrupted(case)
    pools.get(ranks).close()  # the resumed run starts in fresh processes
    losses, state = pools.run(ranks, resume, config, path, timeout=600)[0]
    assert losses == expected_losses
    assert state.keys() == expected_state.keys()
    for key in state:
        assert torch.equal(state[key], expected_state[key]), key


@pytest.mark.parametrize("optimizer_name", ["lamb", "lars"])
def test_resume_with_lamb_and_lars_under_zero2_is_bitwise(pools, uninterrupted, optimizer_name: str):
    """LAMB's and LARS's states (their sharded pieces) come back too."""
    ranks, config = CASES["zero2-dp2"]
    path, (expected_losses, expected_state) = uninterrupted("zero2-dp2", optimizer_name)
    losses, state = pools.run(ranks, resume, config, path, optimizer_name, timeout=600)[0]
    assert losses == expected_losses
    for key in state:
        assert torch.equal(state[key], expected_state[key]), key


def resume_without(config: dict, path: str, what: str):
    """A resume that leaves out ``what`` ("rng": the random states are drawn away after the
    load; "data": the loader's position is not restored). It must diverge."""
    engine, loader, scheduler = setup(config)
    load(path, engine, dataloader=None if what == "data" else loader)
    if what == "rng":
        torch.manual_seed(99)
        engine.ctx.rng._states = {}
    losses = steps(engine, iter(loader), scheduler, AFTER)
    return losses if engine.ctx.rank == 0 else None


@pytest.mark.parametrize("what", ["rng", "data"])
def test_resume_depends_on_rng_and_data_position(pools, uninterrupted, what: str):
    """The bitwise test can fail: without the random states or the data position, the resumed
    losses differ from the uninterrupted run's."""
    ranks, config = CASES["zero2-dp2"]
    path, (expected_losses, _) = uninterrupted("zero2-dp2")
    losses = pools.run(ranks, resume_without, config, path, what, timeout=600)[0]
    assert losses != expected_losses
