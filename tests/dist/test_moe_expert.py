"""tessera.nn.MoE with its experts spread over 2 and 4 ranks (expert parallelism over the data
ranks, tokens exchanged by all-to-all) against the single-process layer run on each rank's batch:
outputs, auxiliary losses, dropped assignments, and gradients (the input's and the router's per
rank; each local expert's summed over every rank's tokens), for top-1 and top-2, with and
without capacity drops; and the ledger's all-to-all bytes against the formula."""

from __future__ import annotations

import pytest
import torch

D, FF, E, T = 8, 16, 8, 32
# one MoE layer (router, an expert's MLP, the weighted sum) forward, and with its backward (the
# expert gradients also summed over up to 4 ranks' tokens). The routing (tokens per expert, drops)
# is compared exactly: both layers route with the same kernels on the same tokens, bit for bit
FORWARD, BACKWARD = dict(blocks=1), dict(depth=2 * 8 + 4)


def ep_body(top_k: int, capacity_factor: float | None, activation: str, expert: int, tensor: int) -> dict:
    from tessera import comm
    from tessera.context import set_context
    from tessera.nn.moe import MoE
    from tessera.testing import tolerance, use_layout

    world = torch.distributed.get_world_size()
    ctx = use_layout(data=world // tensor, tensor=tensor, expert=expert)
    d, n = ctx.local_rank("data"), ctx.size("data")
    e, t = ctx.local_rank("expert"), ctx.local_rank("tensor")
    torch.manual_seed(0)
    set_context(None)  # the single-process layer
    full = MoE(D, FF, E, top_k=top_k, capacity_factor=capacity_factor, activation=activation)
    set_context(ctx)
    torch.manual_seed(1)
    xs, probes = torch.randn(n, T, D), torch.randn(n, T, D)
    torch.manual_seed(0)  # the same draws: the layer keeps its blocks of the single-process weights
    ep = MoE(D, FF, E, top_k=top_k, capacity_factor=capacity_factor, activation=activation)
    experts = slice(e * E // expert, (e + 1) * E // expert)
    width = slice(t * FF // tensor, (t + 1) * FF // tensor)
    blocks = {"w_in": (experts, slice(None), width), "w_gate": (experts, slice(None), width),
              "w_out": (experts, width, slice(None))}  # fmt: skip
    names = [name for name, _ in full.experts.named_parameters()]
    torch.testing.assert_close(ep.router.weight, full.router.weight, rtol=0, atol=0)
    for name in names:
        torch.testing.assert_close(getattr(ep.experts, name), getattr(full.experts, name)[blocks[name]], rtol=0, atol=0)
    x = xs[d].clone().requires_grad_(True)
    with comm.ledger() as forward:
        y = ep(x)
    with comm.ledger() as backward:
        (y * probes[d]).sum().backward()  # the auxiliary losses join through y

    # the single-process layer on the batch of every data rank of this rank's expert group
    group = [d - e + i for i in range(expert)]
    expert_grads = {name: torch.zeros_like(getattr(full.experts, name)) for name in names}
    for s in group:
        xr = xs[s].clone().requires_grad_(True)
        yr = full(xr)
        params = [full.router.weight, *(getattr(full.experts, name) for name in names)]
        grads = torch.autograd.grad((yr * probes[s]).sum(), [xr, *params])
        for name, g in zip(names, grads[2:]):
            expert_grads[name] += g
        if s == d:
            mine = (yr.detach(), grads[0], grads[1], full.stats, full.aux_loss.detach())
    y_ref, x_grad, router_grad, stats, aux = mine
    torch.testing.assert_close(y, y_ref, **tolerance(**FORWARD))
    torch.testing.assert_close(ep.aux_loss.detach(), aux, **tolerance(**FORWARD))
    assert ep.stats.dropped == stats.dropped and ep.stats.capacity == stats.capacity
    assert ep.stats.tokens_per_expert.tolist() == stats.tokens_per_expert.tolist()  # the same ones kept
    torch.testing.assert_close(x.grad, x_grad, **tolerance(**BACKWARD))
    torch.testing.assert_close(ep.router.weight.grad, router_grad, **tolerance(**BACKWARD))
    for name in names:
        want = expert_grads[name][blocks[name]]
        torch.testing.assert_close(getattr(ep.experts, name).grad, want, **tolerance(**BACKWARD))
    slots = ep.stats.capacity
    return {"forward": forward.summary(), "backward": backward.summary(), "slots": slots, "dropped": stats.dropped}


CASES = [(1, None, "gelu"), (2, None, "swiglu"), (1, 0.5, "swiglu"), (2, 1.0, "gelu")]


# (ranks, expert, tensor): experts over 2 and 4 ranks, over half the data ranks (ep2 x dp2), and
# with each expert's width split over 1D tensor ranks (ep2 x tp2)
LAYOUTS = [(2, 2, 1), (4, 4, 1), (4, 2, 1), (4, 2, 2)]


@pytest.mark.parametrize(("world", "expert", "tensor"), LAYOUTS, ids=lambda v: str(v))
@pytest.mark.parametrize(("top_k", "capacity_factor", "activation"), CASES)
def test_expert_parallel_moe_matches_the_single_process_layer(
    pools, world, expert, tensor, top_k, capacity_factor, activation
):
    results = pools.run(world, ep_body, top_k, capacity_factor, activation, expert, tensor)
    if capacity_factor == 0.5:
        assert all(r["dropped"] > 0 for r in results)  # the drops were exercised, and matched
    for r in results:
        forward, backward = r["forward"], r["backward"]
        if r["slots"] is not None:
            # two exchanges of the [experts, capacity, d] buffer each way: (n-1)/n of it leaves a rank
            buffer = E * r["slots"] * D * 4
            assert forward[("all_to_all", "expert")] == {"calls": 2, "bytes": 2 * buffer * (expert - 1) / expert,
                                                         "payload_bytes": 2 * buffer}  # fmt: skip
            assert backward[("all_to_all", "expert")] == forward[("all_to_all", "expert")]
        else:  # the slots agreed by a max all-reduce first
            assert forward[("all_reduce", "expert")]["calls"] == 1
            assert forward[("all_to_all", "expert")]["calls"] == 2
        if tensor > 1:  # the experts' outputs summed over the tensor ranks; their inputs' gradients too
            assert forward[("all_reduce", "tensor")]["calls"] == 1
            assert backward[("all_reduce", "tensor")]["calls"] == 1
