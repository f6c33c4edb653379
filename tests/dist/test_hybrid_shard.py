"""Hybrid sharding (``zero.shard="host"``, docs/zero.md): ZeRO shards over the data ranks of each
host and repeats the shards on every host. The pool's ranks share one machine, so each test
simulates hosts, two ranks a host (``hosts.discover(hostname=...)``, collective), and puts the
real hosts back afterwards; ``use_layout`` builds a context of its own per hosts map.

- 2 hosts x 2 ranks, data=4, ZeRO-3 (and stages 1 and 2, Gemini with every part on the
  device) train 10 steps to single-process AdamW's losses and weights (fp32, clipping on);
- the comm ledger's bytes between hosts per step are the formula's (``tessera.zero.hybrid``), and
  at most half of plain ZeRO-3's on the same job and hosts;
- the whole-parameter norms of the pieces (LAMB, LARS) sum inside a host, each piece once;
- a hybrid-sharded checkpoint resumes bit for bit, loads into plain ZeRO-3, and consolidates to
  every weight and optimizer state;
- one host: plain sharding, with a warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import tessera
from tessera import comm
from tessera.checkpoint import full_state_dict, load, save
from tessera.checkpoint.tools import consolidate
from tessera.context import hosts
from tessera.context.placement import placement_of
from tessera.models import NextTokenLoss, gpt
from tessera.optim.norms import whole_sq_norms, zero_layout_of
from tessera.testing import use_layout
from tessera.zero import hybrid
from tests.dist.reference import adamw_reference

STEPS = 10
GLOBAL_BATCH = 8
SEQ = 16
CHUNK_MB = 0.016  # ~4k fp32 elements a chunk: the small GPT spreads over several chunks
CLIP = 0.05  # below the gradient norms: the global norm (summed inside a host) acts on every step
PER_HOST = 2


@contextmanager
def simulated_hosts(per_host: int = PER_HOST) -> Iterator[None]:
    """Every ``per_host`` consecutive ranks of the pool on a host of their own (collective),
    the real hosts back afterwards."""
    hosts.discover(hostname=f"h{dist.get_rank() // per_host}")
    try:
        yield
    finally:
        hosts.discover()


def build():
    torch.manual_seed(0)
    return gpt("tiny", vocab_size=64, max_seq_len=SEQ, d_model=32, n_layers=2, n_heads=4)


def dataset(steps: int = STEPS) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 64, (GLOBAL_BATCH * steps, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def config_of(stage: int = 3, shard: str = "host", gemini: bool = False, accumulation: int = 2, clip=CLIP) -> dict:
    config: dict = {
        "parallel": {"data": 4},
        "zero": {"stage": 0 if gemini else stage, "chunk_mb": CHUNK_MB, "shard": shard},
        "gradient_accumulation": accumulation,
        "clip_grad_norm": clip,
    }
    if gemini:
        config["gemini"] = {"enabled": True, "placement": "static", "chunk_mb": CHUNK_MB}
    return config


def setup(config: dict):
    """The engine and loader of ``config`` on this rank (the layout over the hosts in effect)."""
    ctx = use_layout(data=4, config=config)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    micro = GLOBAL_BATCH // (ctx.size("data") * config["gradient_accumulation"])
    loader = DataLoader(dataset(), batch_size=micro)
    engine, loader, _, _ = tessera.initialize(model, optimizer, NextTokenLoss(), loader)
    return engine, loader


def train(config: dict):
    with simulated_hosts():
        engine, loader = setup(config)
        it = iter(loader)
        losses = [engine.train_batch(it) for _ in range(STEPS)]
        state = full_state_dict(engine)
        sharded = engine.strategy.sharded
        groups = (sharded.group.name, sharded.group.size, sharded.across.name, sharded.across.size)
        engine.close()
    return losses, state, groups


def reference():
    """Plain single-process PyTorch on the global batch, clipped as the runs are."""
    return adamw_reference(build, dataset(), STEPS, GLOBAL_BATCH, CLIP)


@pytest.fixture(scope="module")
def single_process():
    return reference()


@pytest.mark.parametrize("case", ["zero3", "zero1", "zero2", "gemini"])
def test_hybrid_sharding_equals_single_process_training(pools, single_process, case):
    config = config_of(stage=int(case[-1])) if case != "gemini" else config_of(gemini=True)
    ref_losses, ref_state = single_process
    for losses, state, groups in pools.run(4, train, config, timeout=300):
        assert groups == ("data.host", 2, "data.across", 2)  # shards inside a host, repeated on both
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        assert state.keys() == ref_state.keys()
        for key, value in ref_state.items():
            drift = float((state[key] - value).norm() / value.norm().clamp_min(1e-12))
            assert drift <= 1e-5, f"{case}: {key} is {drift:.2e} (relative, in norm) from single-process training"


# ---- communication between hosts --------------------------------------------------------------


def one_step_ledger(shard: str):
    """One step's ledger of ZeRO-3 over 2 hosts x 2 ranks (after a first step), and which of
    its axes' groups span hosts."""
    with simulated_hosts():
        engine, loader = setup(config_of(shard=shard, accumulation=1, clip=None))
        it = iter(loader)
        engine.train_batch(it)
        with comm.ledger() as led:
            engine.train_batch(it)
        ctx, sharded = engine.ctx, engine.strategy.sharded
        groups = {g.name: g for g in (ctx.group("data"), ctx.group("world"), sharded.group)}
        if sharded.across is not None:
            groups[sharded.across.name] = sharded.across
        spans = {name: len({ctx.hosts[r] for r in g.ranks}) > 1 for name, g in groups.items()}
        shards = [c.shard_numel for c in sharded.chunks]
        formula = float(hybrid.inter_host_bytes(sharded.chunks, 2, 4)) if sharded.across is not None else None
        n_params = sum(p.numel() for p in engine.model.parameters())
        engine.close()
    return led.summary(), spans, shards, formula, n_params


