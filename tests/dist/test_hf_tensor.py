"""Unmodified transformers models (GPT-2; LLaMA with grouped-query attention) under 1D tensor
parallelism by their tessera.hf policy, with and without sequence-parallel regions and beside
data parallelism: 10 AdamW steps give the losses and the weights of plain single-process
transformers (fp32, ``tessera.testing.tolerance``), compared through the Hugging Face state-dict keys. A model whose
heads do not divide the tensor size, and a model without a policy, fail at initialize naming
the class, the rule and the layouts that work."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

import tessera
from tessera.checkpoint import full_state_dict
from tessera.errors import ConfigError
from tessera.testing import tolerance, use_layout

STEPS = 10
TOL = tolerance(blocks=2, steps=STEPS)  # build(): 2 layers
BATCH, SEQ, VOCAB = 8, 16, 67  # the vocabulary does not divide the tensor size


def build(family: str, **overrides) -> torch.nn.Module:
    """A small random model of ``family``, the same on every rank and in the reference."""
    if family == "gpt2":
        fields = dict(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        config = transformers.GPT2Config(**(fields | overrides))
    else:  # grouped-query attention: 8 query heads share 4 key/value heads; an MLP width 4 does not divide
        fields = dict(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=50, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ,
        )  # fmt: skip
        config = transformers.LlamaConfig(**(fields | overrides))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=g)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def loss_of(output, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1), targets.flatten())


def optimizer_of(model: torch.nn.Module) -> torch.optim.Optimizer:
    # eps well above the gradients' rounding: with eps=1e-6 Adam's normalisation turns the
    # reduction order's last-bit differences on an almost-zero gradient into a visible step
    # (one embedding element of 2,144 off by 1e-4 after 10 steps, the losses equal to 1e-5)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)


def reference(family: str, rows: int = BATCH) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process transformers on the first ``rows`` rows of each batch."""
    model = build(family)
    optimizer = optimizer_of(model)
    losses = []
    for x, y in batches():
        x, y = x[:rows], y[:rows]
        optimizer.zero_grad()
        loss = loss_of(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def layout(tensor: int, data: int = 1, sequence_parallel: bool = False):
    tensor_config = {"size": tensor, "mode": "1d", "sequence_parallel": sequence_parallel}
    config = {"parallel": {"data": data, "tensor": tensor_config}}
    return use_layout(tensor=tensor, data=data, sequence_parallel=sequence_parallel, config=config)


def train(family: str, tensor: int, data: int, sequence_parallel: bool):
    ctx = layout(tensor, data, sequence_parallel)
    model = build(family)
    keys = list(model.state_dict())
    engine, *_ = tessera.initialize(model, optimizer_of(model), loss_of)
    per_rank = BATCH // data
    mine = slice(ctx.local_rank("data") * per_rank, (ctx.local_rank("data") + 1) * per_rank)
    losses = [float(engine.train_batch(iter([(x[mine], y[mine])]))) for x, y in batches()]
    state = full_state_dict(engine.model)
    split = sorted(type(m).__name__ for m in engine.model.modules() if type(m).__module__ == "tessera.hf.layers")
    return losses, state, keys, sorted(set(split))


LAYOUTS = {
    "tp2": (2, 1, False),
    "tp2-sequence-parallel": (2, 1, True),
    "tp4": (4, 1, False),
    "tp2xdp2-sequence-parallel": (2, 2, True),
}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_transformers_model_trains_as_in_one_process(pools, family, layout):
    tensor, data, sp = LAYOUTS[layout]
    expected_losses, expected = reference(family)
    for losses, state, keys, split in pools.run(tensor * data, train, family, tensor, data, sp, timeout=300):
        assert "ColumnParallel" in split and "RowParallel" in split and "VocabEmbedding" in split
        assert ("SequenceParallelNorm" in split) == sp
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), **TOL)
        assert set(state) == set(keys) == set(expected)
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, **TOL, msg=lambda m, key=key: key + m)


def refused(kind: str) -> str:
    layout(2)
    if kind == "heads":
        model = build("llama", num_key_value_heads=1)
    else:  # a family without a policy
        config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
        model = transformers.T5ForConditionalGeneration(config)
    try:
        tessera.initialize(model, optimizer_of(model), loss_of)
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_a_model_that_cannot_be_split_fails_at_initialize_naming_why(pools):
    heads, unknown = pools.run(2, refused, "heads")[0], pools.run(2, refused, "t5")[0]
    assert "LlamaForCausalLM" in heads and "num_key_value_heads (1) must be divisible by the tensor size (2)" in heads
    assert "data parallel, ZeRO 1-3 and Gemini" in heads
    assert "no tensor-parallel policy for the transformers model T5ForConditionalGeneration" in unknown
    assert "register_policy" in unknown and "GPT2LMHeadModel" in unknown
