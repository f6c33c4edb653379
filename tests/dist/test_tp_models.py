"""The GPT and the ViT, written once with tessera.nn, train to the single-process answer in every
tensor-parallel mode, combined with data parallelism; under bf16 the grid modes stay within 2e-2
of the fp32 answer."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tessera
from tessera import nn as tnn
from tessera.checkpoint import full_state_dict
from tessera.memory import model_state_bytes
from tessera.models import NextTokenLoss, gpt, vit
from tessera.parallel.tensor.common import gather_full, spec_of
from tessera.testing import tolerance, use_layout

# a handful of AdamW steps reach every path (the first step, bias correction, accumulated states)
STEPS = 6
GLOBAL_BATCH = 8
SEQ = 16

# (pool size, layout) -- the layouts the issue names
LAYOUTS = {
    "1d-tp2-dp2": (4, dict(tensor=2, mode="1d", data=2)),
    "1d-tp2-sp-dp2": (4, dict(tensor=2, mode="1d", data=2, sequence_parallel=True)),
    "2d-tp4": (4, dict(tensor=4, mode="2d")),
    "2.5d-tp8-d2": (8, dict(tensor=8, mode="2.5d", depth=2)),
    "3d-tp8": (8, dict(tensor=8, mode="3d")),
    # the blocks each Linear received in the forward kept for its backward (3D: the gathered weight)
    "2d-tp4-keep": (4, dict(tensor=4, mode="2d", keep_blocks=True)),
    "2.5d-tp8-d2-keep": (8, dict(tensor=8, mode="2.5d", depth=2, keep_blocks=True)),
    "3d-tp8-keep": (8, dict(tensor=8, mode="3d", keep_blocks=True)),
}


def config_for(layout: dict) -> dict:
    tensor = {"size": layout.get("tensor", 1), "mode": layout.get("mode", "1d"), "depth": layout.get("depth", 1),
              "sequence_parallel": layout.get("sequence_parallel", False),
              "keep_blocks": layout.get("keep_blocks", False)}  # fmt: skip
    precision = {"dtype": layout.get("dtype", "fp32")}
    return {"parallel": {"data": layout.get("data"), "tensor": tensor}, "mixed_precision": precision}


def context_for(layout: dict | None):
    layout = dict(layout or {})
    config = config_for(layout)
    layout.pop("sequence_parallel", None)
    layout.pop("keep_blocks", None)
    layout.pop("dtype", None)
    return use_layout(**layout, config=config)


def build(kind: str, **overrides) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        return gpt("tiny", vocab_size=64, max_seq_len=SEQ, d_model=32, n_layers=2, n_heads=4, **overrides)
    # 12x12 images in 4x4 patches: 9 patches + the class token = 10 tokens, even for sequence parallelism
    return vit("tiny", img_size=12, patch_size=4, d_model=32, n_layers=2, n_heads=4, **overrides)


def dataset(kind: str) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    n = GLOBAL_BATCH * STEPS
    if kind == "gpt":
        tokens = torch.randint(0, 64, (n, SEQ + 1), generator=g)
        return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    return TensorDataset(torch.randn(n, 3, 12, 12, generator=g), torch.randint(0, 10, (n,), generator=g))


def criterion(kind: str) -> nn.Module:
    return NextTokenLoss() if kind == "gpt" else tnn.CrossEntropyLoss()


def train(kind: str, layout: dict | None):
    """Train on every rank of the layout (or in this process with layout None)."""
    ctx = context_for(layout)
    model = build(kind)
    initial = full_state_dict(model)
    # eps well above the rounding noise: a gradient that is zero in exact arithmetic (the key bias of
    # attention) must not be turned into full-size Adam updates of layout-dependent sign.
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    loader = DataLoader(dataset(kind), batch_size=GLOBAL_BATCH // ctx.size("data"))
    engine, loader, _, _ = tessera.initialize(model, optimizer, criterion(kind), loader)
    it = iter(loader)
    losses = [engine.train_batch(it) for _ in range(STEPS)]
    final = full_state_dict(model)
    return losses, (initial, final) if ctx.rank == 0 else None


@pytest.fixture(scope="module")
def references():
    return {kind: train(kind, None) for kind in ("gpt", "vit")}


@pytest.mark.parametrize("kind", ["gpt", "vit"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_model_trains_to_the_single_process_answer(pools, references, kind, name):
    ranks, layout = LAYOUTS[name]
    results = pools.run(ranks, train, kind, layout, timeout=600)
    losses, (initial, final) = results[0]
    ref_losses, (ref_initial, ref_final) = references[kind]
    assert initial.keys() == ref_initial.keys()
    for key in ref_initial:
        assert torch.equal(initial[key], ref_initial[key]), f"{key}: the initial weights depend on the layout"
    tol = tolerance(blocks=2, steps=STEPS)  # build(): 2 blocks
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **tol)
    assert all(r[0] == losses for r in results), "every rank reports the same loss"
    for key in ref_final:
        torch.testing.assert_close(final[key], ref_final[key], **tol, msg=key)


@pytest.mark.parametrize("name", ["2d-tp4", "2.5d-tp8-d2", "3d-tp8"])
def test_under_bf16_the_grid_modes_track_the_fp32_answer(pools, references, name):
    """bf16 autocast with fp32 masters: the SUMMA and 3D products compute in bf16 as F.linear
    would (their operands cast as autocast casts F.linear's), within 2e-2 of fp32 single-process."""
    ranks, layout = LAYOUTS[name]
    losses, _ = pools.run(ranks, train, "gpt", {**layout, "dtype": "bf16"}, timeout=600)[0]
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, references["gpt"][0], strict=True)]
    assert 1e-5 < max(rel) < 2e-2, rel  # bf16 did run, and stays close


