"""Unmodified transformers encoders (BERT with its masked-LM head tied to the word embedding,
bias included, padding, token types, its classifiers and base model; ViT on synthetic images)
in the grid tensor modes by their tessera.hf policies: 4 AdamW steps give the losses and the
weights of plain single-process transformers (fp32, ``tessera.testing.tolerance``) through the
Hugging Face keys; under bf16 (autocast, fp32 masters) the losses stay within 2e-2 of fp32
transformers'."""

from __future__ import annotations

from functools import cache

import pytest
import torch

import tessera
from tessera.checkpoint import full_state_dict
from tessera.testing import tolerance, use_layout
from tests.dist.test_hf_encoders import batches, build, loss_of, optimizer_of
from tests.dist.test_hf_grid import LAYOUTS

STEPS = 4  # the first of test_hf_encoders' batches: a few AdamW steps reach every path of the step
TOL = tolerance(blocks=2, steps=STEPS)  # build(): 2 layers


def steps(family: str) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """The first ``STEPS`` of ``family``'s batches: the model's positional inputs and the targets."""
    return batches(family)[:STEPS]


@cache
def reference(family: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process transformers on :func:`steps` (once per family: the tests share it)."""
    model = build(family)
    optimizer = optimizer_of(model)
    losses = []
    for inputs, y in steps(family):
        optimizer.zero_grad()
        loss = loss_of(model(*inputs), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def check_against_reference(family: str, results) -> None:
    expected_losses, expected = reference(family)
    for losses, state, keys, facts in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), **TOL)
        assert set(state) == set(keys) == set(expected)
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, **TOL, msg=lambda m, key=key: key + m)
        assert facts["optimizer_has_the_model"]


def train(family: str, tensor: int, mode: str, depth: int, dtype: str = "fp32"):
    parallel = {"tensor": {"size": tensor, "mode": mode, "depth": depth}}
    use_layout(
        tensor=tensor, mode=mode, depth=depth, config={"parallel": parallel, "mixed_precision": {"dtype": dtype}}
    )
    model = build(family)
    keys = list(model.state_dict())
    optimizer = optimizer_of(model)
    engine, *_ = tessera.initialize(model, optimizer, loss_of)
    losses = []
    for inputs, y in steps(family):
        engine.zero_grad()
        loss = loss_of(engine(*inputs), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    facts = {
        "kinds": {type(m).__name__ for m in model.modules() if type(m).__module__ == "tessera.hf.grid"},
        "optimizer_has_the_model": stepped == {id(p) for p in model.parameters()},
    }
    if hasattr(model, "cls"):
        facts["bias_tied"] = model.cls.predictions.bias is model.cls.predictions.decoder.bias
    return losses, full_state_dict(engine.model), keys, facts


@pytest.mark.parametrize("family", ["bert", "vit"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_an_encoder_trains_as_in_one_process_in_each_grid_mode(pools, family, layout):
    tensor, mode, depth = LAYOUTS[layout]
    results = pools.run(tensor, train, family, tensor, mode, depth, timeout=300)
    check_against_reference(family, results)
    for *_, facts in results:
        assert {"GridLinear", "GridNorm", "GridHead"} <= facts["kinds"]
        assert ("GridEmbedding" in facts["kinds"]) == (family == "bert")
        assert facts.get("bias_tied", True)


@pytest.mark.parametrize("family", ["bert-padded", "bert-classifier", "bert-token-classifier", "bert-base"])
def test_bert_with_padding_token_types_and_its_other_heads_in_2d(pools, family):
    check_against_reference(family, pools.run(4, train, family, 4, "2d", 1, timeout=300))


@pytest.mark.parametrize("family", ["bert", "vit"])
def test_under_bf16_an_encoder_tracks_fp32_transformers_in_2d(pools, family):
    expected_losses, _ = reference(family)
    for losses, *_ in pools.run(4, train, family, 4, "2d", 1, "bf16", timeout=300):
        rel = [abs(a - b) / abs(b) for a, b in zip(losses, expected_losses, strict=True)]
        assert 1e-5 < max(rel) < 2e-2, rel  # bf16 did run, and stays close
