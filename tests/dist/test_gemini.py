"""Gemini reproduces single-process training while its chunks move through the device, host and
disk tiers under both policies, on 1 and 2 ranks; the ledger never exceeds a budget; a budget
that cannot hold one chunk and a layer's working set fails at start, naming the smallest."""

from __future__ import annotations

import tempfile

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tessera
from tessera.checkpoint import full_state_dict
from tessera.memory.tiers import Tier
from tessera.models import NextTokenLoss, gpt
from tessera.testing import tolerance, use_layout
from tests.dist.reference import adamw_reference

STEPS = 10
TOL = tolerance(blocks=2, steps=STEPS)  # build() trained STEPS steps, against one process
GLOBAL_BATCH = 8
SEQ = 16
CHUNK_MB = 0.02  # ~5k fp32 elements a chunk: the GPT spreads over 7 chunks


def build() -> nn.Module:
    torch.manual_seed(0)
    return gpt("tiny", vocab_size=64, max_seq_len=SEQ, d_model=32, n_layers=2, n_heads=4)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 64, (GLOBAL_BATCH * STEPS, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def reference(clip: float | None):
    return adamw_reference(build, dataset(), STEPS, GLOBAL_BATCH, clip)


def train(gemini: dict, accumulation: int, clip: float | None, dtype: str = "fp32", tensor: int = 1):
    """Train under Gemini; returns losses, the full state (rank 0), the ledger's samples and
    budgets, and the tiers that held bytes at some point."""
    with tempfile.TemporaryDirectory() as offload:
        config = {
            "gemini": {"offload_dir": offload, "chunk_mb": CHUNK_MB, **gemini},
            "gradient_accumulation": accumulation,
            "clip_grad_norm": clip,
            "mixed_precision": {"dtype": dtype},
            "parallel": {"tensor": {"size": tensor, "mode": "1d"}},
        }
        ctx = use_layout(tensor=tensor, config=config)
        model = build()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
        micro = GLOBAL_BATCH // (ctx.size("data") * accumulation)
        engine, loader, _, _ = tessera.initialize(model, optimizer, NextTokenLoss(), DataLoader(dataset(), micro))
        ledger = engine.strategy.residence.ledger
        ledger.samples = []  # from the first step on (placement at start is checked by the budgets too)
        it = iter(loader)
        losses = [engine.train_batch(it) for _ in range(STEPS)]
        samples = [(s.device, s.host, s.disk) for s in ledger.samples]
        budgets = (ledger.budget[Tier.DEVICE], ledger.budget[Tier.HOST])
        state = full_state_dict(engine)
        report = engine.strategy.report()
        engine.strategy.close()
    return losses, state if ctx.rank == 0 else None, samples, budgets, report


@pytest.fixture(scope="module")
def references():
    return {None: reference(None), 0.05: reference(0.05)}


# (ranks, gemini settings, accumulation, clip): budgets that send chunks through every tier
CASES = [
    (1, {"placement": "static", "params_offload": 0.5, "optimizer_offload": 1.0,
         "device_budget": 200_000, "host_budget": 120_000}, 2, 0.05),
    (1, {"placement": "auto", "device_budget": 800_000, "host_budget": 120_000}, 1, None),
    (2, {"placement": "static", "params_offload": 0.5, "optimizer_offload": 1.0,
         "device_budget": 150_000, "host_budget": 60_000}, 1, None),
    (2, {"placement": "auto", "device_budget": 300_000, "host_budget": 60_000}, 2, 0.05),
]  # fmt: skip


@pytest.mark.parametrize("ranks,gemini,accumulation,clip", CASES)
def test_gemini_reproduces_single_process_training_through_every_tier(
    pools, references, ranks, gemini, accumulation, clip
):
    results = pools.run(ranks, train, gemini, accumulation, clip, timeout=600)
    losses, state, _, _, report = results[0]
    ref_losses, ref_state = references[clip]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    assert all(r[0] == losses for r in results), "every rank reports the same loss"
    assert state.keys() == ref_state.keys()
    for key in ref_state:
        torch.testing.assert_close(state[key], ref_state[key], **TOL, msg=key)
    for _, _, samples, (device_budget, host_budget), report in results:
        assert samples, "the ledger sampled the moves"
        assert max(s[0] for s in samples) <= device_budget
        assert max(s[1] for s in samples) <= host_budget
        # every tier held chunk bytes, and parts really went to disk and came back
        assert min(max(s[i] for s in samples) for i in range(3)) > 0, report
        assert report["disk_written_bytes"] > 0 and report["disk_read_bytes"] > 0, report
        assert report["policy"] == gemini["placement"]


def test_gemini_with_1d_tensor_parallelism_reproduces_single_process_training(pools, references):
    # chunks packed block by block as ZeRO's, unpadded: budgets tight enough to reach the disk tier
    gemini = {"placement": "auto", "device_budget": 200_000, "host_budget": 40_000}
    results = pools.run(4, train, gemini, 2, 0.05, "fp32", 2, timeout=600)  # tp2 x dp2
    losses, state, _, _, _ = results[0]
    ref_losses, ref_state = references[0.05]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    for key in ref_state:
        torch.testing.assert_close(state[key], ref_state[key], **TOL, msg=key)
    for _, _, samples, (device_budget, host_budget), report in results:
        assert max(s[0] for s in samples) <= device_budget and max(s[1] for s in samples) <= host_budget
        assert report["disk_written_bytes"] > 0, report


def test_gemini_bf16_tracks_single_process(pools, references):
    gemini = {"placement": "auto", "device_budget": 600_000, "host_budget": 150_000}
    losses, state, samples, budgets, _ = pools.run(2, train, gemini, 1, 0.05, "bf16", timeout=600)[0]
    ref_losses, ref_state = references[0.05]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=0)
    for key in ref_state:  # full_state_dict(engine) gives the fp32 masters
        torch.testing.assert_close(state[key], ref_state[key], rtol=2e-2, atol=2e-2, msg=key)
    assert max(s[0] for s in samples) <= budgets[0] and max(s[1] for s in samples) <= budgets[1]


