"""Operator-level plans (ILP) applied on 2 and 4 ranks train to the single-process answer.

Each plan is made on the meta device at a size worth sharding (Megatron's choice, or data
parallelism for many tokens and tiny weights), applied to a tiny model of the same code and
trained 10 SGD steps beside plain PyTorch: the losses and the gathered full weights agree within
1e-5. The comm ledger of one step equals what a plan made at the tiny size predicts, per op and
phase, and every conversion of the table moves values and gradients as its layouts say.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tessera import comm
from tessera.checkpoint import full_state_dict
from tessera.planner.ilp import CostModel, OperatorPlan, conversion, plan_operators
from tessera.planner.ilp_apply import apply_operator_plan, reshard
from tessera.planner.ilp_ops import PARTIAL, REPLICATED, Need, Shard, Sharding
from tessera.testing import tolerance, use_layout
from tests.unit.test_planner_ilp import (
    DATA_PARALLEL,
    MEGATRON_ATTENTION,
    MEGATRON_MLP,
    MLP,
    Attention,
    LossMLP,
    Stack,
    meta_plan,
)

STEPS, LR = 10, 0.05
TOL = tolerance(steps=STEPS)  # the tiny models: at most one block (Stack) trained STEPS steps
RESHARD = tolerance(depth=4)  # a layout conversion: at most a sum over the 4 ranks' parts
H, HEADS, BATCH, SEQ = 16, 4, 2, 8
MEGATRON_STACK = {f"attn_{k}": v for k, v in MEGATRON_ATTENTION.items() if k in "qkvo"}
MEGATRON_STACK |= {"mlp_fc1": "column", "mlp_fc2": "row"}


def _tiny(kind: str) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The tiny model and its batches (the same on every rank)."""
    torch.manual_seed(0)
    model: nn.Module
    if kind == "mlp":
        model = MLP(H)
    elif kind in ("attention", "attention-dp"):
        model = Attention(H, HEADS)
    elif kind == "stack":
        model = Stack(H, HEADS)
    else:
        model = LossMLP(H)
    # data parallelism pays for tokens many times the weights' size: 512 tokens of 16
    shape = {"loss": (512, H), "attention-dp": (4, 64, H)}.get(kind, (BATCH, SEQ, H))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(2)]
    return model, batches * (STEPS // 2)  # two batches in turn: the loss of each falls


def _big_plan(kind: str, world: int):
    if kind == "stack":
        return meta_plan("stack", world, h=4096, heads=32, tokens=(2, 1024)), MEGATRON_STACK
    if kind == "loss":
        return meta_plan("loss", world, h=64, tokens=(1 << 20,)), DATA_PARALLEL
    if kind == "attention-dp":  # many tokens, narrow weights, slow compute: batch split everywhere
        plan = meta_plan("attention", world, h=64, heads=4, tokens=(256, 1024), costs=CostModel(flops=1e12))
        return plan, {name: "split(0)" for name in ("q", "k", "v", "scaled_dot_product_attention", "o")}
    return meta_plan(kind, world), MEGATRON_MLP if kind == "mlp" else MEGATRON_ATTENTION


def _loss(model: nn.Module, kind: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if kind in ("stack", "loss"):
        return model(x, y)
    return F.mse_loss(model(x), y)


def _plans(world: int, kind: str) -> tuple[OperatorPlan, OperatorPlan]:
    """The plan made at a size worth sharding, and one made for the tiny size itself with compute
    dear enough to split (the same choices: its collectives are what the ledger must count).
    Made in the test's process: the ranks need neither scipy nor the solve."""
    plan, expected = _big_plan(kind, world)
    assert {name: plan.strategy(name) for name in expected} == expected
    plain, batches = _tiny(kind)
    x, y = batches[0]
    inputs = (x, y) if kind in ("stack", "loss") else (x.clone().requires_grad_(),)
    small = plan_operators(plain, inputs, world, CostModel(flops=1e6, latency=0.0))
    assert {name: small.strategy(name) for name in expected} == expected
    return plan, small


def body_train(world: int, kind: str, plan: OperatorPlan, small: OperatorPlan) -> list[float]:
    ctx = use_layout(tensor=world)
    plain, batches = _tiny(kind)
    parallel = apply_operator_plan(copy.deepcopy(plain), plan, ctx)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=LR)
    opt_parallel = torch.optim.SGD(parallel.parameters(), lr=LR)
    losses = []
    for step, (x, y) in enumerate(batches):
        want = _loss(plain, kind, x, y)
        want.backward()
        opt_plain.step()
        opt_plain.zero_grad()
        xi = x.clone().requires_grad_(kind not in ("stack", "loss"))
        with comm.ledger() as forward:
            got = _loss(parallel, kind, xi, y)
        with comm.ledger() as backward:
            got.backward()
        opt_parallel.step()
        opt_parallel.zero_grad()
        torch.testing.assert_close(got, want, **TOL, msg=f"step {step}: loss")
        if step == 0:
            for phase, led in (("forward", forward), ("backward", backward)):
                for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
                    assert led.bytes(op, "tensor") == pytest.approx(small.comm_bytes(op, phase)), (phase, op)
                    assert led.calls(op, "tensor") == small.calls(op, phase), (phase, op)
        losses.append(float(got.detach()))
    full, reference = full_state_dict(parallel), plain.state_dict()
    assert full.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(full[key], value, **TOL, msg=key)
    return losses


@pytest.mark.parametrize("kind", ["mlp", "attention", "stack", "loss", "attention-dp"])
@pytest.mark.parametrize("world", [2, 4])
def test_plan_trains_to_single_process_answer(pools, world, kind):
    losses = pools.run(world, body_train, world, kind, *_plans(world, kind))
    assert all(rank == losses[0] for rank in losses)
    assert losses[0][-2] < losses[0][0] and losses[0][-1] < losses[0][1]  # it trained


def _held(full: torch.Tensor, layout: Sharding, ctx, seed: int) -> torch.Tensor:
    """This rank's part of ``full`` held in ``layout`` (partial sums: unequal addends)."""
    n, r = ctx.size("tensor"), ctx.local_rank("tensor")
    if layout.kind == "S":
        return full.chunk(n, dim=layout.dim)[r].clone()
    if layout.kind == "P":
        noise = torch.randn(full.shape, generator=torch.Generator().manual_seed(seed))
        return full / n + (r - (n - 1) / 2) * noise
    return full.clone()


def body_reshard_table(world: int) -> int:
    """Every conversion: the value arrives in the needed layout, the gradient (given in the
    layout dual to the need) returns in the layout dual to the source, and the ledger counts
    exactly the collectives of ``conversion``."""
    ctx = use_layout(tensor=world)
    group = ctx.group("tensor")
    full = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    grad = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    sources = [REPLICATED, Shard(0), Shard(1), PARTIAL]
    needs = [Need(REPLICATED), Need(REPLICATED, True), Need(Shard(0)), Need(Shard(1)), Need(PARTIAL)]
    checked = 0
    for source in sources:
        for need in needs:
            steps = conversion(source, need, full.numel() * 4, world, needs_grad=True)
            if steps is None:
                continue
            x = _held(full, source, ctx, seed=2).requires_grad_(True)
            with comm.ledger() as forward:
                out = reshard(x, source, need, group)
            # the consumer's gradient: whole for a replicated (or partial) need, its shard for a
            # split one, unequal addends when the consumer split the work (R*)
            upstream = _held(grad, PARTIAL if need.partial_grad else need.layout, ctx, seed=3)
            if need.layout.kind == "P":
                upstream = grad.clone()
            with comm.ledger() as backward:
                out.backward(upstream)
            if need.layout.kind == "P":  # partial sums: compare their sum
                total = comm.all_reduce(out.detach().clone(), group)
                torch.testing.assert_close(total, full, **RESHARD)
            else:
                torch.testing.assert_close(out, _held(full, need.layout, ctx, seed=2), **RESHARD)
            want_grad = grad.chunk(world, dim=source.dim)[group.rank] if source.kind == "S" else grad
            torch.testing.assert_close(x.grad, want_grad, **RESHARD, msg=f"{source} -> {need}: gradient")
            seen = [("forward", r.op, r.payload_bytes) for r in forward.records]
            seen += [("backward", r.op, r.payload_bytes) for r in backward.records]
            assert seen == steps, (source, need, seen)
            checked += 1
    return checked


@pytest.mark.parametrize("world", [2, 4])
def test_every_conversion_moves_values_and_gradients(pools, world):
    assert pools.run(world, body_reshard_table, world) == [18] * world
