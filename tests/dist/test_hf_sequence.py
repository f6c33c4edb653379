"""An unmodified transformers LLaMA (grouped-query attention, rotary embeddings) under sequence
parallelism by its tessera.hf policy, in each sequence mode (ring self-attention, ring attention
with online softmax on the zigzag layout, all-to-all): 10 AdamW steps on two ranks' tokens give
the losses and the weights of plain single-process transformers (fp32, ``tessera.testing.tolerance``), and attention
crossed the sequence axis. A model with a sliding window is refused."""

from __future__ import annotations

import pytest
import torch
import transformers

import tessera
from tessera import comm
from tessera.checkpoint import full_state_dict
from tessera.errors import ConfigError
from tessera.parallel.sequence import MODES
from tessera.testing import use_layout
from tests.dist.test_hf_tensor import TOL, batches, build, loss_of, optimizer_of, reference


def layout(mode: str):
    return use_layout(sequence=2, config={"parallel": {"sequence": {"size": 2, "mode": mode}}})


def train(mode: str):
    layout(mode)
    model = build("llama")
    engine, *_ = tessera.initialize(model, optimizer_of(model), loss_of)
    losses = []
    for step, (x, y) in enumerate(batches()):
        with comm.ledger() as sent:
            losses.append(float(engine.train_batch(iter([(x, y)]))))
        if step == 0:  # the attention of both layers crossed the sequence axis, forward and backward
            assert sent.calls(axis="sequence") >= 2 * model.config.num_hidden_layers, sent
    return losses, full_state_dict(engine.model)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_llama_trains_over_the_sequence_axis_as_in_one_process(pools, mode):
    expected_losses, expected = reference("llama")
    for losses, state in pools.run(2, train, mode, timeout=300):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), **TOL)
        assert set(state) == set(expected)
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, **TOL, msg=lambda m, key=key: key + m)


def refused() -> str:
    layout("ring")
    config = transformers.MistralConfig(
        vocab_size=67, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=8,
    )  # fmt: skip
    model = transformers.MistralForCausalLM(config)
    with pytest.raises(ConfigError) as error:
        tessera.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_of)
    return str(error.value)


def test_a_sliding_window_is_refused_under_sequence_parallelism(pools):
    for message in pools.run(2, refused):
        assert "MistralForCausalLM" in message and "sliding window of 8 tokens" in message
