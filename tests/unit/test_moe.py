"""tessera.nn.MoE against a per-token reference written from the definitions (top-k routing,
capacity served first choices first and earlier tokens first, the load-balancing and z losses):
outputs, gradients, auxiliary losses and the dropped assignments, for top-1 and top-2, with and
without capacity drops, GELU and SwiGLU experts."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tessera.nn.moe import MoE, auxiliary_loss, take_routing_counts
from tessera.testing import assert_draws_clear, route_draws, tolerance

D, FF, E, T = 8, 16, 4, 24
LAYER = tolerance(blocks=1)  # one MoE layer (router, an expert's MLP, the weighted sum), computed two ways


def expert_mlp(moe: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    ex = moe.experts
    hidden = x @ ex.w_in[e]
    hidden = F.silu(x @ ex.w_gate[e]) * hidden if ex.w_gate is not None else F.gelu(hidden)
    return hidden @ ex.w_out[e]


def reference(moe: MoE, x: torch.Tensor):
    """Token by token: (output, load-balancing loss, z-loss, dropped (choice, token) pairs)."""
    logits = x @ moe.router.weight.t()
    probs = logits.softmax(-1)
    top_p, top_e = probs.topk(moe.top_k, dim=-1)
    if moe.normalize:
        top_p = top_p / top_p.sum(-1, keepdim=True)
    capacity = math.inf if moe.capacity_factor is None else math.ceil(moe.capacity_factor * T * moe.top_k / E)
    used = [0] * E
    out = [torch.zeros(D) for _ in range(T)]
    dropped = set()
    for choice in range(moe.top_k):
        for t in range(T):
            e = int(top_e[t, choice])
            if used[e] >= capacity:
                dropped.add((choice, t))
                continue
            used[e] += 1
            out[t] = out[t] + top_p[t, choice] * expert_mlp(moe, e, x[t])
    routed = torch.zeros(E)
    for e in top_e.reshape(-1).tolist():
        routed[e] += 1
    balance = E * sum(routed[e] / (T * moe.top_k) * probs[:, e].mean() for e in range(E))
    z = torch.logsumexp(logits, -1).pow(2).mean()
    return torch.stack(out), balance, z, dropped


CASES = [(k, cf, act) for k in (1, 2) for cf in (None, 1.0, 0.5) for act in ("gelu", "swiglu")]


@pytest.mark.parametrize(("top_k", "capacity_factor", "activation"), CASES)
def test_moe_matches_the_per_token_reference(top_k, capacity_factor, activation):
    torch.manual_seed(0)
    moe = MoE(D, FF, E, top_k=top_k, capacity_factor=capacity_factor, activation=activation)
    x = torch.randn(2, T // 2, D, requires_grad=True)
    y = moe(x)
    x_ref = x.detach().reshape(T, D).clone().requires_grad_(True)
    y_ref, balance, z, dropped = reference(moe, x_ref)
    # the reference's router product rounds otherwise: no token near a tie, so the same routing
    assert_draws_clear(route_draws(x_ref.detach() @ moe.router.weight.detach().t(), moe.top_k), blocks=1)
    torch.testing.assert_close(y.reshape(T, D), y_ref, **LAYER)
    torch.testing.assert_close(moe.stats.load_balance, balance, **LAYER)
    torch.testing.assert_close(moe.stats.z_loss, z, **LAYER)
    assert moe.stats.dropped == len(dropped)
    if capacity_factor == 0.5:
        assert dropped, "a capacity of half the mean load drops assignments"
    assert int(moe.stats.tokens_per_expert.sum()) == T * top_k - len(dropped)
    # gradients of the output and the auxiliary losses (which enter through the output's
    # backward, weighed by aux_grad_scale), against the reference's
    probe = torch.randn(T, D)
    params = [p for p in moe.parameters()]
    moe.aux_grad_scale = 0.5
    loss = (y.reshape(T, D) * probe).sum()
    grads = torch.autograd.grad(loss, [x, *params], allow_unused=True)
    loss_ref = (y_ref * probe).sum() + 0.5 * (moe.aux_loss_weight * balance + moe.z_loss_weight * z)
    grads_ref = torch.autograd.grad(loss_ref, [x_ref, *params], allow_unused=True)
    backward = tolerance(depth=2 * 8)  # the layer's forward and backward
    torch.testing.assert_close(grads[0].reshape(T, D), grads_ref[0], **backward)
    for got, want in zip(grads[1:], grads_ref[1:]):
        torch.testing.assert_close(got, want, **backward)


def test_the_dropped_tokens_are_the_later_ones():
    """Every token sent to one expert of capacity 2: the first two tokens are served, the rest
    come out as zeros (the residual carries them)."""
    torch.manual_seed(0)
    moe = MoE(D, FF, E, top_k=1, capacity_factor=2 * E / T)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[2] = 1.0
    x = torch.rand(T, D) + 0.1  # positive: expert 2 wins every token
    y = moe(x)
    assert moe.stats.capacity == 2 and moe.stats.dropped == T - 2
    assert moe.stats.tokens_per_expert.tolist() == [0, 0, 2, 0]
    assert y[:2].abs().sum() > 0 and torch.count_nonzero(y[2:]) == 0


def test_balanced_routing_has_a_load_balancing_loss_of_one_and_the_model_sums_the_losses():
    torch.manual_seed(0)
    first, second = MoE(D, FF, E, top_k=1), MoE(D, FF, E, top_k=2)
    with torch.no_grad():
        first.router.weight.zero_()  # uniform probabilities, routing ties broken the same way
    model = torch.nn.Sequential(first, second)
    model(torch.randn(T, D))
    assert first.stats.load_balance == pytest.approx(1.0)  # E * sum(f_e / E) with P_e = 1/E
    total = auxiliary_loss(model)
    assert total is not None
    torch.testing.assert_close(total, first.aux_loss + second.aux_loss)
    assert auxiliary_loss(torch.nn.Linear(2, 2)) is None


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="top_k=5"):
        MoE(D, FF, E, top_k=5)
    with pytest.raises(ValueError, match="capacity_factor"):
        MoE(D, FF, E, capacity_factor=0.0)
    with pytest.raises(ValueError, match="activation"):
        MoE(D, FF, E, activation="relu")  # type: ignore[arg-type]


def test_routing_counts_add_up_over_forwards_but_not_over_recomputes():
    """take_routing_counts sums the kept assignments of every forward since the last call; a
    block recomputed by activation checkpointing in the backward is not counted twice, and its
    gradients are those of the plain forward (auxiliary losses included)."""
    torch.manual_seed(0)
    moe = MoE(D, FF, E, top_k=2, capacity_factor=1.0)
    model = torch.nn.Sequential(moe)
    xs = [torch.randn(T, D) for _ in range(2)]
    expected = torch.zeros(E, dtype=torch.long)
    dropped = 0
    plain = []
    for x in xs:
        moe(x).square().sum().backward()
        expected += moe.stats.tokens_per_expert
        dropped += moe.stats.dropped
        plain.append([p.grad.clone() for p in moe.parameters()])
        moe.zero_grad()
    take_routing_counts(model)
    for x, grads in zip(xs, plain):
        y = torch.utils.checkpoint.checkpoint(moe, x, use_reentrant=False)
        y.square().sum().backward()
        for p, g in zip(moe.parameters(), grads):
            torch.testing.assert_close(p.grad, g)
        moe.zero_grad()
    counts = take_routing_counts(model)
    assert counts["0"][0].tolist() == expected.tolist() and counts["0"][1] == dropped
    assert take_routing_counts(model)["0"][0].tolist() == [0] * E
