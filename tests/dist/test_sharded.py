"""ZeRO and Gemini are one sharded optimizer with two residences: Gemini with every part on the
device takes ZeRO-3's steps bit for bit, and Gemini trains the layouts only ZeRO could before
(experts, sequence parallelism, a 2D tensor layout) to the single-process answer."""

from __future__ import annotations

import tempfile

import pytest
import torch
from torch.utils.data import DataLoader

import tessera
from tessera.checkpoint import full_state_dict
from tessera.models import NextTokenLoss, gpt
from tessera.testing import assert_draws_clear, recorded_routes, tolerance, use_layout
from tests.dist.test_tp_models import build, config_for, criterion, dataset

STEPS = 20
SEQ = 32
CHUNK_MB = 0.5  # the small GPT's blocks spread over a few chunks each


def small_gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt("small", vocab_size=64, max_seq_len=SEQ)


def tokens(rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 64, (rows, SEQ + 1), generator=g)


def train_small(sharding: dict) -> tuple:
    """20 steps of the small GPT on dp2 under ``sharding`` (a ``zero`` or ``gemini`` section),
    clipped so that the gradient norm steers every step; returns this rank's losses, the norms
    before clipping and (rank 0) the final weights."""
    ctx = use_layout(data=2, config={**sharding, "clip_grad_norm": 0.5})
    model = small_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    engine, _, _, _ = tessera.initialize(model, optimizer, NextTokenLoss())
    t = tokens(STEPS * 4)
    losses, norms = [], []
    for step in range(STEPS):
        rows = t[step * 4 : (step + 1) * 4].chunk(2)[ctx.local_rank("data")]
        losses.append(engine.train_batch(iter([(rows[:, :-1].contiguous(), rows[:, 1:].contiguous())])))
        norms.append(engine.last_grad_norm)
    final = full_state_dict(engine)
    engine.strategy.close()
    return losses, norms, final if ctx.rank == 0 else None


def test_gemini_with_every_part_on_the_device_takes_zero3s_steps_bitwise(pools):
    zero = pools.run(2, train_small, {"zero": {"stage": 3, "chunk_mb": CHUNK_MB}}, timeout=600)
    on_device = {"placement": "static", "params_offload": 0.0, "optimizer_offload": 0.0, "chunk_mb": CHUNK_MB}
    gemini = pools.run(2, train_small, {"gemini": on_device}, timeout=600)
    for z, g in zip(zero, gemini, strict=True):
        assert g[0] == z[0], "losses, bitwise"
        assert g[1] == z[1], "gradient norms, bitwise"
    assert sum(n > 0.5 for n in zero[0][1]) > STEPS // 2, "clipping scaled most steps"
    weights, reference = gemini[0][2], zero[0][2]
    assert weights.keys() == reference.keys()
    for key in reference:
        assert torch.equal(weights[key], reference[key]), key


# ---- experts through the disk tier -----------------------------------------------------------
MOE_BATCH, MOE_SEQ = 8, 16


def moe_gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt("tiny-moe", vocab_size=64, max_seq_len=MOE_SEQ, d_model=32, n_layers=2, n_heads=4, d_ff=32,
               num_experts=4)  # fmt: skip


def moe_batches(step: int, part: int, parts: int, splits: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    t = torch.randint(0, 64, (STEPS * MOE_BATCH, MOE_SEQ + 1), generator=g)
    rows = t[step * MOE_BATCH : (step + 1) * MOE_BATCH].chunk(parts)[part]
    return [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in rows.chunk(splits)]


def train_moe(layout: dict, gemini: dict | None, accumulation: int) -> tuple:
    """20 steps of the MoE GPT on this rank of ``layout`` ({}: one process, accumulating the
    data ranks' micro-batches) with ``gemini`` (or none); losses, final weights (rank 0) and the
    bytes Gemini wrote to disk."""
    data = layout.get("data", 1)
    with tempfile.TemporaryDirectory() as offload:
        config = {
            "parallel": {"data": data, "expert": layout.get("expert", 1)},
            "gradient_accumulation": accumulation,
            **({"gemini": {**gemini, "offload_dir": offload}} if gemini is not None else {}),
        }
        ctx = use_layout(**layout, config=config)
        model = moe_gpt()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
        engine, _, _, _ = tessera.initialize(model, optimizer, NextTokenLoss())
        d = ctx.local_rank("data")
        losses = [engine.train_batch(iter(moe_batches(s, d, data, accumulation))) for s in range(STEPS)]
        final = full_state_dict(engine)
        written = engine.strategy.report().get("disk_written_bytes", 0)
        engine.strategy.close()
    return losses, final if ctx.rank == 0 else None, written


def test_gemini_trains_experts_through_the_disk_tier_to_the_single_process_answer(pools):
    """ep2 x dp2: the experts' chunks are sharded over the two ranks that hold the same experts,
    the rest over all four; budgets small enough that parts go through the disk tier."""
    with recorded_routes() as routes:  # the first step's routing: no token near a tie
        first = moe_gpt()
        for x, _ in moe_batches(0, 0, 1, 4):
            first(x)
    assert_draws_clear(routes, blocks=2)
    reference = train_moe({}, None, 4)
    gemini = {"placement": "auto", "device_budget": 300_000, "host_budget": 30_000, "chunk_mb": 0.01}
    results = pools.run(4, train_moe, dict(data=4, expert=2), gemini, 1, timeout=600)
    losses, final, _ = results[0]
    assert all(r[2] > 0 for r in results), "every rank moved parts through the disk tier"
    tol = tolerance(blocks=2, steps=STEPS)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference[0]), **tol)
    for key in reference[1]:
        torch.testing.assert_close(final[key], reference[1][key], **tol, msg=key)


# ---- layouts Gemini refused before ------------------------------------------------------------
def train_tp(layout: dict | None, gemini: bool) -> tuple:
    """The tensor-model tests' GPT (6 steps) on this rank of ``layout``, under Gemini."""
    layout = dict(layout or {})
    config = config_for(layout)
    sequence = layout.pop("sequence", 1)
    config["parallel"]["sequence"] = {"size": sequence, "mode": layout.pop("sequence_mode", "ring_qk")}
    if gemini:
        config["gemini"] = {"placement": "auto", "chunk_mb": 0.01}
    ctx = use_layout(**layout, sequence=sequence, config=config)
    model = build("gpt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    loader = DataLoader(dataset("gpt"), batch_size=8 // ctx.size("data"))
    engine, loader, _, _ = tessera.initialize(model, optimizer, criterion("gpt"), loader)
    it = iter(loader)
    losses = [engine.train_batch(it) for _ in range(6)]
    final = full_state_dict(engine)
    engine.strategy.close()
    return losses, final if ctx.rank == 0 else None


@pytest.fixture(scope="module")
def tp_reference():
    return train_tp(None, gemini=False)


@pytest.mark.parametrize(
    "layout",
    [
        *(dict(sequence=2, sequence_mode=m, data=2) for m in ("ring_qk", "ring", "all_to_all")),
        dict(tensor=4, mode="2d"),
    ],
    ids=["sp2-ring_qk-dp2", "sp2-ring-dp2", "sp2-all_to_all-dp2", "2d-tp4"],
)
def test_gemini_trains_sequence_and_2d_layouts_to_the_single_process_answer(pools, tp_reference, layout):
    results = pools.run(4, train_tp, layout, True, timeout=600)
    losses, final = results[0]
    tol = tolerance(blocks=2, steps=6)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(tp_reference[0]), **tol)
    for key in tp_reference[1]:
        torch.testing.assert_close(final[key], tp_reference[1][key], **tol, msg=key)
