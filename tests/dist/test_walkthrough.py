"""docs/architecture.md's walk-through: the strategy written there, run as written, trains to the
same answer as one process on two ranks under data parallelism (and as DDP through
tessera.initialize), with the GPT's sequences split (``sequence=2``) and with the MoE GPT's
experts spread (``expert=2``); and the test sees a strategy that averages over the data axis by
hand go wrong under ``sequence=2``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import tessera
from tessera.checkpoint import full_state_dict
from tessera.engine.options import TrainingOptions
from tessera.models import NextTokenLoss
from tessera.parallel.data import distributed_loader
from tessera.testing import tolerance, use_layout
from tests.dist import test_moe_training as moe
from tests.dist import test_tp_models as tp
from tests.dist.test_engine import GLOBAL_BATCH, make_dataset, make_model, make_optimizer, reference_run

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
STEPS = 8

# A strategy that averages over the data axis by hand (the walk-through's first version): appended
# to the walk-through's code, it replaces the strategy the walk-through's engine builds.
DATA_AXIS_ONLY = """

class _DataAxisOnly(OneAllReduce):
    def reduce_gradients(self):
        params = [p for p in self.module.parameters() if p.grad is not None]
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        comm.all_reduce(flat, self.ctx.group("data"), op="avg")
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p))


OneAllReduce = _DataAxisOnly
"""


def walkthrough_code() -> str:
    """The python block that follows the walk-through marker in the doc."""
    text = DOC.read_text()
    found = re.search(r"<!-- walkthrough:[^>]*-->\s*```python\n(.*?)```", text, re.S)
    assert found, "docs/architecture.md lost its walk-through block"
    return found.group(1)


def walkthrough_engine(code: str, model: nn.Module, optimizer, criterion, ctx, accumulation: int = 1):
    """The engine the walk-through's ``code`` (run as written) builds for ``model``."""
    namespace: dict = {}
    exec(compile(code, str(DOC), "exec"), namespace)
    options = TrainingOptions(gradient_accumulation=accumulation)
    return namespace["engine_with_one_allreduce"](model, optimizer, criterion, ctx, options)


def body_walkthrough(accumulation: int) -> dict:
    results = {}
    for side in ("walkthrough", "ddp"):
        ctx = use_layout(config={"gradient_accumulation": accumulation})
        model = make_model()
        optimizer = make_optimizer(model, "adamw")
        micro = GLOBAL_BATCH // (ctx.size("data") * accumulation)
        loader = DataLoader(make_dataset(), batch_size=micro, shuffle=False)
        if side == "walkthrough":
            engine = walkthrough_engine(walkthrough_code(), model, optimizer, nn.CrossEntropyLoss(), ctx, accumulation)
            loader = distributed_loader(loader, ctx.group("data"), seed=42)
        else:
            engine, loader, _, _ = tessera.initialize(model, optimizer, nn.CrossEntropyLoss(), loader)
        it = iter(loader)
        losses = [engine.train_batch(it) for _ in range(STEPS)]
        results[side] = (engine.strategy.name, losses, full_state_dict(model))
    return results


def test_the_walkthrough_strategy_trains_to_the_single_process_answer(pools):
    expected_losses, expected_state = reference_run(steps=STEPS)
    for accumulation in (1, 2):
        out = pools.run(2, body_walkthrough, accumulation)[0]
        assert out["walkthrough"][0] == "one-allreduce" and out["ddp"][0] == "ddp"
        for side in ("walkthrough", "ddp"):
            _, losses, state = out[side]
            tol = tolerance(steps=STEPS)  # make_model(): about one block's depth
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), **tol)
            for key, value in expected_state.items():
                torch.testing.assert_close(state[key], value, **tol, msg=f"{side}: {key}")


def body_sequence(code: str) -> tuple:
    """The GPT trained by the walk-through's ``code`` with each sequence split over two ranks
    (ring attention; every rank has the whole batch, the engine gives the model its tokens)."""
    ctx = use_layout(sequence=2, config={"parallel": {"sequence": {"size": 2, "mode": "ring"}}})
    model = tp.build("gpt")
    initial = full_state_dict(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    engine = walkthrough_engine(code, model, optimizer, tp.criterion("gpt"), ctx)
    it = iter(DataLoader(tp.dataset("gpt"), batch_size=tp.GLOBAL_BATCH))
    losses = [engine.train_batch(it) for _ in range(tp.STEPS)]
    final = full_state_dict(model)  # collective: every rank gathers
    return losses, (initial, final) if ctx.rank == 0 else None


def body_expert(code: str) -> tuple:
    """The MoE GPT trained by the walk-through's ``code`` with its experts spread over the two
    data ranks (``expert=2``), each data rank taking its half of every step's batch."""
    ctx = use_layout(data=2, expert=2, config={"parallel": {"data": 2, "expert": 2}})
    model = moe.build()
    initial = full_state_dict(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    engine = walkthrough_engine(code, model, optimizer, NextTokenLoss(), ctx)
    d = ctx.local_rank("data")
    losses = [engine.train_batch(iter(moe.micro_batches(s, d, 2, 1))) for s in range(moe.STEPS)]
    final = full_state_dict(model)  # collective: every rank gathers
    return losses, (initial, final) if ctx.rank == 0 else None


@pytest.fixture(scope="module")
def gpt_reference():
    return tp.train("gpt", None)


def moe_reference() -> tuple:
    """One process accumulating the same two micro-batches per step (routing is per micro-batch)."""
    losses, _, states, *_ = moe.single_process(2, "adamw", None)
    return losses, states


def assert_single_process_answer(results: list, reference: tuple, steps: int) -> None:
    """The same initial weights (bitwise), then the reference's losses and final weights (two
    blocks, ``steps`` steps); every rank reports the same loss."""
    losses, (initial, final) = results[0]
    ref_losses, (ref_initial, ref_final) = reference
    for key in ref_initial:
        assert torch.equal(initial[key], ref_initial[key]), key
    tol = tolerance(blocks=2, steps=steps)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **tol)
    assert all(r[0] == losses for r in results), "every rank reports the same loss"
    assert final.keys() == ref_final.keys()
    for key in ref_final:
        torch.testing.assert_close(final[key], ref_final[key], **tol, msg=key)


def test_the_walkthrough_strategy_trains_the_gpt_to_the_single_process_answer_under_sequence_2(pools, gpt_reference):
    results = pools.run(2, body_sequence, walkthrough_code(), timeout=600)
    assert_single_process_answer(results, gpt_reference, tp.STEPS)


def test_the_walkthrough_strategy_trains_the_moe_gpt_to_the_single_process_answer_under_expert_2(pools):
    results = pools.run(2, body_expert, walkthrough_code(), timeout=600)
    assert_single_process_answer(results, moe_reference(), moe.STEPS)


def test_averaging_over_the_data_axis_by_hand_fails_under_sequence_2(pools, gpt_reference):
    """The planted mistake: each sequence rank keeps the gradient of its own tokens (the data
    axis has one rank), so the weights leave the single-process answer."""
    results = pools.run(2, body_sequence, walkthrough_code() + DATA_AXIS_ONLY, timeout=600)
    losses, (_, final) = results[0]
    ref_losses, (_, ref_final) = gpt_reference
    tol = tolerance(blocks=2, steps=tp.STEPS)
    assert torch.allclose(torch.tensor(losses[0]), torch.tensor(ref_losses[0]), **tol), "the same first step's loss"
    apart = [key for key in ref_final if not torch.allclose(final[key], ref_final[key], **tol)]
    assert len(apart) > len(ref_final) // 2, f"most weights leave the single-process answer; only {apart} did"
