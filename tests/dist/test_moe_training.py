"""The GPT's MoE preset trained 6 steps with its experts spread over 2 ranks, with data, 1D
tensor and pipeline parallelism beside them, against single-process training of the same
micro-batches (fp32, ``tessera.testing.tolerance``): losses every step, every final weight, and
the first step's dropped assignments (no token of it near a tie between experts).

A data-parallel rank's micro-batch is routed on its own (capacity, drops and auxiliary losses
per micro-batch), so the single-process reference accumulates the gradients of the same
micro-batches, in one process, through the engine: the semantics of gradient accumulation."""

from __future__ import annotations

import math
from functools import cache

import pytest
import torch

import tessera
from tessera import comm
from tessera.checkpoint import full_state_dict
from tessera.models import NextTokenLoss, gpt
from tessera.nn.moe import take_routing_counts
from tessera.parallel.experts import is_expert
from tessera.testing import assert_draws_clear, recorded_routes, tolerance, use_layout

# a handful of AdamW steps reach every path (the first step, bias correction, accumulated states)
STEPS, GLOBAL_BATCH, SEQ = 6, 8, 16


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt("tiny-moe", vocab_size=64, max_seq_len=SEQ, d_model=32, n_layers=2, n_heads=4, d_ff=32, num_experts=4)


def tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 64, (STEPS * GLOBAL_BATCH, SEQ + 1), generator=g)


def micro_batches(step: int, part: int, parts: int, splits: int):
    """Part ``part`` of ``parts`` of the step's global batch, cut in ``splits`` micro-batches."""
    rows = tokens()[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH].chunk(parts)[part]
    return [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in rows.chunk(splits)]


def train(layout: dict, microbatches: int, zero: int = 0, optim: str = "adamw", clip: float | None = None) -> tuple:
    """Train on this rank of ``layout`` (``{}``: one process); each data rank's share of the
    global batch cut into ``microbatches`` (a pipeline's, or the reference's accumulation);
    with ZeRO stage ``zero``, ``optim`` (AdamW, or LAMB, whose trust ratios take whole-parameter
    norms) and clipping at ``clip``."""
    data = layout.get("data", 1)
    pipeline = layout.get("pipeline", 1)
    config = {
        "parallel": {
            "data": data,
            "expert": layout.get("expert", 1),
            "tensor": layout.get("tensor", 1),
            "pipeline": {"size": pipeline, "schedule": "1f1b", "microbatches": microbatches} if pipeline > 1 else 1,
        },
        "gradient_accumulation": 1 if pipeline > 1 else microbatches,
        "zero": {"stage": zero},
        "clip_grad_norm": clip,
    }
    ctx = use_layout(**layout, config=config)
    model = build()
    initial = full_state_dict(model)
    if optim == "lamb":
        optimizer = tessera.optim.LAMB(model.parameters(), lr=3e-3, eps=1e-6)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    engine, _, _, _ = tessera.initialize(model, optimizer, NextTokenLoss())
    d = ctx.local_rank("data")
    losses, norms = [], []
    for s in range(STEPS):
        with comm.ledger() as ledger:
            losses.append(engine.train_batch(iter(micro_batches(s, d, data, microbatches))))
        norms.append(engine.last_grad_norm)  # the clipped gradient's norm before clipping
        if s == 0:  # the first step's all-to-alls and dropped assignments
            exchanged = ledger.summary().get(("all_to_all", "expert"))
            dropped = sum(n for _, n in take_routing_counts(model).values())
    final = full_state_dict(model)
    stepped = {True: 0, False: 0}  # elements this rank's optimizer steps: expert, other
    for group in engine.optimizer.param_groups:
        for p in group["params"]:
            stepped[is_expert(p)] += p.numel()
    return losses, dropped, (initial, final) if ctx.rank == 0 else None, exchanged, norms, stepped


@cache
def single_process(microbatches: int, optim: str, clip: float | None) -> tuple:
    """The same micro-batches accumulated in one process (once per module for the layouts that
    share them)."""
    return train({}, microbatches, 0, optim, clip)