def body_big_vocab_loss(layout: dict | None):
    ctx = use_layout(**(layout or {}), config=config_for(layout or {}))
    torch.manual_seed(0)
    model = gpt("tiny", vocab_size=50257, max_seq_len=8, d_model=32, n_layers=1, n_heads=4)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 50257, (4, 9), generator=g)
    loss = NextTokenLoss()(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    weight = model.tok_emb.weight  # tied: the gradient sums the embedding's and the head's
    spec = spec_of(weight)
    grad = gather_full(weight.grad, spec, ctx) if spec is not None else weight.grad
    return float(loss.detach()), ctx.rank, tuple(weight.shape), grad


BIG_VOCAB_LAYOUTS = {
    "1d-tp4": (4, dict(tensor=4, mode="1d")),
    "2d-tp4": (4, dict(tensor=4, mode="2d")),
    "2.5d-tp8-d2": (8, dict(tensor=8, mode="2.5d", depth=2)),
    "3d-tp8": (8, dict(tensor=8, mode="3d")),
}


def test_vocabulary_50257_gives_the_single_process_loss_in_every_mode(pools):
    ref_loss, _, ref_shape, ref_grad = body_big_vocab_loss(None)
    assert ref_shape == (50257, 32)
    # one block forward and backward, and a log-sum-exp over 50257 logits (a sum log2(n) deep)
    tol = tolerance(depth=2 * 8 + 16)
    for name, (ranks, layout) in BIG_VOCAB_LAYOUTS.items():
        for loss, _, shape, grad in pools.run(ranks, body_big_vocab_loss, layout):
            assert loss == pytest.approx(ref_loss, rel=tol["rtol"], abs=tol["atol"]), name
            torch.testing.assert_close(grad, ref_grad, **tol, msg=name)
            assert shape[0] < 50257, f"{name}: the vocabulary is split"


def body_parameter_bytes(layout: dict):
    ctx = use_layout(**layout, config=config_for(layout))
    stack = nn.Sequential(*(tnn.Linear(64, 64, bias=False, input_is_parallel=i % 2 == 1) for i in range(4)))
    return model_state_bytes(stack)["parameters"], ctx.dims.tensor_q, ctx.size("tensor")


MEMORY = {
    # name: (pool, layout, fraction of the full weights a rank holds, from each mode's memory column)
    "1d-tp4": (4, dict(tensor=4, mode="1d"), lambda q, p: 1 / p),
    "2d-tp4": (4, dict(tensor=4, mode="2d"), lambda q, p: 1 / q**2),
    "2.5d-tp8-d2": (8, dict(tensor=8, mode="2.5d", depth=2), lambda q, p: 1 / q**2),
    "3d-tp8": (8, dict(tensor=8, mode="3d"), lambda q, p: 1 / q**3),
}


def test_parameter_bytes_per_rank_follow_each_modes_memory_column(pools):
    full = 4 * 64 * 64 * 4  # four 64x64 fp32 weights
    for name, (ranks, layout, fraction) in MEMORY.items():
        for got, q, p in pools.run(ranks, body_parameter_bytes, layout):
            assert got == full * fraction(q, p), (name, got)