def start_with(gemini: dict) -> str:
    use_layout(config={"gemini": {"chunk_mb": CHUNK_MB, **gemini}})
    model = build()
    try:
        tessera.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    except tessera.BudgetError as error:
        return str(error)
    return ""


def test_a_budget_too_small_for_one_chunk_fails_at_start_naming_the_smallest(pools):
    message = pools.run(2, start_with, {"device_budget": 50_000}, timeout=120)[0]
    assert "gemini.device_budget=0.05 MiB is too small" in message, message
    smallest = float(message.split("give gemini.device_budget >= ")[1].split(" MiB")[0])
    # the named budget works: training starts with it
    works = pools.run(2, start_with, {"device_budget": int(smallest * 2**20) + 1}, timeout=120)[0]
    assert works == "", works
    with tempfile.TemporaryDirectory() as offload:
        message = pools.run(2, start_with, {"host_budget": 1_000, "offload_dir": offload}, timeout=120)[0]
    assert "gemini.host_budget=0.00 MiB is too small" in message, message


def batches(ctx, steps: range):
    """This rank's share of the global batch of each step (accumulation 1)."""
    x, y = dataset().tensors
    n, r = ctx.size("data"), ctx.local_rank("data")
    per = GLOBAL_BATCH // n
    for step in steps:
        lo = step * GLOBAL_BATCH + r * per
        yield x[lo : lo + per], y[lo : lo + per]


def fresh_engine(gemini: dict, offload: str):
    config = {"gemini": {"offload_dir": offload, "chunk_mb": CHUNK_MB, **gemini}, "clip_grad_norm": 0.05}
    ctx = use_layout(config=config)
    model = build()
    engine, *_ = tessera.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6), NextTokenLoss())
    return ctx, engine


