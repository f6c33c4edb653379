"""Collectives and their autograd wrappers on real gloo ranks, checked against local math."""

from __future__ import annotations

import torch

from tessera import comm, get_context
from tessera.testing import use_layout


def _rank_tensor(rank: int, shape=(4, 6)) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(shape, generator=g)


def body_collectives():
    ctx = use_layout()  # 4 ranks, all data
    rank, world = ctx.rank, ctx.world_size
    everyone = [_rank_tensor(r) for r in range(world)]
    x = everyone[rank]
    full_sum = sum(everyone)
    torch.testing.assert_close(comm.all_reduce(x.clone(), "data"), full_sum)
    torch.testing.assert_close(comm.all_reduce(x.clone(), "data", op="avg"), full_sum / world)
    torch.testing.assert_close(comm.all_reduce(x.clone(), "data", op="max"), torch.stack(everyone).amax(0))
    # all-gather along dims 0 and 1
    torch.testing.assert_close(comm.all_gather(x, "data", dim=0), torch.cat(everyone, 0))
    torch.testing.assert_close(comm.all_gather(x, "data", dim=1), torch.cat(everyone, 1))
    # reduce-scatter: this rank keeps its quarter of the sum
    big = [_rank_tensor(r, (8, 3)) for r in range(world)]
    torch.testing.assert_close(comm.reduce_scatter(big[rank], "data", dim=0), sum(big).chunk(world, 0)[rank])
    wide = [_rank_tensor(r, (3, 8)) for r in range(world)]
    torch.testing.assert_close(comm.reduce_scatter(wide[rank], "data", dim=1), sum(wide).chunk(world, 1)[rank])
    # broadcast and reduce with a non-zero root
    torch.testing.assert_close(comm.broadcast(x.clone(), "data", src=2), everyone[2])
    pending = comm.broadcast_async(x.clone(), "data", src=3)  # returns at once; wait() delivers
    torch.testing.assert_close(pending.wait(), everyone[3])
    reduced = comm.reduce(x.clone(), "data", dst=1)
    if rank == 1:
        torch.testing.assert_close(reduced, full_sum)
    # all-to-all: part i of every rank goes to rank i
    a2a = [_rank_tensor(r, (8, 2)) for r in range(world)]
    expected = torch.cat([a2a[src].chunk(world, 0)[rank] for src in range(world)], dim=1)
    torch.testing.assert_close(comm.all_to_all(a2a[rank], "data", scatter_dim=0, gather_dim=1), expected)
    # a ring of sends and receives in one batch
    got = torch.empty(4, 6)
    comm.batch_p2p(
        [comm.P2POp("send", x, "data", (rank + 1) % world), comm.P2POp("recv", got, "data", (rank - 1) % world)]
    )
    torch.testing.assert_close(got, everyone[(rank - 1) % world])
    comm.barrier("data")
    assert comm.broadcast_object({"from": rank}, "data", src=3) == {"from": 3}
    # non-contiguous input is handled
    torch.testing.assert_close(comm.all_reduce(x.t(), "data"), full_sum.t())
    return True


def test_collectives_match_local_math(pools):
    assert pools.run(4, body_collectives) == [True] * 4


def body_flat(layout):
    """all_gather_into and reduce_scatter_into (gloo: direct exchanges between members) on the
    data axis, several in flight at once and waited out of order, against local math over the
    members' values (seeded by global rank, so a message from the wrong peer shows)."""
    ctx = use_layout(**layout)
    group = ctx.group("data")
    p, me, n = group.size, group.rank, 5
    members = group.ranks

    def values(global_rank: int, salt: int, numel: int, dtype=torch.float32) -> torch.Tensor:
        return _rank_tensor(1000 * salt + global_rank, (numel,)).to(dtype)

    results = []
    for dtype in (torch.float32, torch.bfloat16):
        fulls = [torch.empty(p * n, dtype=dtype) for _ in range(2)]
        outs = [torch.empty(n, dtype=dtype) for _ in range(3)]
        gathers = [
            comm.all_gather_into(fulls[k], values(ctx.rank, k, n, dtype), "data", async_op=True) for k in range(2)
        ]
        inputs = [values(ctx.rank, 10 + k, p * n, dtype) for k in range(3)]
        ops, divides = ("sum", "avg", "avg"), (1, 1, 3)  # the last: an expert chunk's average
        reductions = [
            comm.reduce_scatter_into(outs[k], inputs[k], "data", op=ops[k], async_op=True, divide_by=divides[k])
            for k in range(3)
        ]
        for pending in reversed(reductions + gathers):
            pending.wait()
        for k in range(2):
            torch.testing.assert_close(fulls[k], torch.cat([values(r, k, n, dtype) for r in members]))
        for k in range(3):
            total = sum(values(r, 10 + k, p * n, dtype)[me * n : (me + 1) * n] for r in members)
            expected = (total / p if ops[k] == "avg" else total) / divides[k]
            torch.testing.assert_close(outs[k], expected)
        alone = torch.empty(p * n, dtype=dtype)  # a group of one member: a copy, still divided
        comm.reduce_scatter_into(alone, inputs[0], "pipeline", op="avg", divide_by=2)
        torch.testing.assert_close(alone, inputs[0] / 2)
        # synchronous, and a shard that is a view into the full buffer
        full = torch.zeros(p * n, dtype=dtype)
        full[me * n : (me + 1) * n] = values(ctx.rank, 20, n, dtype)
        comm.all_gather_into(full, full[me * n : (me + 1) * n], "data")
        torch.testing.assert_close(full, torch.cat([values(r, 20, n, dtype) for r in members]))
        results.append(True)
    return all(results)