LAYOUTS = {
    # name: (ranks, layout, micro-batches per data rank[, ZeRO stage, optimizer])
    "ep2-dp2": (4, dict(data=4, expert=2), 1),
    "ep2-tp2": (4, dict(data=2, expert=2, tensor=2), 1),
    "ep2-pp2": (4, dict(data=2, expert=2, pipeline=2), 2),
    # ZeRO shards the experts over expert_data (2 ranks each), the rest over all 4 data ranks
    "ep2-dp2-zero1-lamb": (4, dict(data=4, expert=2), 1, 1, "lamb"),
    "ep2-dp2-zero2": (4, dict(data=4, expert=2), 2, 2, "adamw"),
    "ep2-dp2-zero3": (4, dict(data=4, expert=2), 1, 3, "adamw"),
    "ep2-tp2-zero2": (4, dict(data=2, expert=2, tensor=2), 1, 2, "adamw"),
    "ep2-pp2-zero1": (4, dict(data=2, expert=2, pipeline=2), 2, 1, "adamw"),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_gpt_trains_to_the_single_process_answer(pools, name):
    ranks, layout, m, *sharded = LAYOUTS[name]
    zero, optim = sharded or (0, "adamw")
    data = layout["data"]
    clip = 0.5 if zero else None  # below most steps' gradient norms
    reference = single_process(data * m, optim, clip)  # the same micro-batches, accumulated in one process
    # the first step's drops are compared: no token of its micro-batches near a tie between experts
    # (top-2, served in order of choice), so every layout routes them alike. Later steps' routing
    # is not compared: after a few steps some tokens lie within the tolerance of a tie
    with recorded_routes() as routes:
        first = build()
        for x, _ in micro_batches(0, 0, 1, data * m):
            first(x)
    assert_draws_clear(routes, blocks=2)
    tol = tolerance(blocks=2, steps=STEPS)
    results = pools.run(ranks, train, layout, m, zero, optim, clip, timeout=600)
    losses, _, (initial, final), _, norms, _ = results[0]
    ref_losses, ref_dropped, (ref_initial, ref_final), _, ref_norms, ref_stepped = reference
    assert ref_dropped > 0, "capacity drops were exercised"
    # the first step's assignments dropped alike: every tensor rank routes alike, each stage counts its layers
    assert sum(r[1] for r in results) == ref_dropped * layout.get("tensor", 1)
    for key in ref_initial:
        assert torch.equal(initial[key], ref_initial[key]), key
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **tol)
    assert all(r[0] == losses for r in results), "every rank reports the same loss"
    if clip is not None:  # each whole parameter counted once: experts, their ZeRO pieces and tensor blocks
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), **tol)
        assert sum(n > clip for n in ref_norms) > STEPS // 2, "clipping scaled most steps"
    if zero and set(layout) == {"data", "expert"}:  # ZeRO: each element stepped by one rank only
        expert_numel = sum(p.numel() for n, p in build().named_parameters() if ".experts." in n)
        assert sum(r[5][True] for r in results) == expert_numel > 0
        assert sum(r[5][False] for r in results) == sum(ref_stepped.values()) - expert_numel > 0
    assert final.keys() == ref_final.keys()
    for key in ref_final:
        torch.testing.assert_close(final[key], ref_final[key], **tol, msg=key)


def test_the_ledger_counts_the_formulas_all_to_all_bytes(pools):
    """Per MoE layer and micro-batch, two all-to-alls forward (dispatch, combine) and two in the
    backward, each of the [experts, capacity, d_model] buffer: capacity = ceil(factor x tokens x
    top_k / experts), so the buffer is about factor x top_k x tokens x d_model; a rank sends
    (n - 1) / n of it."""
    world, layout, _ = LAYOUTS["ep2-dp2"]
    results = pools.run(world, train, layout, 1, timeout=600)
    tokens_per_rank = GLOBAL_BATCH // layout["data"] * SEQ
    experts, d_model, layers, n = 4, 32, 2, layout["expert"]
    capacity = math.ceil(1.25 * tokens_per_rank * 2 / experts)
    buffer = experts * capacity * d_model * 4  # fp32
    for r in results:
        assert r[3] == {"calls": layers * 4, "payload_bytes": layers * 4 * buffer,
                        "bytes": layers * 4 * buffer * (n - 1) / n}  # fmt: skip