def train_save_resume(gemini: dict, folder: str):
    """5 steps, a checkpoint (with parts on disk), 5 more; then a new engine loads the checkpoint
    and runs the same 5 steps."""
    from tessera.checkpoint import load, save
    from tessera.memory.tiers import Residence

    with tempfile.TemporaryDirectory() as first, tempfile.TemporaryDirectory() as second:
        ctx, engine = fresh_engine(gemini, first)
        losses = [engine.train_batch(iter([b])) for b in batches(ctx, range(5))]
        on_disk = sum(p.residence is Residence.DISK for p in engine.strategy.memory.parts)
        save(f"{folder}/ckpt", engine)
        still_on_disk = sum(p.residence is Residence.DISK for p in engine.strategy.memory.parts)
        losses += [engine.train_batch(iter([b])) for b in batches(ctx, range(5, 10))]
        final = full_state_dict(engine)
        engine.strategy.close()
        ctx, resumed = fresh_engine(gemini, second)
        step = load(f"{folder}/ckpt", resumed)
        after = [resumed.train_batch(iter([b])) for b in batches(ctx, range(5, 10))]
        resumed_final = full_state_dict(resumed)
        samples_ok = True
        resumed.strategy.close()
    return losses, after, step, on_disk, still_on_disk, final, resumed_final, samples_ok


@pytest.mark.parametrize("placement", ["static", "auto"])
def test_gemini_resumes_exactly_from_a_checkpoint_taken_with_chunks_on_disk(pools, references, placement, tmp_path):
    gemini = (
        {"placement": "static", "params_offload": 0.5, "optimizer_offload": 1.0,
         "device_budget": 150_000, "host_budget": 60_000}
        if placement == "static"
        else {"placement": "auto", "device_budget": 450_000, "host_budget": 60_000}
    )  # fmt: skip
    for losses, after, step, on_disk, still_on_disk, final, resumed_final, _ in pools.run(
        2, train_save_resume, gemini, str(tmp_path), timeout=600
    ):
        assert on_disk > 0 and still_on_disk > 0, "the checkpoint was taken while parts were on disk"
        assert step == 5
        assert after == losses[5:], "the resumed run gives the same losses, bitwise"
        for key in final:
            assert torch.equal(resumed_final[key], final[key]), key
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(references[0.05][0]), **TOL)


def deferred_start(gemini: dict, dtype: str):
    """Build the GPT deferred under Gemini: the initial full state, the tiers' peaks while it
    was filled (the budgets hold during materialisation), then 10 steps."""
    with tempfile.TemporaryDirectory() as offload:
        config = {
            "gemini": {"offload_dir": offload, "chunk_mb": CHUNK_MB, **gemini},
            "clip_grad_norm": 0.05,
            "mixed_precision": {"dtype": dtype},
        }
        ctx = use_layout(config=config)
        torch.manual_seed(0)
        with tessera.deferred_init():
            model = gpt("tiny", vocab_size=64, max_seq_len=SEQ, d_model=32, n_layers=2, n_heads=4)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
        engine, *_ = tessera.initialize(model, optimizer, NextTokenLoss())
        started = engine.strategy.report()
        groups = engine.strategy.groups_planned
        initial = full_state_dict(engine)
        losses = [engine.train_batch(iter([b])) for b in batches(ctx, range(STEPS))]
        engine.strategy.close()
    return initial if ctx.rank == 0 else None, started, groups, losses


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_deferred_model_is_filled_chunk_group_by_group_within_the_budgets(pools, references, dtype):
    host = 60_000 if dtype == "fp32" else 100_000  # bf16: the same chunk_mb holds twice the elements
    gemini = {"placement": "static", "params_offload": 1.0, "optimizer_offload": 1.0,
              "device_budget": 200_000, "host_budget": host}  # fmt: skip
    results = pools.run(2, deferred_start, gemini, dtype, timeout=600)
    initial, _, _, losses = results[0]
    expected = full_state_dict(build())
    for key in expected:  # the single-process initial values, bitwise (fp32 masters under bf16)
        assert torch.equal(initial[key], expected[key]), key
    for _, started, groups, _ in results:
        assert groups > 1, "the masters did not all fit at once: filled in several groups"
        assert started["host_peak_bytes"] <= gemini["host_budget"], started
        assert started["device_peak_bytes"] <= gemini["device_budget"], started
        assert started["disk_bytes"] > 0, started
    tol = TOL if dtype == "fp32" else dict(rtol=2e-2, atol=0)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(references[0.05][0]), **tol)