def test_flat_collectives_match_local_math(pools):
    assert pools.run(4, body_flat, {}) == [True] * 4
    assert pools.run(8, body_flat, dict(tensor=2)) == [True] * 8  # data groups [0,2,4,6] and [1,3,5,7]


def body_autograd():
    ctx = use_layout()
    rank, world = ctx.rank, ctx.world_size
    group = ctx.group("data")
    full = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    upstream = [torch.randn(8, 8, generator=torch.Generator().manual_seed(1 + r)) for r in range(world)]

    # split forward / gather backward: the gradient of a split is the gathered upstream part
    x = full.clone().requires_grad_()
    part = comm.split_forward_gather_backward(x, group, dim=1)
    torch.testing.assert_close(part, full.chunk(world, 1)[rank])
    part.backward(upstream[rank].chunk(world, 1)[rank])
    torch.testing.assert_close(x.grad, torch.cat([upstream[r].chunk(world, 1)[r] for r in range(world)], 1))

    # copy forward / all-reduce backward: the gradient sums every rank's upstream
    x = full.clone().requires_grad_()
    comm.copy_forward_all_reduce_backward(x, group).backward(upstream[rank])
    torch.testing.assert_close(x.grad, sum(upstream))

    # all-reduce forward / copy backward
    x = (full * (rank + 1)).requires_grad_()
    y = comm.all_reduce_forward_copy_backward(x, group)
    torch.testing.assert_close(y, full * sum(range(1, world + 1)))
    y.backward(upstream[rank])
    torch.testing.assert_close(x.grad, upstream[rank])

    # all-gather forward / reduce-scatter backward (sequence parallel)
    x = full.chunk(world, 0)[rank].clone().requires_grad_()
    y = comm.all_gather_forward_reduce_scatter_backward(x, group, dim=0)
    torch.testing.assert_close(y, full)
    y.backward(upstream[rank])
    torch.testing.assert_close(x.grad, sum(upstream).chunk(world, 0)[rank])

    # all-to-all forward and its inverse backward: a round trip is the identity
    x = full.clone().requires_grad_()
    y = comm.all_to_all_forward_all_to_all_backward(x, group, scatter_dim=0, gather_dim=1)
    back = comm.all_to_all_forward_all_to_all_backward(y, group, scatter_dim=1, gather_dim=0)
    torch.testing.assert_close(back, full)
    back.backward(upstream[rank])
    torch.testing.assert_close(x.grad, upstream[rank])

    # broadcast forward / reduce backward: only the source gets the summed gradient
    x = (full + rank).requires_grad_()
    y = comm.broadcast_forward_reduce_backward(x, group, src=1)
    torch.testing.assert_close(y, full + 1)
    y.backward(upstream[rank])
    torch.testing.assert_close(x.grad, sum(upstream) if rank == 1 else torch.zeros(8, 8))
    return True


def test_autograd_wrappers_give_reference_gradients(pools):
    assert pools.run(4, body_autograd) == [True] * 4