def train_with_routing_hook(layout: dict, plot: str) -> tuple:
    from torch.utils.data import DataLoader, TensorDataset

    from tessera.engine import RoutingHook, Trainer

    config = {"parallel": {"data": layout["data"], "expert": layout["expert"], "tensor": layout.get("tensor", 1)}}
    ctx = use_layout(**layout, config=config)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    t = tokens()
    loader = DataLoader(TensorDataset(t[:, :-1], t[:, 1:]), batch_size=GLOBAL_BATCH // layout["data"])
    engine, loader, _, _ = tessera.initialize(model, optimizer, NextTokenLoss(), loader)
    history = Trainer(engine, [RoutingHook(plot=plot)]).fit(loader, steps=3)
    return history if ctx.rank == 0 else None


def test_the_trainer_logs_each_experts_load_over_the_global_batch_and_plots_it(pools, tmp_path):
    """RoutingHook's counts of the first step equal the single-process layers' on the same
    micro-batches (each data rank's share: samples r, r + P, ...), counted once over the tensor
    ranks; every step accounts for every assignment (kept + dropped); rank 0 draws the PNG."""
    layout = dict(data=2, expert=2, tensor=2)
    plot = tmp_path / "experts.png"
    history = pools.run(4, train_with_routing_hook, layout, str(plot), timeout=600)[0]
    use_layout(config={})
    model = build()
    x = tokens()[:, :-1]
    with recorded_routes() as routes:
        for d in range(layout["data"]):
            model(x[d : GLOBAL_BATCH : layout["data"]])
    assert_draws_clear(routes, blocks=2)  # no token near a tie between experts: the same counts
    expected = {name: counts.tolist() for name, (counts, _) in take_routing_counts(model).items()}
    assert history[0]["moe_tokens_per_expert"] == expected
    layers, top_k = 2, 2
    for metrics in history:
        kept = sum(sum(c) for c in metrics["moe_tokens_per_expert"].values())
        assert kept + metrics["moe_dropped"] == layers * GLOBAL_BATCH * SEQ * top_k
        assert metrics["moe_imbalance"] >= 1.0
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:4] == b"\x89PNG"


BEFORE, AFTER = 3, 3  # within the STEPS steps of tokens()


def train_with_checkpoint(layout: dict, zero: int, path: str, resume: bool) -> tuple | None:
    """Under ``layout`` with ZeRO stage ``zero``: train BEFORE steps and save into ``path``
    (or load from it), then the next AFTER steps; their losses and the final weights (rank 0)."""
    from tessera.checkpoint import load, save

    config = {"parallel": {"data": layout["data"], "expert": layout["expert"]}, "zero": {"stage": zero}}
    ctx = use_layout(**layout, config=config)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    engine, _, _, _ = tessera.initialize(model, optimizer, NextTokenLoss())
    d, data = ctx.local_rank("data"), layout["data"]
    if resume:
        assert load(path, engine) == BEFORE
    else:
        for s in range(BEFORE):
            engine.train_batch(iter(micro_batches(s, d, data, 1)))
        save(path, engine)
    losses = [engine.train_batch(iter(micro_batches(s, d, data, 1))) for s in range(BEFORE, BEFORE + AFTER)]
    final = full_state_dict(model)
    return (losses, final) if ctx.rank == 0 else None


@pytest.mark.parametrize("target", [(dict(data=4, expert=4), 0), (dict(data=4, expert=1), 3)], ids=["ep4", "ep1-zero3"])
def test_an_ep2_zero2_checkpoint_resumes_under_other_expert_layouts(pools, tmp_path, target):
    """Saved with the experts spread over 2 ranks and ZeRO-2 sharding them over the other 2
    (optimizer states included), it loads with one expert per rank, or with every expert on
    every rank under ZeRO-3: the next steps match the uninterrupted run (same data ranks, so the
    same micro-batches route alike)."""
    path = str(tmp_path / "ep2-zero2")
    expected = pools.run(4, train_with_checkpoint, dict(data=4, expert=2), 2, path, False, timeout=600)[0]
    layout, zero = target
    losses, final = pools.run(4, train_with_checkpoint, layout, zero, path, True, timeout=600)[0]
    tol = tolerance(blocks=2, steps=BEFORE + AFTER)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected[0]), **tol)
    for key in expected[1]:
        torch.testing.assert_close(final[key], expected[1][key], **tol, msg=key)
