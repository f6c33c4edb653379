"""A ModelSpec measured from a module (tessera.planner.traced.from_module): its sizes equal the
ones its preset or its Hugging Face config give, it counts the module's parameters exactly, and
its traced activation bytes per block equal the saved tensors' and replace the formula's in the
memory model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from tessera.errors import ConfigError
from tessera.planner import Layout, Workload
from tessera.planner.memory import block_activation_elements, predict_memory
from tessera.planner.spec import from_gpt_preset, from_hf_config
from tessera.planner.traced import from_module

SHAPE_FIELDS = ("n_layers", "d_model", "n_heads", "n_kv_heads", "ff_dim", "vocab_size", "gated_mlp", "norm",
                "biases", "tie_weights", "learned_positions", "max_positions", "family")  # fmt: skip


def same_shape(a, b) -> None:
    for name in SHAPE_FIELDS:
        assert getattr(a, name) == getattr(b, name), name


def test_tesseras_gpt_reads_as_its_preset_and_traces_the_formulas_bytes():
    from tessera.models import gpt

    torch.manual_seed(0)
    module = gpt("small", max_seq_len=64)
    spec = from_module(module, torch.randint(0, 256, (2, 64)))
    same_shape(spec, from_gpt_preset("small", seq_len=64, max_seq_len=64))
    assert spec.seq_len == 64
    assert spec.num_parameters() == sum(p.numel() for p in module.parameters())
    formula = block_activation_elements(spec, Layout(), 64) * 4
    assert spec.traced_block_bytes_per_token == pytest.approx(formula, rel=0.03)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hugging_face_models_read_as_their_configs(kind):
    import transformers

    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                          num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    else:
        config = transformers.GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=128)
    torch.manual_seed(0)
    module = transformers.AutoModelForCausalLM.from_config(config)
    spec = from_module(module, torch.randint(0, 512, (2, 32)))
    same_shape(spec, from_hf_config(config.to_dict(), seq_len=32))
    assert spec.num_parameters() == sum(p.numel() for p in module.parameters())
    assert spec.traced_block_bytes_per_token > 0


def test_the_traced_bytes_replace_the_formula_in_the_memory_model():
    """GPT-2's eager attention keeps its probabilities and dropout masks, which the formula of
    tessera's GPT does not count: the traced spec's activations are its own bytes per token."""
    import transformers

    config = transformers.GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=32)
    module = transformers.AutoModelForCausalLM.from_config(config)
    traced = from_module(module, torch.randint(0, 512, (2, 32)))
    described = dataclasses.replace(traced, traced_block_bytes_per_token=None)
    formula = block_activation_elements(described, Layout(), 32) * 4
    assert traced.traced_block_bytes_per_token > 1.5 * formula  # the probabilities (heads x seq per token) and more
    w, layout = Workload(global_batch=4), Layout(micro_batch=4)
    extra = predict_memory(traced, layout, w).activations - predict_memory(described, layout, w).activations
    assert extra == pytest.approx(2 * 4 * 32 * (traced.traced_block_bytes_per_token - formula), rel=1e-6)


def test_what_is_not_a_transformer_is_refused():
    with pytest.raises(ConfigError, match="no transformer blocks"):
        from_module(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), torch.randn(2, 4, 8))
    blocks = nn.Sequential(nn.Embedding(16, 8), nn.ModuleList([nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8))]))
    with pytest.raises(ConfigError, match="no MLP"):
        from_module(blocks, torch.randint(0, 16, (2, 4)))