def body_ledger():
    ctx = use_layout()
    f32 = 4
    with comm.ledger() as led:
        comm.all_reduce(torch.zeros(1000), "data")  # 4000 B
        comm.all_reduce(torch.zeros(10), "data")  # 40 B
        comm.all_gather(torch.zeros(2, 4), "data")  # output 32 floats = 128 B
        comm.reduce_scatter(torch.zeros(8, 4), "data")  # input 128 B
        comm.broadcast(torch.zeros(10), "data")  # 40 B
        comm.broadcast_async(torch.zeros(10), "data").wait()  # 40 B
        comm.all_to_all(torch.zeros(16), "data", 0, 0)  # 64 B
        peer = (ctx.rank + 1) % 4, (ctx.rank - 1) % 4
        comm.batch_p2p(
            [comm.P2POp("send", torch.zeros(4), "data", peer[0]), comm.P2POp("recv", torch.zeros(4), "data", peer[1])]
        )
        comm.barrier("data")
        comm.all_reduce(torch.zeros(10), ctx.group("tensor"))  # one rank: a no-op, not counted
    p = 4
    expected = {
        ("all_reduce", 2 * (p - 1) * (1000 + 10) * f32 / p),
        ("all_gather", (p - 1) * 32 * f32 / p),
        ("reduce_scatter", (p - 1) * 32 * f32 / p),
        ("broadcast", (p - 1) * 2 * 10 * f32 / p),
        ("all_to_all", (p - 1) * 16 * f32 / p),
        ("send", 16),
        ("recv", 16),
        ("barrier", 0),
    }
    got = {(op, led.bytes(op, "data")) for op, _ in expected}
    assert got == expected, got
    assert led.calls("all_reduce", "data") == 2 and led.calls(axis="tensor") == 0
    assert led.bytes() == 6060 + 96 + 96 + 60 + 48 + 32
    return True


def test_ledger_counts_exact_bytes(pools):
    assert pools.run(4, body_ledger) == [True] * 4


def body_axes(layout):
    ctx = use_layout(**layout)
    out = {}
    for axis in (*ctx.axes, "world"):
        t = torch.tensor([float(ctx.rank)])
        comm.all_reduce(t, axis)
        out[axis] = (float(t), float(sum(ctx.ranks(axis))), ctx.size(axis))
    return out


LAYOUTS_8 = [
    dict(tensor=4, mode="2d"),
    dict(tensor=8, mode="2.5d", depth=2),
    dict(tensor=8, mode="3d"),
    dict(tensor=2, pipeline=2),
    dict(tensor=2, sequence=2),
    dict(pipeline=2, tensor=4, mode="2.5d"),
]


def test_eight_ranks_build_real_groups_and_reduce_along_each_axis(pools):
    for layout in LAYOUTS_8:
        results = pools.run(8, body_axes, layout)
        for rank, per_axis in enumerate(results):
            for axis, (reduced, expected, _size) in per_axis.items():
                assert reduced == expected, (layout, rank, axis)
            assert per_axis["world"][2] == 8
        sizes = {axis: size for axis, (_, _, size) in results[0].items()}
        assert sizes["data"] * sizes["pipeline"] * sizes["sequence"] * sizes["tensor"] == 8, layout


def body_context_facts():
    ctx = use_layout(tensor=2, pipeline=2)
    assert get_context() is ctx
    return ctx.rank, ctx.ranks("tensor"), ctx.ranks("pipeline"), ctx.ranks("data"), ctx.local_rank("pipeline")


def test_context_reports_ranks_by_axis(pools):
    results = pools.run(8, body_context_facts)
    assert results[5] == (5, [4, 5], [5, 7], [1, 5], 0)
    assert results[3] == (3, [2, 3], [1, 3], [3, 7], 1)


def body_rng():
    ctx = use_layout(tensor=2)  # 4 ranks: data=2 x tensor=2
    before = torch.get_rng_state()
    with ctx.rng.fork("tensor"):
        a = torch.rand(3)
    with ctx.rng.fork("tensor"):
        b = torch.rand(3)  # the stream continues, it does not restart
    assert torch.equal(torch.get_rng_state(), before), "the default stream must be restored"
    with ctx.rng.fork("data", "tensor"):
        c = torch.rand(3)
    return ctx.local_rank("data"), ctx.local_rank("tensor"), a, b, c


def test_rng_streams_differ_exactly_along_their_axes(pools):
    results = pools.run(4, body_rng)
    by_pos = {(d, t): (a, b, c) for d, t, a, b, c in results}
    # same tensor index, different data index: the tensor stream agrees
    assert torch.equal(by_pos[(0, 0)][0], by_pos[(1, 0)][0])
    assert torch.equal(by_pos[(0, 1)][1], by_pos[(1, 1)][1])
    # different tensor index: it differs
    assert not torch.equal(by_pos[(0, 0)][0], by_pos[(0, 1)][0])
    assert not torch.equal(by_pos[(0, 0)][0], by_pos[(0, 0)][1])
    # a stream distinct along both axes differs everywhere
    cs = [by_pos[k][2] for k in by_pos]
    assert all(not torch.equal(cs[i], cs[j]) for i in range(4) for j in range(i + 1, 4))