def between_hosts(summary: dict, spans: dict) -> float:
    """Bytes of the collectives whose group spans hosts (every axis in the ledger must be known)."""
    assert {axis for _, axis in summary} <= set(spans), summary
    return sum(v["bytes"] for (_, axis), v in summary.items() if spans[axis])


def test_bytes_between_hosts_follow_the_formula_and_halve_plain_zero3(pools):
    hybrid_run = pools.run(4, one_step_ledger, "host", timeout=300)
    plain_run = pools.run(4, one_step_ledger, "all", timeout=300)
    for (summary, spans, shards, formula, n), (plain, plain_spans, _, _, _) in zip(hybrid_run, plain_run):
        assert spans == {"data": True, "world": True, "data.host": False, "data.across": True}
        # between hosts: each chunk's gradient shard all-reduced over 2 hosts, 2 (H-1)/H * S * 4 bytes
        across = {op: v["bytes"] for (op, axis), v in summary.items() if axis == "data.across"}
        assert across == {"all_reduce": formula}
        assert formula == 2 * (2 - 1) / 2 * sum(shards) * 4
        assert formula == pytest.approx(2 * (1 / 2) * (n / 2) * 4, rel=0.01)  # P / G elements, G = 2 a host
        # and nothing else crosses but the engine's loss average (one fp32 scalar over the data axis)
        assert {op: v["bytes"] for (op, axis), v in summary.items() if axis == "data"} == {"all_reduce": 2 * 3 / 4 * 4}
        # the parameters' gathers and the gradients' reduce-scatters stay inside each host
        assert summary["all_gather", "data.host"]["bytes"] == pytest.approx(2 * (1 / 2) * n * 4, rel=0.01)
        assert summary["reduce_scatter", "data.host"]["bytes"] == pytest.approx((1 / 2) * n * 4, rel=0.01)
        # plain ZeRO-3 on the same hosts: its data group spans them, so all of its 3 (N-1)/N P moves between hosts
        assert plain_spans == {"data": True, "world": True}
        plain_between = between_hosts(plain, plain_spans)
        assert plain_between == pytest.approx(3 * (3 / 4) * n * 4 + 6, rel=0.01)
        assert between_hosts(summary, spans) <= plain_between / 2


