"""Dynamic axial parallelism of one Evoformer block (tessera.models.evoformer.axial) on 2 and 4
ranks equals the block in one process: the outputs, the gradients of the inputs (each rank its
share of the MSA's sequences and of the pairs' rows), and the parameters' gradients summed over
the ranks (fp32, 1e-5); for residue counts that divide the ranks and, padded and masked, counts
that do not (compared with the unpadded block)."""

from __future__ import annotations

import pytest
import torch

from tessera import comm
from tessera.models.evoformer import EvoformerBlock, EvoformerConfig
from tessera.models.evoformer.axial import axial_block, block_bytes, pad_residues
from tessera.testing import use_layout

CONFIG = EvoformerConfig(c_m=8, c_z=6, msa_heads=2, msa_head_dim=4, pair_heads=2, pair_head_dim=3, outer_dim=3,
                         triangle_dim=5, transition=2)  # fmt: skip
B, S = 2, 4


def compare_body(R: int) -> dict[str, float]:
    group = use_layout(config={}).group("world")
    n, rank = group.size, group.rank
    torch.manual_seed(0)
    block = EvoformerBlock(CONFIG)
    with torch.no_grad():  # every weight drawn at random: the zero and one initialisations would hide terms
        for p in block.parameters():
            p.normal_(0, 0.3)
    g = torch.Generator().manual_seed(1)
    m, z = torch.randn(B, S, R, CONFIG.c_m, generator=g), torch.randn(B, R, R, CONFIG.c_z, generator=g)
    up_m, up_z = torch.randn(B, S, R, CONFIG.c_m, generator=g), torch.randn(B, R, R, CONFIG.c_z, generator=g)
    m_full, z_full = m.clone().requires_grad_(), z.clone().requires_grad_()
    m_out, z_out = block(m_full, z_full)
    ((m_out * up_m).sum() + (z_out * up_z).sum()).backward()
    reference = {name: p.grad.clone() for name, p in block.named_parameters()}
    block.zero_grad(set_to_none=True)

    # padded to a multiple of n where R does not divide (zeros; the mask keeps them out)
    m_pad, z_pad, mask = pad_residues(m, z, n)
    up_m_pad, up_z_pad, _ = pad_residues(up_m, up_z, n)
    share = m_pad.shape[2] // n
    seqs, rows = slice(rank * S // n, (rank + 1) * S // n), slice(rank * share, (rank + 1) * share)
    m_local, z_local = m_pad[:, seqs].clone().requires_grad_(), z_pad[:, rows].clone().requires_grad_()
    m_dap, z_dap = axial_block(block, m_local, z_local, group, mask)
    ((m_dap * up_m_pad[:, seqs]).sum() + (z_dap * up_z_pad[:, rows]).sum()).backward()
    real = slice(rank * share, min((rank + 1) * share, R))  # this rank's rows that are residues
    mine = slice(0, real.stop - real.start)

    def err(got: torch.Tensor, want: torch.Tensor) -> float:
        # relative to the largest entry, or to 0.1 where every entry is ~0 (a layer norm's bias before
        # a softmax's logits: a shift the softmax cannot see has no gradient but rounding)
        return float((got - want).abs().max() / max(float(want.abs().max()), 0.1))

    out = {
        "m": err(m_dap[:, :, :R], m_out[:, seqs]),
        "m.grad": err(m_local.grad[:, :, :R], m_full.grad[:, seqs]),
    }
    if mine.stop > 0:  # a rank may hold only padding
        out["z"] = err(z_dap[:, mine, :R], z_out[:, real])
        out["z.grad"] = err(z_local.grad[:, mine, :R], z_full.grad[:, real])
    for name, p in block.named_parameters():
        out[f"param {name}"] = err(comm.all_reduce(p.grad.clone(), group), reference[name])
    return out


@pytest.mark.parametrize(("ranks", "residues"), [(2, 8), (4, 8), (2, 7), (4, 6), (4, 5)])
def test_an_axially_parallel_block_equals_one_process(pools, ranks, residues):
    for rank, errors in enumerate(pools.run(ranks, compare_body, residues)):
        worst = {k: v for k, v in errors.items() if v > 1e-5}
        assert not worst, (rank, worst)


def ledger_body(R: int) -> dict[str, dict]:
    group = use_layout(config={}).group("world")
    n, rank = group.size, group.rank
    torch.manual_seed(0)
    block = EvoformerBlock(CONFIG)
    g = torch.Generator().manual_seed(1)
    m, z, mask = pad_residues(
        torch.randn(B, S, R, CONFIG.c_m, generator=g), torch.randn(B, R, R, CONFIG.c_z, generator=g), n
    )
    share = m.shape[2] // n
    m_local = m[:, rank * S // n : (rank + 1) * S // n].clone().requires_grad_()
    z_local = z[:, rank * share : (rank + 1) * share].clone().requires_grad_()
    with comm.ledger() as forward:
        m_out, z_out = axial_block(block, m_local, z_local, group, mask)
    with comm.ledger() as backward:
        (m_out.sum() + z_out.sum()).backward()
    return {"forward": forward.summary(), "backward": backward.summary()}


@pytest.mark.parametrize(("ranks", "residues"), [(2, 8), (4, 8), (4, 6)])
def test_the_ledgers_bytes_per_block_are_the_formulas(pools, ranks, residues):
    want = block_bytes(CONFIG, B, S, residues, ranks)
    for seen in pools.run(ranks, ledger_body, residues):
        forward = {op: v["bytes"] for (op, axis), v in seen["forward"].items()}
        backward = {op: v["bytes"] for (op, axis), v in seen["backward"].items()}
        assert forward == {"all_gather": want["all_gather"], "all_to_all": want["all_to_all"]}, (forward, want)
        assert backward == {"reduce_scatter": want["all_gather"], "all_to_all": want["all_to_all"]}, (backward, want)
        calls = {op: v["calls"] for (op, axis), v in seen["forward"].items()}
        assert calls == {"all_gather": 6, "all_to_all": 5}, calls
