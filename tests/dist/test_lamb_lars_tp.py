"""Sharded LAMB and LARS take the single-process steps: their trust ratios use the norms of whole
parameters, whether the optimizer holds ZeRO-like pieces or tensor-parallel blocks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tessera
from tessera import comm
from tessera.checkpoint import full_state_dict
from tessera.comm.group import single_rank_group
from tessera.context.placement import Placement, ShardSpec, ZeroSlot, placement_of, set_placement
from tessera.models import NextTokenLoss, gpt
from tessera.optim import LAMB, LARS, whole_sq_norms
from tessera.testing import tolerance, use_layout, within

OPTIMIZERS = {
    "lamb": (LAMB, dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01)),
    "lars": (LARS, dict(lr=0.5, momentum=0.9, weight_decay=1e-3, trust_coefficient=0.02)),
}

# ---- (a) ZeRO-like pieces made by hand on 4 data ranks --------------------------------------------

PIECE_STEPS = 10


def small_model() -> nn.Module:
    torch.manual_seed(0)
    # a 2x3 weight and a 2-element bias are smaller than 4 ranks x their pieces: some ranks hold none
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 3), nn.Tanh(), nn.Linear(3, 2))


def piece_batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)) for _ in range(PIECE_STEPS)]


def full_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def single_process_pieces_run(name: str) -> list[torch.Tensor]:
    cls, kw = OPTIMIZERS[name]
    model = small_model()
    opt = cls(model.parameters(), **kw, ctx=None)
    for x, y in piece_batches():
        full_gradients(model, x, y)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def piece_range(numel: int, parts: int, index: int) -> tuple[int, int]:
    block = -(-numel // parts)
    return min(index * block, numel), min((index + 1) * block, numel)


def body_pieces(name: str, local_norms: bool) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[int]]:
    """Every rank holds its quarter of each flattened parameter and steps it with LAMB/LARS."""
    ctx = use_layout(data=4)
    group, rank, parts = ctx.group("data"), ctx.local_rank("data"), ctx.size("data")
    cls, kw = OPTIMIZERS[name]
    model = small_model()
    full = list(model.parameters())
    pieces: list[nn.Parameter] = []
    ranges: list[tuple[int, int, int]] = []  # (slot, start, end) of each piece this rank holds
    for slot, p in enumerate(full):
        start, end = piece_range(p.numel(), parts, rank)
        if end == start:
            continue  # this rank holds nothing of this parameter
        piece = nn.Parameter(p.detach().flatten()[start:end].clone())
        set_placement(piece, Placement(zero=ZeroSlot(slot, len(full), tuple(p.shape))))
        pieces.append(piece)
        ranges.append((slot, start, end))
    # local_norms: a context with no ranks to sum over, to show that the test tells the difference
    stub = SimpleNamespace(
        size=lambda axis: 1, group=lambda axis: single_rank_group(axis), replicas=single_rank_group("data")
    )
    opt = cls(pieces, **kw, ctx=stub if local_norms else ctx)  # type: ignore[arg-type]
    for x, y in piece_batches():
        grads = full_gradients(model, x, y)  # every rank computes the same full gradients
        for piece, (slot, start, end) in zip(pieces, ranges):
            piece.grad = grads[slot].flatten()[start:end].clone()
        opt.step()
        with torch.no_grad():  # gather the pieces back into the full parameters for the next step
            for slot, p in enumerate(full):
                start, end = piece_range(p.numel(), parts, rank)
                block = -(-p.numel() // parts)
                mine = torch.zeros(block)
                held = [pc for pc, (s, _, _) in zip(pieces, ranges) if s == slot]
                if held:
                    mine[: end - start] = held[0].detach()
                p.copy_(comm.all_gather(mine, group)[: p.numel()].view(p.shape))
    held_slots = [slot for slot, _, _ in ranges]
    return [p.detach().clone() for p in full], held_slots


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_zero_like_pieces_step_like_one_process(pools, name):
    expected = single_process_pieces_run(name)
    results = pools.run(4, body_pieces, name, False)
    held = [slots for _, slots in results]
    assert any(len(s) < len(expected) for s in held), "some rank holds nothing of some parameter"
    assert sorted({s for slots in held for s in slots}) == list(range(len(expected)))
    for params, _ in results:
        for k, (got, want) in enumerate(zip(params, expected)):
            # small_model(): about one block's depth; the norms summed in another order
            torch.testing.assert_close(got, want, **tolerance(steps=PIECE_STEPS), msg=f"parameter {k}")
    # Norms of the pieces alone (no sum over the data axis) give a different trajectory.
    local = pools.run(4, body_pieces, name, True)[0][0]
    assert max(float((a - b).abs().max()) for a, b in zip(local, expected)) > 1e-4


def norm_tensors() -> list[tuple[torch.Tensor, bool]]:
    """(full tensor, split along the tensor axis by rows) for the whole_sq_norms check."""
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(6, 4, generator=g), True), (torch.randn(5, generator=g), False),
            (torch.randn(4, 2, generator=g), True), (torch.randn(1, generator=g), False)]  # fmt: skip


def body_whole_sq_norms() -> dict[int, list[float]]:
    """ZeRO pieces of tensor-parallel blocks (and of replicated tensors) on data 2 x tensor 2."""
    ctx = use_layout(data=2, tensor=2)
    tensors, params, slots = [], [], []
    entries = norm_tensors()
    for slot, (full, split) in enumerate(entries):
        block = full.chunk(2, dim=0)[ctx.local_rank("tensor")] if split else full
        start, end = piece_range(block.numel(), 2, ctx.local_rank("data"))
        if end == start:
            continue  # the second data rank holds nothing of the one-element tensor
        piece = block.flatten()[start:end].clone()
        # a 1-D piece of a block split along the tensor axis
        shard = ShardSpec(tuple(full.shape), (("tensor",),) + ((),) * (full.dim() - 1)) if split else None
        set_placement(piece, Placement(shard=shard, zero=ZeroSlot(slot, len(entries), tuple(block.shape))))
        tensors.append(piece)
        params.append(piece)
        slots.append(slot)
    # two quantities per piece in one call: the piece and three times the piece
    sq = whole_sq_norms(tensors + [3 * t for t in tensors], params + params, ctx)
    n = len(slots)
    return {slot: [float(sq[i]), float(sq[n + i])] for i, slot in enumerate(slots)}


def test_whole_sq_norms_sum_zero_pieces_then_tensor_blocks(pools):
    expected = {slot: float(full.double().pow(2).sum()) for slot, (full, _) in enumerate(norm_tensors())}
    results = pools.run(4, body_whole_sq_norms)
    # ranks: tensor innermost, so ranks 2 and 3 are the second data rank
    assert [sorted(r) for r in results] == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2], [0, 1, 2]]
    for got in results:
        for slot, (weights, tripled) in got.items():
            # fp32 sums of at most 24 squares, then over the ranks, against the exact one
            assert within(weights, expected[slot], depth=24 + 2), slot
            assert within(tripled, 9 * expected[slot], depth=24 + 3), slot


# ---- (b) tensor parallelism tp2 x dp2 through the engine -------------------------------------------

TP_STEPS = 12
GLOBAL_BATCH = 8
SEQ = 16


def tp_config(data: int | None, tensor: int) -> dict:
    return {"parallel": {"data": data, "tensor": {"size": tensor, "mode": "1d"}}}


def tp_dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 64, (GLOBAL_BATCH * TP_STEPS, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def train_gpt(name: str, data: int | None, tensor: int):
    """LAMB/LARS on the tiny GPT under data x 1D tensor parallelism (or in one process)."""
    ctx = use_layout(data=data, tensor=tensor, mode="1d", config=tp_config(data, tensor))
    torch.manual_seed(0)
    model = gpt("tiny", vocab_size=64, max_seq_len=SEQ, d_model=32, n_layers=2, n_heads=4)
    cls, kw = OPTIMIZERS[name]
    optimizer = cls(model.parameters(), **kw)  # the current context sums the norms of TP blocks
    loader = DataLoader(tp_dataset(), batch_size=GLOBAL_BATCH // ctx.size("data"))
    engine, loader, _, _ = tessera.initialize(model, optimizer, NextTokenLoss(), loader)
    it = iter(loader)
    losses = [engine.train_batch(it) for _ in range(TP_STEPS)]
    sharded = sum(1 for p in model.parameters() if placement_of(p).split_axes)
    return losses, full_state_dict(model), sharded


@pytest.fixture(scope="module")
def gpt_references():
    return {name: train_gpt(name, None, 1) for name in OPTIMIZERS}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_tp2_dp2_trains_like_one_process(pools, gpt_references, name):
    ref_losses, ref_state, _ = gpt_references[name]
    results = pools.run(4, train_gpt, name, 2, 2, timeout=600)
    for losses, state, sharded in results:
        assert sharded > 0, "the tensor-parallel layers hold blocks"
        tol = tolerance(blocks=2, steps=TP_STEPS)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **tol)
        assert state.keys() == ref_state.keys()
        for key in ref_state:
            torch.testing.assert_close(state[key], ref_state[key], **tol, msg=key)
    assert ref_losses[-1] < ref_losses[0], "the reference learns"