def whole_norms_of_pieces():
    """LAMB's and LARS's whole-parameter norms from hybrid ZeRO-3's pieces (summed inside a host:
    over both hosts every piece would count twice), against the parameters' own."""
    with simulated_hosts():
        engine, _ = setup(config_of())
        sharded = engine.strategy.sharded
        pieces = [piece for _, _, piece, _, _ in sharded.held_pieces()]
        got = whole_sq_norms(pieces, pieces, engine.ctx, zero_layout_of(sharded.optimizer, 1))
        with sharded.gathered():
            expected = [float(sharded.params[placement_of(p).zero.index].detach().square().sum()) for p in pieces]
        engine.close()
    return got.tolist(), expected


def test_norms_of_hybrid_pieces_are_the_whole_parameters_norms(pools):
    for got, expected in pools.run(4, whole_norms_of_pieces, timeout=300):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)


# ---- checkpoints --------------------------------------------------------------------------------

BEFORE, AFTER = 3, 3


def train_save_continue(path: str):
    with simulated_hosts():
        engine, loader = setup(config_of(accumulation=1))
        it = iter(loader)
        for _ in range(BEFORE):
            engine.train_batch(it)
        saved = full_state_dict(engine)
        save(path, engine, dataloader=loader)
        losses = [engine.train_batch(it) for _ in range(AFTER)]
        state = full_state_dict(engine)
        engine.close()
    return saved, losses, state


def load_continue(path: str, shard: str, simulate: bool):
    """Load the checkpoint into ZeRO-3 with ``shard`` (over simulated hosts or the real one) and
    train the steps after it."""
    with simulated_hosts() if simulate else nullcontext():
        engine, loader = setup(config_of(shard=shard, accumulation=1))
        step = load(path, engine, dataloader=loader)
        loaded = full_state_dict(engine)
        it = iter(loader)
        losses = [engine.train_batch(it) for _ in range(AFTER)]
        state = full_state_dict(engine)
        engine.close()
    return step, loaded, losses, state


def test_a_hybrid_sharded_checkpoint_resumes_and_loses_nothing(pools, tmp_path: Path):
    path = str(tmp_path / "ckpt")
    saved, losses, state = pools.run(4, train_save_continue, path, timeout=300)[0]
    # into the same layout: bit for bit
    step, loaded, resumed, resumed_state = pools.run(4, load_continue, path, "host", True, timeout=300)[0]
    assert step == BEFORE and resumed == losses
    assert all(torch.equal(loaded[k], saved[k]) for k in saved) and loaded.keys() == saved.keys()
    assert all(torch.equal(resumed_state[k], state[k]) for k in state)
    # into plain ZeRO-3 on one host: the same weights, and the same steps within rounding
    step, loaded, plain, _ = pools.run(4, load_continue, path, "all", False, timeout=300)[0]
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    torch.testing.assert_close(torch.tensor(plain), torch.tensor(losses), rtol=1e-5, atol=0)
    # every weight and every optimizer state of every parameter, whole
    out = tmp_path / "whole.safetensors"
    consolidate(path, out, optimizer=True)
    from safetensors.torch import load_file

    whole = load_file(str(out))
    for key, value in saved.items():
        assert torch.equal(whole[key], value), key
    for key, param in build().named_parameters():  # each trained parameter once (tied ones by their first name)
        for kind in ("exp_avg", "exp_avg_sq"):
            got = whole[f"optim/{key}/{kind}"]
            assert got.shape == param.shape and bool(torch.isfinite(got).all()), (key, kind)


# ---- one host -------------------------------------------------------------------------------------


def one_host():
    hybrid._warned = False  # once per process: this test sees it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, loader = setup(config_of(accumulation=1))
    sharded = engine.strategy.sharded
    found = (
        sharded.group.name,
        sharded.across,
        [str(w.message) for w in caught if w.category is hybrid.OneHostWarning],
    )
    engine.train_batch(iter(loader))
    engine.close()
    return found


def test_on_one_host_hybrid_sharding_is_plain_sharding_with_a_warning(pools):
    results = pools.run(4, one_host, timeout=300)
    for rank, (group, across, caught) in enumerate(results):
        assert group == "data" and across is None
        assert len(caught) == (1 if rank == 0 else 0)
    assert "are on one host" in results[0][2][0] and "zero.shard='all'" in results[0][2][0]
