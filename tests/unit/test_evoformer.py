"""The Evoformer block against the AlphaFold 2 description, element by element: each module
computed by an explicit loop over residues (or sequences) in plain PyTorch; the trunk's
distogram symmetric; the synthetic proteins' contacts co-varying; a few steps of training lower
the distogram loss."""

from __future__ import annotations

import math

import pytest
import torch

from tessera.models.evoformer import (
    DistogramLoss,
    EvoformerBlock,
    EvoformerConfig,
    EvoformerTrunk,
    MSARowAttentionWithPairBias,
    OuterProductMean,
    SyntheticProteins,
    TriangleAttention,
    TriangleMultiplication,
    TrunkConfig,
)

CONFIG = EvoformerConfig(c_m=8, c_z=6, msa_heads=2, msa_head_dim=4, pair_heads=2, pair_head_dim=3, outer_dim=3,
                         triangle_dim=5, transition=2)  # fmt: skip


def randomised(module: torch.nn.Module) -> torch.nn.Module:
    """Every parameter drawn at random (the zero/one initialisations would hide terms)."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.5)
    return module.double()


def inputs(b=2, s=3, r=5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(b, s, r, CONFIG.c_m, generator=g, dtype=torch.float64),
            torch.randn(b, r, r, CONFIG.c_z, generator=g, dtype=torch.float64))  # fmt: skip


def heads(x: torch.Tensor, linear: torch.nn.Linear, h: int) -> torch.Tensor:
    return linear(x).view(*x.shape[:-1], h, -1)


def test_row_attention_with_pair_bias_is_the_papers_sum():
    mod = randomised(MSARowAttentionWithPairBias(CONFIG))
    m, z = inputs()
    x, zn = mod.norm(m), mod.pair_norm(z)
    q, k, v = (t.view(*x.shape[:-1], 2, 4) for t in mod.qkv(x).chunk(3, dim=-1))
    g = torch.sigmoid(heads(x, mod.gate, 2))
    bias = mod.pair_bias(zn)  # [B, R, R, H]
    want = torch.zeros_like(q)
    for b in range(2):
        for s in range(3):
            for i in range(5):
                for h in range(2):
                    logits = torch.stack(
                        [q[b, s, i, h] @ k[b, s, j, h] / math.sqrt(4) + bias[b, i, j, h] for j in range(5)]
                    )
                    a = logits.softmax(0)
                    want[b, s, i, h] = g[b, s, i, h] * sum(a[j] * v[b, s, j, h] for j in range(5))
    torch.testing.assert_close(mod(m, z), mod.out(want.flatten(-2)))


@pytest.mark.parametrize("starting", [True, False], ids=["starting", "ending"])
def test_triangle_attention_is_the_papers_sum(starting):
    mod = randomised(TriangleAttention(CONFIG, starting=starting))
    _, z = inputs()
    x = mod.norm(z)
    q, k, v = (t.view(*x.shape[:-1], 2, 3) for t in mod.qkv(x).chunk(3, dim=-1))
    g = torch.sigmoid(heads(x, mod.gate, 2))
    bias = mod.bias(x)
    r = 5
    want = torch.zeros_like(q)
    for b in range(2):
        for i in range(r):
            for j in range(r):
                for h in range(2):
                    if starting:  # z_ij attends over z_ik, biased by z_jk
                        logits = torch.stack(
                            [q[b, i, j, h] @ k[b, i, kk, h] / math.sqrt(3) + bias[b, j, kk, h] for kk in range(r)]
                        )
                        values = [v[b, i, kk, h] for kk in range(r)]
                    else:  # z_ij attends over z_kj, biased by z_ki
                        logits = torch.stack(
                            [q[b, i, j, h] @ k[b, kk, j, h] / math.sqrt(3) + bias[b, kk, i, h] for kk in range(r)]
                        )
                        values = [v[b, kk, j, h] for kk in range(r)]
                    a = logits.softmax(0)
                    want[b, i, j, h] = g[b, i, j, h] * sum(a[n] * values[n] for n in range(r))
    torch.testing.assert_close(mod(z), mod.out(want.flatten(-2)))


@pytest.mark.parametrize("outgoing", [True, False], ids=["outgoing", "incoming"])
def test_triangle_multiplication_is_the_papers_sum(outgoing):
    mod = randomised(TriangleMultiplication(CONFIG, outgoing=outgoing))
    _, z = inputs()
    x = mod.norm(z)
    a = torch.sigmoid(mod.a_gate(x)) * mod.a(x)
    b_ = torch.sigmoid(mod.b_gate(x)) * mod.b(x)
    t = torch.zeros(2, 5, 5, CONFIG.triangle_dim, dtype=torch.float64)
    for i in range(5):
        for j in range(5):
            t[:, i, j] = sum((a[:, i, k] * b_[:, j, k]) if outgoing else (a[:, k, i] * b_[:, k, j]) for k in range(5))
    torch.testing.assert_close(mod(z), torch.sigmoid(mod.gate(x)) * mod.out(mod.out_norm(t)))


def test_outer_product_mean_is_the_papers_mean():
    mod = randomised(OuterProductMean(CONFIG))
    m, _ = inputs()
    x = mod.norm(m)
    a, b = mod.a(x), mod.b(x)
    want = torch.zeros(2, 5, 5, CONFIG.outer_dim**2, dtype=torch.float64)
    for i in range(5):
        for j in range(5):
            want[:, i, j] = sum(torch.einsum("bc,bd->bcd", a[:, s, i], b[:, s, j]).flatten(1) for s in range(3)) / 3
    torch.testing.assert_close(mod(m), mod.out(want))


def test_the_block_keeps_shapes_and_every_parameter_gets_a_gradient():
    block = randomised(EvoformerBlock(CONFIG))
    m, z = inputs()
    m2, z2 = block(m.requires_grad_(), z.requires_grad_())
    assert m2.shape == m.shape and z2.shape == z.shape
    (m2.square().mean() + z2.square().mean()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in block.parameters())


def test_the_distogram_is_symmetric_and_the_loss_starts_near_log_bins():
    config = TrunkConfig(blocks=1, block=CONFIG, bins=8)
    torch.manual_seed(0)
    trunk = EvoformerTrunk(config)
    msa, bins = SyntheticProteins(2, residues=6, sequences=4, config=config)[0]
    with torch.no_grad():
        logits = trunk(msa[None])
    torch.testing.assert_close(logits, logits.transpose(1, 2))
    assert abs(float(DistogramLoss()(logits, bins[None])) - math.log(8)) < 1.0


def test_synthetic_contacts_co_vary_and_items_depend_on_their_index_alone():
    config = TrunkConfig(bins=8)
    data = SyntheticProteins(4, residues=12, sequences=16, config=config, seed=3)
    msa, bins = data[2]
    again, _ = SyntheticProteins(4, residues=12, sequences=16, config=config, seed=3)[2]
    assert torch.equal(msa, again) and msa.shape == (16, 12) and bins.shape == (12, 12)
    assert torch.equal(bins, bins.T) and int(bins.diagonal().max()) == 0
    # neighbours along the chain are one unit apart: the bin of distance 1
    assert bool((bins.diagonal(1) == torch.bucketize(torch.tensor(1.0), config.bin_edges())).all())
    with pytest.raises(IndexError):
        data[4]


def test_a_few_steps_lower_the_distogram_loss():
    config = TrunkConfig(blocks=1, block=CONFIG, bins=8)
    torch.manual_seed(0)
    trunk = EvoformerTrunk(config)
    data = SyntheticProteins(8, residues=8, sequences=6, config=config)
    msa, bins = (torch.stack(t) for t in zip(*(data[i] for i in range(8))))
    optimizer = torch.optim.Adam(trunk.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = DistogramLoss()(trunk(msa), bins)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_bad_configs_and_batches_are_refused():
    with pytest.raises(ValueError, match="c_m=0"):
        EvoformerConfig(c_m=0)
    with pytest.raises(ValueError, match="min_distance"):
        TrunkConfig(min_distance=5.0, max_distance=2.0)
    with pytest.raises(ValueError, match="sequences, residues"):
        EvoformerTrunk(TrunkConfig(block=CONFIG))(torch.zeros(4, 5, dtype=torch.long))


def test_padded_residues_under_the_mask_change_nothing_for_the_real_ones():
    from tessera.models.evoformer.axial import pad_residues

    block = randomised(EvoformerBlock(CONFIG))
    m, z = inputs(r=5)
    m_pad, z_pad, mask = pad_residues(m, z, 4)
    assert m_pad.shape[2] == 8 and mask is not None and mask.tolist() == [True] * 5 + [False] * 3
    want_m, want_z = block(m, z)
    got_m, got_z = block(m_pad, z_pad, mask)
    torch.testing.assert_close(got_m[:, :, :5], want_m)
    torch.testing.assert_close(got_z[:, :5, :5], want_z)
    unmasked_m, _ = block(m_pad, z_pad)
    assert not torch.allclose(unmasked_m[:, :, :5], want_m), "without the mask the padding leaks in"


@pytest.mark.parametrize("chunk", [1, 2, 3, 64])
def test_chunked_inference_gives_the_blocks_outputs(chunk):
    from tessera.models.evoformer.axial import pad_residues
    from tessera.models.evoformer.chunked import chunked_block

    block = randomised(EvoformerBlock(CONFIG))
    m, z = inputs(s=5, r=7)
    with torch.no_grad():
        want = block(m, z)
    got = chunked_block(block, m, z, chunk)
    torch.testing.assert_close(got, want)
    m_pad, z_pad, mask = pad_residues(m, z, 4)
    got_m, got_z = chunked_block(block, m_pad, z_pad, chunk, mask)
    torch.testing.assert_close((got_m[:, :, :7], got_z[:, :7, :7]), want)


def test_the_chunk_fits_the_budget():
    from tessera.models.evoformer.chunked import chunk_for, row_bytes

    per_row = row_bytes(CONFIG, 1, 8, 64)
    assert per_row == 4 * max(2 * 64 * 64, 2 * 64 * 64, 2 * 8 * 8, 64 * 9, 64 * 5 + 64 * 2 * 6)
    assert chunk_for(CONFIG, 1, 8, 64, 10 * per_row) == 10
    assert chunk_for(CONFIG, 1, 8, 64, 10 * per_row - 1) == 9
    assert chunk_for(CONFIG, 1, 8, 64, 1) == 1
    with pytest.raises(ValueError, match="must be positive"):
        chunk_for(CONFIG, 1, 8, 64, 0)