def full_disk_after_a_checkpoint(folder: str) -> tuple[str, bool]:
    """Save a checkpoint, then let the disk tier fill up: training stops with a clear error and
    the checkpoint still loads, bitwise what was saved."""
    import errno
    import os

    from tessera.checkpoint import load, save

    gemini = {"placement": "static", "params_offload": 1.0, "optimizer_offload": 1.0,
              "device_budget": 200_000, "host_budget": 120_000}  # fmt: skip
    with tempfile.TemporaryDirectory() as first, tempfile.TemporaryDirectory() as second:
        ctx, engine = fresh_engine(gemini, first)
        for b in batches(ctx, range(2)):
            engine.train_batch(iter([b]))
        save(f"{folder}/ckpt", engine)
        saved = full_state_dict(engine)
        disk = engine.strategy.memory.disk

        def full(path: object, buffer: object) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        disk._write = full  # every later write finds the disk full
        message = ""
        try:
            for b in batches(ctx, range(2, 4)):
                engine.train_batch(iter([b]))
        except tessera.OffloadError as error:
            message = str(error)
        ctx, resumed = fresh_engine(gemini, second)
        load(f"{folder}/ckpt", resumed)
        loaded = full_state_dict(resumed)
        resumed.strategy.close()
    return message, all(torch.equal(loaded[k], saved[k]) for k in saved)


def test_a_full_disk_stops_training_clearly_and_leaves_the_checkpoint_intact(pools, tmp_path):
    message, intact = pools.run(1, full_disk_after_a_checkpoint, str(tmp_path), timeout=300)[0]
    assert "the disk is full" in message and "gemini.offload_dir" in message, message
    assert intact, "the last checkpoint loads, bitwise what was saved"


def train_with(optimizer_name: str, gemini: dict | None):
    """5 steps of the GPT with tessera's LAMB or LARS (or torch SGD with momentum): under
    Gemini, or single-process (``gemini`` None, rank 0 only)."""
    from tessera.optim import LAMB, LARS

    make = {
        "lamb": lambda ps: LAMB(ps, lr=1e-2, weight_decay=0.01),
        "lars": lambda ps: LARS(ps, lr=0.1, momentum=0.9, weight_decay=1e-4),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    }[optimizer_name]
    if gemini is None:
        model = build()
        optimizer = make(model.parameters())
        x, y = dataset().tensors
        losses = []
        for step in range(5):
            sl = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
            optimizer.zero_grad()
            loss = NextTokenLoss()(model(x[sl]), y[sl])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses
    with tempfile.TemporaryDirectory() as offload:
        ctx = use_layout(config={"gemini": {"offload_dir": offload, "chunk_mb": CHUNK_MB, **gemini}})
        model = build()
        engine, *_ = tessera.initialize(model, make(model.parameters()), NextTokenLoss())
        losses = [engine.train_batch(iter([b])) for b in batches(ctx, range(5))]
        engine.strategy.close()
    return losses


@pytest.mark.parametrize("optimizer_name", ["lamb", "lars", "sgd"])
def test_gemini_steps_lamb_lars_and_sgd_as_single_process(pools, optimizer_name):
    gemini = {"placement": "auto", "device_budget": 450_000, "host_budget": 60_000}  # through every tier
    expected = train_with(optimizer_name, None)
    for losses in pools.run(2, train_with, optimizer_name, gemini, timeout=300):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), **tolerance(blocks=2, steps=5))
