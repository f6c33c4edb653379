"""The GPT's MoE preset trained 20 steps with its experts spread over 2 ranks, with data, 1D
tensor and pipeline parallelism beside them, against single-process training of the same
micro-batches (fp32, 1e-5): losses every step and every final weight.

A data-parallel rank's micro-batch is routed on its own (capacity, drops and auxiliary losses
per micro-batch), so the single-process reference accumulates the gradients of the same
micro-batches, in one process, through the engine: the semantics of gradient accumulation."""

from __future__ import annotations

import math

import pytest
import torch

import tessera
from tessera import comm
from tessera.checkpoint import full_state_dict
from tessera.models import NextTokenLoss, gpt
from tessera.nn.moe import take_routing_counts
from tessera.testing import use_layout

STEPS, GLOBAL_BATCH, SEQ = 20, 8, 16


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


def train(layout: dict, microbatches: int) -> tuple:
    """Train on this rank of ``layout`` (``{}``: one process); each data rank's share of the
    global batch cut into ``microbatches`` (a pipeline's, or the reference's accumulation)."""
    data = layout.get("data", 1)
    pipeline = layout.get("pipeline", 1)
    config = {
        "parallel": {
            "data": data,
            "expert": layout.get("expert", 1),
            "tensor": layout.get("tensor", 1),
            "pipeline": {"size": pipeline, "schedule": "1f1b", "microbatches": microbatches}
            if pipeline > 1
            else 1,
        },
        "gradient_accumulation": 1 if pipeline > 1 else microbatches,
    }
    ctx = use_layout(**layout, config=config)
    model = build()
    initial = full_state_dict(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    engine, _, _, _ = tessera.initialize(model, optimizer, NextTokenLoss())
    d = ctx.local_rank("data")
    with comm.ledger() as first_step:
        losses = [engine.train_batch(iter(micro_batches(0, d, data, microbatches)))]
    losses += [engine.train_batch(iter(micro_batches(s, d, data, microbatches))) for s in range(1, STEPS)]
    dropped = sum(n for _, n in take_routing_counts(model).values())
    final = full_state_dict(model)
    exchanged = first_step.summary().get(("all_to_all", "expert"))
    return losses, dropped, (initial, final) if ctx.rank == 0 else None, exchanged


LAYOUTS = {
    # name: (ranks, layout, micro-batches per data rank)
    "ep2-dp2": (4, dict(data=4, expert=2), 1),
    "ep2-tp2": (4, dict(data=2, expert=2, tensor=2), 1),
    "ep2-pp2": (4, dict(data=2, expert=2, pipeline=2), 2),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_gpt_trains_to_the_single_process_answer(pools, name):
    ranks, layout, m = LAYOUTS[name]
    data = layout["data"]
    reference = train({}, data * m)  # the same micro-batches, accumulated in one process
    results = pools.run(ranks, train, layout, m, timeout=600)
    losses, dropped, (initial, final), _ = results[0]
    ref_losses, ref_dropped, (ref_initial, ref_final), _ = reference
    assert ref_dropped > 0, "capacity drops were exercised"
    # the same assignments dropped: every tensor rank routes alike, each stage counts its layers
    assert sum(r[1] for r in results) == ref_dropped * layout.get("tensor", 1)
    for key in ref_initial:
        assert torch.equal(initial[key], ref_initial[key]), key
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert all(r[0] == losses for r in results), "every rank reports the same loss"
    assert final.keys() == ref_final.keys()
    for key in ref_final:
        torch.testing.assert_close(final[key], ref_final[key], rtol=1e-5, atol=1e-5, msg=key)


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
    for d in range(layout["data"]):
        model(x[d : GLOBAL_BATCH : layout["data"]])
    expected = {name: counts.tolist() for name, (counts, _) in take_routing_counts(model).items()}
    assert history[0]["moe_tokens_per_expert"] == expected
    layers, top_k = 2, 2
    for metrics in history:
        kept = sum(sum(c) for c in metrics["moe_tokens_per_expert"].values())
        assert kept + metrics["moe_dropped"] == layers * GLOBAL_BATCH * SEQ * top_k
        assert metrics["moe_imbalance"] >= 1.0
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:4] == b"\x89PNG"
