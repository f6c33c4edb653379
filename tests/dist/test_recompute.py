"""Activation checkpointing, full and selective, gives bitwise the losses, gradient norms and weights of
training without it, with dropout on, in every kind of layout (the dropout masks replay exactly in
the recompute); and its saved activations are the block inputs (full) or the matmul outputs
(selective)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import tessera
from tessera.checkpoint import full_state_dict
from tessera.models import NextTokenLoss, gpt
from tessera.nn import checkpoint_blocks
from tessera.nn.recompute import kept_for_backward
from tessera.testing import use_layout
from tests.dist.test_tp_models import GLOBAL_BATCH, SEQ, dataset

STEPS = 3

# name: (pool size, use_layout arguments, config sections)
LAYOUTS = {
    "dp2": (2, dict(data=2), {}),
    "tp2-1d-sp": (2, dict(tensor=2), {"parallel": {"tensor": {"size": 2, "sequence_parallel": True}}}),
    "tp4-2d": (4, dict(tensor=4, mode="2d"), {"parallel": {"tensor": {"size": 4, "mode": "2d"}}}),
    "pp2-1f1b": (2, dict(pipeline=2), {"parallel": {"pipeline": {"size": 2, "schedule": "1f1b", "microbatches": 2}}}),
    "pp2-zero-bubble": (
        2,
        dict(pipeline=2),
        {"parallel": {"pipeline": {"size": 2, "schedule": "zero_bubble", "microbatches": 2}}},
    ),
    "zero3-dp2": (2, dict(data=2), {"zero": {"stage": 3}}),
    "sp2-ring": (2, dict(sequence=2), {"parallel": {"sequence": {"size": 2, "mode": "ring"}}}),
    # dropout in forks nested in the sequence stream (tensor-parallel regions), replayed in the recompute
    "sp2-tp2-1d-sp": (
        4, dict(sequence=2, tensor=2),
        {"parallel": {"sequence": {"size": 2, "mode": "all_to_all"}, "tensor": {"size": 2, "sequence_parallel": True}}},
    ),
}


def run(layout: dict, sections: dict, mode: str):
    config = {**sections, "activation_checkpoint": {"mode": mode}, "clip_grad_norm": 1e9}  # the norm, every step
    ctx = use_layout(**layout, config=config)
    ctx.rng.restore({})  # every run draws its dropout masks from the same streams
    torch.manual_seed(0)
    sp = ctx.size("sequence") > 1
    model = gpt("tiny", vocab_size=64, max_seq_len=SEQ, d_model=32, n_layers=2, n_heads=4, dropout=0.1,
                attention_dropout=0.0 if sp else None)  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    micro = sections.get("parallel", {}).get("pipeline", {}).get("microbatches", 1)
    loader = DataLoader(dataset("gpt"), batch_size=GLOBAL_BATCH // (ctx.size("data") * micro))
    engine, loader, _, _ = tessera.initialize(model, optimizer, NextTokenLoss(), loader)
    engine.train()
    torch.manual_seed(1)
    it = iter(loader)
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(engine.train_batch(it))
        norms.append(engine.last_grad_norm)
    recomputed = [m for m in model.modules() if getattr(m, "_tessera_recompute", None)]
    assert len(recomputed) == (0 if mode == "none" else 2)
    return losses, norms, full_state_dict(model)


def body(layout: dict, sections: dict):
    plain = run(layout, sections, "none")
    out = {}
    for mode in ("full", "selective"):
        losses, norms, state = run(layout, sections, mode)
        out[mode] = (
            losses == plain[0],
            norms == plain[1],
            all(torch.equal(state[k], plain[2][k]) for k in plain[2]),
        )
    return out, plain[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_checkpointing_is_bitwise_training_without_it(pools, name):
    ranks, layout, sections = LAYOUTS[name]
    for out, losses in pools.run(ranks, body, layout, sections, timeout=600):
        assert out == {"full": (True, True, True), "selective": (True, True, True)}, (name, out)
        assert losses[0] != losses[-1]  # it trained


def _saved(model: torch.nn.Module, x: torch.Tensor) -> dict[str, int]:
    """Bytes the forward keeps for the backward (saved-tensor hooks, with the matmul outputs
    selective checkpointing keeps inside its checkpoints)."""
    return {"activations": kept_for_backward(lambda: model(x).sum(), model.parameters())}


def test_saved_activations_fall_to_the_block_inputs_or_the_matmul_outputs():
    torch.manual_seed(0)
    d, blocks, batch, seq = 64, 4, 2, 32
    x = torch.randint(0, 64, (batch, seq))
    sizes = {}
    for mode in ("none", "full", "selective"):
        torch.manual_seed(0)
        model = gpt("tiny", vocab_size=64, max_seq_len=seq, d_model=d, n_layers=blocks, n_heads=4)
        checkpoint_blocks(model, mode=mode)
        sizes[mode] = _saved(model, x)["activations"]
    one = batch * seq * d * 4  # one [b, s, d] fp32 activation
    # full: each block keeps its input only; outside the blocks: embeddings, final norm and head
    outside = _saved_outside(x, d, blocks)
    assert sizes["full"] == blocks * one + outside
    # selective: each block's input and its matmul outputs (qkv 3d, attention out d, fc 4d, proj d:
    # 9 x one); LayerNorm, GELU, dropout and the attention scores and probabilities are recomputed
    assert sizes["selective"] == blocks * (1 + 9) * one + outside
    assert sizes["none"] > blocks * 16 * one + outside  # without checkpointing: over 16 x one per block


def _saved_outside(x: torch.Tensor, d: int, blocks: int) -> int:
    torch.manual_seed(0)
    model = gpt("tiny", vocab_size=64, max_seq_len=x.shape[1], d_model=d, n_layers=blocks, n_heads=4)
    model.blocks = torch.nn.ModuleList()  # the same model without its blocks
    return _saved(model, x)["activations"]
