"""Sequence-parallel attention (ring self-attention, ring attention, all-to-all) against whole-sequence
attention in one process: outputs and the gradients of q, k and v, causal or not, with and without a
key-padding mask, for sequence lengths that divide the split and lengths that need padding; and the
communication each mode's formula says (docs/sequence-parallel.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera import comm
from tessera.parallel.sequence import MODES, SequenceLayout, layout_for, sequence_attention
from tessera.parallel.sequence.ring import ring_attention
from tessera.testing import tolerance, use_layout

B, H, D = 2, 4, 8


def _inputs(length: int, padded_keys: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v, w = (torch.randn(B, H, length, D, generator=g) for _ in range(4))
    keep = None
    if padded_keys:  # right padding: the second sequence has its last 3 tokens padded
        keep = torch.ones(B, length, dtype=torch.bool)
        keep[1, length - 3 :] = False
    return q, k, v, w, keep


def _reference(q, k, v, w, keep, causal):
    """torch's attention over the whole sequence (every row has a key) and its gradients."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    s = q.shape[2]
    mask = torch.ones(s, s, dtype=torch.bool)
    if causal:
        mask = torch.tril(mask)
    if keep is not None:
        mask = mask & keep[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def body_matches(lengths):
    ctx = use_layout(sequence=torch.distributed.get_world_size())
    group = ctx.group("sequence")
    n, rank = group.size, group.rank
    checked = 0
    for length in lengths:
        for causal in (False, True):
            for padded_keys in (False, True):
                q, k, v, w, keep = _inputs(length, padded_keys, seed=length)
                expected = _reference(q, k, v, w, keep, causal)
                for mode in MODES:
                    layout = layout_for(mode, length, n)
                    mine = [layout.split(t, 2, rank).requires_grad_() for t in (q, k, v)]
                    local_keep = None if keep is None else layout.split(keep, 1, rank, pad_value=False)
                    out = sequence_attention(*mine, group, layout, mode, causal, local_keep)
                    (out * layout.split(w, 2, rank)).sum().backward()
                    real = (layout.positions(rank) < length).view(1, 1, -1, 1)  # padded query rows are discarded
                    got = (out.detach() * real, *(t.grad for t in mine))
                    case = f"{mode} (len {length}, causal {causal}, mask {padded_keys})"
                    for name, a, e in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
                        torch.testing.assert_close(
                            a,
                            layout.split(e, 2, rank),
                            **tolerance(depth=2 * 8),  # attention forward and backward, merged over the ranks
                            msg=lambda m, w=f"{case} {name}": f"{w}: {m}",
                        )
                    checked += 1
    return checked


@pytest.mark.parametrize("world", [2, 4])
def test_every_mode_matches_whole_sequence_attention(pools, world):
    lengths = (8 * world, 8 * world - 3)  # divides the pieces; needs padding
    assert pools.run(world, body_matches, lengths) == [len(lengths) * 4 * len(MODES)] * world


def body_ledger():
    ctx = use_layout(sequence=torch.distributed.get_world_size())
    group = ctx.group("sequence")
    n, rank = group.size, group.rank
    length = 16 * n
    q, k, v, w, _ = _inputs(length, False, seed=3)
    sent = {}
    for mode in MODES:
        layout = layout_for(mode, length, n)
        mine = [layout.split(t, 2, rank).requires_grad_() for t in (q, k, v)]
        with comm.ledger() as forward:
            out = sequence_attention(*mine, group, layout, mode, causal=True)
        with comm.ledger() as backward:
            (out * layout.split(w, 2, rank)).sum().backward()
        sent[mode] = {
            "forward": forward.summary(),
            "backward": backward.summary(),
        }
    return sent


@pytest.mark.parametrize("world", [2, 4])
def test_ledger_matches_each_modes_formula(pools, world):
    n = world
    block = B * H * (16 * n // n) * D * 4  # one member's q, k or v: b * h * local * d fp32 bytes
    for sent in pools.run(world, body_ledger):
        ring = sent["ring"]
        # forward: the key and value blocks make n - 1 hops
        assert ring["forward"] == {
            ("recv", "sequence"): _p2p(n - 1, 2 * block),
            ("send", "sequence"): _p2p(n - 1, 2 * block),
        }
        # backward: the blocks again, and the fp32 sums of their gradients, n - 1 hops each
        assert ring["backward"][("send", "sequence")] == _p2p(2 * (n - 1), 2 * block)
        qk = sent["ring_qk"]  # keys (RingQK) then values (RingAV): n - 1 hops each, forward and backward
        assert qk["forward"][("send", "sequence")] == _p2p(2 * (n - 1), block)
        assert qk["backward"][("send", "sequence")] == _p2p(4 * (n - 1), block)
        a2a = sent["all_to_all"]  # four all-to-alls of b * local * h * d forward, four backward
        per_call = (n - 1) * block / n
        assert a2a["forward"] == {
            ("all_to_all", "sequence"): {"calls": 4, "bytes": 4 * per_call, "payload_bytes": 4 * block}
        }
        assert a2a["backward"] == {
            ("all_to_all", "sequence"): {"calls": 4, "bytes": 4 * per_call, "payload_bytes": 4 * block}
        }


def _p2p(calls: int, nbytes: int) -> dict:
    return {"calls": calls, "bytes": calls * nbytes, "payload_bytes": calls * nbytes}


def test_layouts_place_every_token_once():
    for length, size, zigzag in [(16, 2, False), (16, 2, True), (13, 4, True), (5, 4, False), (1, 2, True)]:
        layout = SequenceLayout(length, size, zigzag)
        x = torch.arange(length).float().view(1, length)
        parts = [layout.split(x, 1, r, pad_value=-1) for r in range(size)]
        assert all(p.shape[1] == layout.local for p in parts)
        torch.testing.assert_close(layout.join(parts, 1), x)
        seen = torch.cat([layout.positions(r) for r in range(size)]).sort().values
        assert torch.equal(seen, torch.arange(layout.padded))
    zig = SequenceLayout(16, 2, zigzag=True)
    assert zig.pieces(0) == [(0, 4), (12, 4)] and zig.pieces(1) == [(4, 4), (8, 4)]


def body_bad_heads():
    ctx = use_layout(sequence=2)
    layout = SequenceLayout(8, 2)
    q = torch.randn(1, 3, 4, 8)
    with pytest.raises(ValueError, match="3 heads do not divide by 2"):
        sequence_attention(q, q, q, ctx.group("sequence"), layout, "all_to_all")
    with pytest.raises(ValueError, match="mode 'ulysses' is not one of"):
        sequence_attention(q, q, q, ctx.group("sequence"), layout, "ulysses")
    return True


def test_bad_head_count_and_mode_fail_clearly(pools):
    assert pools.run(2, body_bad_heads) == [True, True]


def _ring_saved_bytes(group, n: int, rank: int) -> int:
    """Bytes autograd keeps for ring attention's backward on this rank (saved-tensor hooks)."""
    length = 32
    q, k, v, _, _ = _inputs(length, False, seed=5)
    layout = layout_for("ring", length, n)
    mine = [layout.split(t, 2, rank).requires_grad_() for t in (q, k, v)]
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ring_attention(*mine, group, layout, causal=True)
    return saved[0]


def body_saved():
    ctx = use_layout(sequence=torch.distributed.get_world_size())
    group = ctx.group("sequence")
    return _ring_saved_bytes(group, group.size, group.rank)


def test_ring_attention_saved_activations_fall_as_one_over_n(pools):
    one = comm.single_rank_group("sequence")
    whole = _ring_saved_bytes(one, 1, 0)  # N = 1: q, k, v, the output and its log-sum-exp of 32 tokens
    assert whole == 4 * B * H * 32 * D * 4 + B * H * 32 * 4
    for world in (2, 4):
        assert pools.run(world, body_saved) == [whole // world] * world


def body_module():
    """tessera.nn.Attention on this rank's tokens equals whole-sequence attention's rows."""
    from tessera import nn as tnn

    ctx = use_layout(sequence=2, config={"parallel": {"sequence": {"size": 2, "mode": "all_to_all"}}})
    q, k, v, _, _ = _inputs(16, False, seed=9)
    layout = layout_for("all_to_all", 16, 2)
    mine = [layout.split(t, 2, ctx.local_rank("sequence")) for t in (q, k, v)]
    out = tnn.Attention(causal=True)(*mine)
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, layout.split(whole, 2, ctx.local_rank("sequence")), **tolerance(depth=8))
    assert torch.equal(tnn.positions(8), layout.positions(ctx.local_rank("sequence")))
    return True


def test_the_attention_module_follows_the_configured_mode(pools):
    assert pools.run(2, body_module) == [True, True]
