"""Unmodified transformers models (GPT-2 with its head tied to the embedding across stages;
LLaMA with grouped-query attention and rotary embeddings) through pipeline stages by their
tessera.hf policies: pp2 with 1F1B, and pp2 x tp2 (1d) x dp2. 10 AdamW steps give the losses and
the weights of plain single-process transformers (fp32, ``tessera.testing.tolerance``), compared through the Hugging
Face state-dict keys. A padded attention mask (dict micro-batches) reaches every stage. Under
bf16 (autocast, fp32 masters) the losses stay within 2e-2 of fp32's."""

from __future__ import annotations

import pytest
import torch

import tessera
from tessera.checkpoint import full_state_dict
from tessera.testing import use_layout
from tests.dist.test_hf_tensor import BATCH, TOL, batches, build, loss_of, optimizer_of, reference

MICRO = 4  # micro-batches per step

LAYOUTS = {  # pipeline, tensor, data
    "pp2-1f1b": (2, 1, 1),
    "pp2-tp2-dp2": (2, 2, 2),
}


def masks() -> list[torch.Tensor]:
    """Left padding: row r of every batch masks its first r % 4 positions."""
    seq = batches()[0][0].shape[1]
    pads = torch.tensor([r % 4 for r in range(BATCH)])
    return [(torch.arange(seq) >= pads[:, None]).long() for _ in batches()]


def masked_reference(family: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build(family)
    optimizer = optimizer_of(model)
    losses = []
    for (x, y), mask in zip(batches(), masks(), strict=True):
        optimizer.zero_grad()
        loss = loss_of(model(input_ids=x, attention_mask=mask), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(family: str, pipeline: int, tensor: int, data: int, masked: bool = False, dtype: str = "fp32"):
    parallel = {
        "data": data,
        "pipeline": {"size": pipeline, "schedule": "1f1b", "microbatches": MICRO},
        "tensor": {"size": tensor, "mode": "1d"},
    }
    config = {"parallel": parallel, "mixed_precision": {"dtype": dtype}}
    ctx = use_layout(pipeline=pipeline, tensor=tensor, data=data, config=config)
    model = build(family)
    keys = list(model.state_dict())
    engine, *_ = tessera.initialize(model, optimizer_of(model), loss_of)
    rows = BATCH // data
    mine = slice(ctx.local_rank("data") * rows, (ctx.local_rank("data") + 1) * rows)
    losses = []
    for (x, y), mask in zip(batches(), masks(), strict=True):
        x, y, mask = x[mine], y[mine], mask[mine]
        if masked:
            micro = [({"input_ids": x[k::MICRO], "attention_mask": mask[k::MICRO]}, y[k::MICRO]) for k in range(MICRO)]
        else:
            micro = [(x[k::MICRO], y[k::MICRO]) for k in range(MICRO)]
        losses.append(float(engine.train_batch(iter(micro))))
    return losses, full_state_dict(engine.model), keys, engine.strategy.name


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_transformers_model_trains_through_pipeline_stages_as_in_one_process(pools, family, layout):
    pipeline, tensor, data = LAYOUTS[layout]
    expected_losses, expected = reference(family)
    for losses, state, keys, strategy in pools.run(pipeline * tensor * data, train, family, pipeline, tensor, data):
        assert strategy.startswith("pipeline(1f1b)")
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), **TOL)
        assert set(state) == set(keys) == set(expected)
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, **TOL, msg=lambda m, key=key: key + m)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_padded_attention_mask_reaches_every_stage(pools, family):
    expected_losses, expected = masked_reference(family)
    unmasked, _ = reference(family)
    assert abs(expected_losses[0] - unmasked[0]) > 1e-3  # the mask changes the answer
    for losses, state, _, _ in pools.run(2, train, family, 2, 1, 1, True):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), **TOL)
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, **TOL, msg=lambda m, key=key: key + m)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_under_bf16_the_losses_track_fp32_transformers(pools, family):
    """bf16 autocast with fp32 master weights under pp2 x tp2 x dp2: every step's loss within 2e-2
    of plain single-process fp32 transformers', and the weights moved as far as fp32's."""
    expected_losses, expected = reference(family)
    start = build(family).state_dict()
    for losses, state, _, _ in pools.run(8, train, family, 2, 2, 2, False, "bf16", timeout=300):
        rel = [abs(a - b) / abs(b) for a, b in zip(losses, expected_losses, strict=True)]
        assert 1e-5 < max(rel) < 2e-2, rel  # bf16 did run, and stays close
        assert all(state[k].dtype == torch.float32 for k in expected)
        for key, value in expected.items():
            moved, fp32_moved = (state[key] - start[key]).norm(), (value - start[key]).norm()
            assert abs(moved - fp32_moved) <= 0.1 * fp32_moved + 1e-6, key
