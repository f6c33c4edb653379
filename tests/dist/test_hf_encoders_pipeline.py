"""Unmodified transformers encoders through pipeline stages by their tessera.hf policies: BERT
with its masked-LM head tied to the word embedding (the tie crossing the stages), BERT's sequence
classifier (the pooler on the last stage; a padding mask and token types reaching every stage in
dict micro-batches), the base model (hidden states and pooler output as the last stage's output)
and ViT on synthetic images (its classifier on the class token), under pp2 with 1F1B and pp2 x
tp2 (1d) x dp2. 10 AdamW steps give the losses and the weights of plain single-process
transformers (fp32, ``tessera.testing.tolerance``), compared through the Hugging Face state-dict keys."""

from __future__ import annotations

import pytest
import torch

import tessera
from tessera.checkpoint import full_state_dict
from tessera.testing import use_layout
from tests.dist.test_hf_encoders import BATCH, TOL, batches, build, loss_of, optimizer_of, reference

MICRO = 4  # micro-batches per step: one row each on a replica of pp2 x tp2 x dp2
INPUTS = ("input_ids", "attention_mask", "token_type_ids")

LAYOUTS = {  # pipeline, tensor, data
    "pp2-1f1b": (2, 1, 1),
    "pp2-tp2-dp2": (2, 2, 2),
}


def micro_batches(inputs: tuple[torch.Tensor, ...], targets: torch.Tensor) -> list[tuple]:
    """The step's rows as MICRO micro-batches of (inputs, targets): the image or token tensor
    alone, or a dict of the model's inputs (ids, mask, token types)."""
    out = []
    for k in range(MICRO):
        x = inputs[0][k::MICRO] if len(inputs) == 1 else {n: t[k::MICRO] for n, t in zip(INPUTS, inputs)}
        out.append((x, targets[k::MICRO]))
    return out


def train(family: str, pipeline: int, tensor: int, data: int):
    parallel = {
        "data": data,
        "pipeline": {"size": pipeline, "schedule": "1f1b", "microbatches": MICRO},
        "tensor": {"size": tensor, "mode": "1d"},
    }
    ctx = use_layout(pipeline=pipeline, tensor=tensor, data=data, config={"parallel": parallel})
    model = build(family)
    keys = list(model.state_dict())
    engine, *_ = tessera.initialize(model, optimizer_of(model), loss_of)
    rows = BATCH // data
    mine = slice(ctx.local_rank("data") * rows, (ctx.local_rank("data") + 1) * rows)
    losses = []
    for inputs, y in batches(family):
        step = micro_batches(tuple(t[mine] for t in inputs), y[mine])
        losses.append(float(engine.train_batch(iter(step))))
    return losses, full_state_dict(engine.model), keys, engine.strategy.name


@pytest.mark.parametrize("family", ["bert", "bert-classifier", "vit"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_an_encoder_trains_through_pipeline_stages_as_in_one_process(pools, family, layout):
    pipeline, tensor, data = LAYOUTS[layout]
    expected_losses, expected = reference(family)
    results = pools.run(pipeline * tensor * data, train, family, pipeline, tensor, data, timeout=300)
    for losses, state, keys, strategy in results:
        assert strategy.startswith("pipeline(1f1b)")
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), **TOL)
        assert set(state) == set(keys) == set(expected)
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, **TOL, msg=lambda m, key=key: key + m)


def test_a_base_encoder_hands_on_its_hidden_states_and_pooler_output(pools):
    expected_losses, expected = reference("bert-base")
    for losses, state, _, _ in pools.run(2, train, "bert-base", 2, 1, 1):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), **TOL)
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, **TOL, msg=lambda m, key=key: key + m)
