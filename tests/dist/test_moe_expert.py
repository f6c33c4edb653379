"""tessera.nn.MoE with its experts spread over 2 and 4 ranks (expert parallelism over the data
ranks, tokens exchanged by all-to-all) against the single-process layer run on each rank's batch:
outputs, auxiliary losses, dropped assignments, and gradients (the input's and the router's per
rank; each local expert's summed over every rank's tokens), for top-1 and top-2, with and
without capacity drops; and the ledger's all-to-all bytes against the formula."""

from __future__ import annotations

import pytest
import torch

D, FF, E, T = 8, 16, 8, 32


def ep_body(top_k: int, capacity_factor: float | None, activation: str) -> dict:
    from tessera import comm
    from tessera.nn.moe import MoE
    from tessera.testing import use_layout

    ctx = use_layout(data=torch.distributed.get_world_size())
    group = ctx.group("data")
    rank, n = group.rank, group.size
    torch.manual_seed(0)
    full = MoE(D, FF, E, top_k=top_k, capacity_factor=capacity_factor, activation=activation)
    torch.manual_seed(1)
    xs, probes = torch.randn(n, T, D), torch.randn(n, T, D)
    ep = MoE(D, FF, E, top_k=top_k, capacity_factor=capacity_factor, activation=activation, group=group)
    local = slice(rank * E // n, (rank + 1) * E // n)
    names = [name for name, p in full.experts.named_parameters()]
    with torch.no_grad():
        ep.router.weight.copy_(full.router.weight)
        for name in names:
            getattr(ep.experts, name).copy_(getattr(full.experts, name)[local])
    x = xs[rank].clone().requires_grad_(True)
    with comm.ledger() as forward:
        y = ep(x)
    with comm.ledger() as backward:
        ((y * probes[rank]).sum() + ep.aux_loss).backward()

    expert_grads = {name: torch.zeros_like(getattr(full.experts, name)) for name in names}
    for s in range(n):  # the single-process layer on each rank's batch
        xr = xs[s].clone().requires_grad_(True)
        yr = full(xr)
        params = [full.router.weight, *(getattr(full.experts, name) for name in names)]
        grads = torch.autograd.grad((yr * probes[s]).sum() + full.aux_loss, [xr, *params])
        for name, g in zip(names, grads[2:]):
            expert_grads[name] += g
        if s == rank:
            mine = (yr.detach(), grads[0], grads[1], full.stats, full.aux_loss.detach())
    y_ref, x_grad, router_grad, stats, aux = mine
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ep.aux_loss.detach(), aux, rtol=1e-5, atol=1e-7)
    assert ep.stats.dropped == stats.dropped and ep.stats.capacity == stats.capacity
    torch.testing.assert_close(x.grad, x_grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ep.router.weight.grad, router_grad, rtol=1e-5, atol=1e-6)
    for name in names:
        torch.testing.assert_close(getattr(ep.experts, name).grad, expert_grads[name][local], rtol=1e-5, atol=1e-6)
    slots = ep.stats.capacity
    return {"forward": forward.summary(), "backward": backward.summary(), "slots": slots, "dropped": stats.dropped}


CASES = [(1, None, "gelu"), (2, None, "swiglu"), (1, 0.5, "swiglu"), (2, 1.0, "gelu")]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("top_k", "capacity_factor", "activation"), CASES)
def test_expert_parallel_moe_matches_the_single_process_layer(pools, world, top_k, capacity_factor, activation):
    results = pools.run(world, ep_body, top_k, capacity_factor, activation)
    if capacity_factor == 0.5:
        assert all(r["dropped"] > 0 for r in results)  # the drops were exercised, and matched
    for r in results:
        forward, backward = r["forward"], r["backward"]
        if r["slots"] is not None:
            # two exchanges of the [experts, capacity, d] buffer each way: (n-1)/n of it leaves a rank
            buffer = E * r["slots"] * D * 4
            assert forward[("all_to_all", "data")] == {"calls": 2, "bytes": 2 * buffer * (world - 1) / world,
                                                       "payload_bytes": 2 * buffer}  # fmt: skip
            assert backward[("all_to_all", "data")] == forward[("all_to_all", "data")]
        else:  # the slots agreed by a max all-reduce first
            assert forward[("all_reduce", "data")]["calls"] == 1
            assert forward[("all_to_all", "data")]["calls"] == 2
