"""LoRA in the planner (tessera.planner.adapters): its trainable, frozen and quantized counts equal
formulas written here and what ``tessera.lora.apply`` (+ ``quantize``) makes of the built model;
the memory model charges the frozen base its weights only; the search and ``tessera plan`` see it."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tessera.cli import main
from tessera.config import load_config
from tessera.errors import ConfigError
from tessera.lora import apply
from tessera.lora.quant import QuantizedLinear, quantize
from tessera.planner import Layout, Workload, estimate
from tessera.planner.adapters import (
    Adapters,
    frozen_bytes,
    frozen_parameters,
    quantized_bytes,
    trainable_parameters,
)
from tessera.planner.memory import predict_memory
from tessera.planner.scenarios import HARDWARE
from tessera.planner.search import layout_problems, plan
from tessera.planner.spec import from_gpt_preset, from_hf_config, resolve_model
from tessera.planner.timing import step_traffic

R = 4
# h 48, 4 heads of 12, 2 key/value heads (kv 24), ff 130: NF4 blocks that end part-way (48 x 130 / 64)
LLAMA = dict(vocab_size=96, hidden_size=48, intermediate_size=130, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip


def llama_model():
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**LLAMA))


def llama_spec(**adapters):
    import transformers

    spec = from_hf_config(transformers.LlamaConfig(**LLAMA).to_dict(), seq_len=32)
    return dataclasses.replace(spec, adapters=Adapters(R, **adapters))


def measured(model):
    """(trainable elements, frozen elements, frozen bytes as stored) of a model after apply."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    codes = [b for m in model.modules() if isinstance(m, QuantizedLinear) for b in m.buffers()]
    stored = sum(t.numel() * t.element_size() for t in frozen + codes)
    quantized_weights = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, QuantizedLinear))
    return trainable, sum(p.numel() for p in frozen) + quantized_weights, stored


def layer_bytes(out: int, inp: int, fmt: str, double_quant: bool) -> int:
    """The stored bytes of one quantized [out, in] weight, from the formats' definitions."""
    n = out * inp
    if fmt == "int8":
        return n * 1 + out * 4  # a byte a weight, an fp32 scale per output row
    absmax = -(-n // 64)
    if not double_quant:
        return -(-n // 2) + absmax * 4  # two weights a byte, an fp32 absmax per 64
    return -(-n // 2) + absmax * 1 + -(-absmax // 256) * 4 + 4  # int8 absmaxes, fp32 per 256, the mean


def test_llama_counts_equal_the_formula_and_the_adapted_model():
    h, kv, ff, layers = 48, 24, 130, 2
    spec = llama_spec(targets=("q_proj", "v_proj", "down_proj"))
    adapters = layers * R * ((h + h) + (h + kv) + (ff + h))
    assert trainable_parameters(spec) == adapters
    model = apply(llama_model(), rank=R, targets=("q_proj", "v_proj", "down_proj"))
    trainable, frozen, stored = measured(model)
    assert trainable == adapters
    assert frozen == frozen_parameters(spec) == spec.num_parameters()
    assert frozen_bytes(spec) == stored == 4 * spec.num_parameters()


@pytest.mark.parametrize(("fmt", "double_quant"), [("int8", False), ("nf4", False), ("nf4", True)])
def test_quantized_base_bytes_equal_the_formats_and_the_quantized_model(fmt, double_quant):
    h, kv, ff, layers = 48, 24, 130, 2
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    spec = llama_spec(quantize=fmt, double_quant=double_quant)  # all-linear: every block layer
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (ff, h), (ff, h), (h, ff)]  # [out, in]
    codes = layers * sum(layer_bytes(o, i, fmt, double_quant) for o, i in shapes)
    rest = spec.num_parameters() - layers * sum(o * i for o, i in shapes)
    assert frozen_bytes(spec) == 4 * rest + codes
    assert all(quantized_bytes(o, i, fmt, double_quant) == layer_bytes(o, i, fmt, double_quant) for o, i in shapes)
    model = quantize(apply(llama_model(), rank=R, targets=targets), fmt, double_quant=double_quant)
    trainable, frozen, stored = measured(model)
    assert (trainable, frozen, stored) == (trainable_parameters(spec), frozen_parameters(spec), frozen_bytes(spec))
    assert trainable == layers * R * sum(o + i for o, i in shapes)


def test_tesseras_gpt_with_a_saved_module_and_gpt2s_fused_layers():
    from tessera.models import gpt

    spec = dataclasses.replace(from_gpt_preset("tiny"), adapters=Adapters(R, ("qkv", "proj"), ("ln_f",)))
    h, ff = spec.d_model, spec.ff_dim
    assert trainable_parameters(spec) == spec.n_layers * R * ((h + 3 * h) + (ff + h)) + 2 * h  # ln_f: weight, bias
    model = apply(gpt("tiny"), rank=R, targets=("qkv", "proj"), modules_to_save=("ln_f",))
    trainable, frozen, stored = measured(model)
    assert (trainable, frozen, stored) == (trainable_parameters(spec), frozen_parameters(spec), frozen_bytes(spec))

    import transformers

    config = transformers.GPT2Config(vocab_size=96, n_embd=48, n_layer=2, n_head=4, n_positions=64)
    spec = dataclasses.replace(from_hf_config(config.to_dict()), adapters=Adapters(R, ("c_attn", "c_proj")))
    model = apply(transformers.AutoModelForCausalLM.from_config(config), rank=R, targets=("c_attn", "c_proj"))
    trainable, frozen, _ = measured(model)
    assert trainable == trainable_parameters(spec) == 2 * R * ((48 + 144) + (48 + 48) + (192 + 48))
    assert frozen == frozen_parameters(spec)


def test_targets_the_model_does_not_have_are_refused_as_apply_refuses_them():
    with pytest.raises(ConfigError, match="match no linear layer"):
        trainable_parameters(llama_spec(targets=("c_attn",)))
    with pytest.raises(ConfigError, match="output head"):
        trainable_parameters(llama_spec(targets=("q_proj", "lm_head")))
    with pytest.raises(ConfigError, match="adapt the blocks differently"):
        trainable_parameters(llama_spec(targets=("layers.0.self_attn.q_proj",)))


def test_model_states_drop_by_the_frozen_weights_gradients_masters_and_moments():
    """Per rank, LoRA holds the frozen base's weights only: against full fine-tuning the states
    lose the frozen weights' gradients and optimizer states (fp32: 4 + 8 bytes; ZeRO-3 in bf16:
    2 + 12 over the data ranks) and ZeRO-3 shards the frozen base over the data ranks too."""
    full = resolve_model("llama:7b")
    lora = dataclasses.replace(full, adapters=Adapters(16))
    p, a = full.num_parameters(), trainable_parameters(lora)
    w = Workload(global_batch=8, seq_len=1024, dtype="fp32")
    layout = Layout(micro_batch=1, microbatches=8, checkpoint="full")
    f, m = predict_memory(full, layout, w), predict_memory(lora, layout, w)
    assert (f.parameters, f.gradients, f.optimizer_states) == (4 * p, 4 * p, 8 * p)
    assert (m.parameters, m.frozen, m.gradients, m.optimizer_states) == (4 * a, 4 * p, 4 * a, 8 * a)
    assert m.model_states == f.model_states - (4 + 8) * p + (4 + 4 + 8) * a
    assert m.peak < f.peak - (4 + 8) * p + (4 + 4 + 8) * a + 2**30  # + activations' and temporaries' change

    bf16, n = Workload(global_batch=8, seq_len=1024, dtype="bf16"), 8
    z3 = Layout(data=n, zero=3, micro_batch=1, checkpoint="full")
    f, m = predict_memory(full, z3, bf16), predict_memory(lora, z3, bf16)
    assert (f.parameters, f.optimizer_states) == (2 * p // n, 12 * p // n)
    assert (m.parameters, m.frozen, m.gradients, m.optimizer_states) == (
        2 * a // n,
        4 * p // n,
        2 * a // n,
        12 * a // n,
    )
    assert m.peak < f.peak  # the frozen base in fp32 chunks of its own, sharded as the trained parameters


def test_adapters_add_their_r_wide_activations():
    spec = llama_spec()  # all-linear: seven adapted layers a block
    w, layout = Workload(global_batch=2, dtype="fp32"), Layout(micro_batch=2)
    base = dataclasses.replace(spec, adapters=None)
    extra = predict_memory(spec, layout, w).activations - predict_memory(base, layout, w).activations
    assert extra == spec.n_layers * 2 * 32 * 4 * (7 * R)  # blocks x tokens x fp32 x r per adapted layer


def test_a_layout_over_memory_for_full_fine_tuning_fits_with_lora():
    full = resolve_model("llama:7b", seq_len=1024)
    lora = dataclasses.replace(full, adapters=Adapters(16, quantize="nf4"))
    cluster = HARDWARE["a100-80gb"].cluster(1, device_memory=24 * 2**30)
    w = Workload(global_batch=8, seq_len=1024, dtype="bf16")
    layout = Layout(micro_batch=1, microbatches=8, checkpoint="full")
    assert not estimate(full, layout, w, cluster).fits and estimate(lora, layout, w, cluster).fits
    with pytest.raises(ConfigError, match="over"):
        plan(full, cluster, w).best  # noqa: B018 (nothing fits: the error)
    assert plan(lora, cluster, w).best.fits


def test_a_quantized_base_is_planned_without_tensor_parallelism():
    spec = dataclasses.replace(resolve_model("llama:7b"), adapters=Adapters(16, quantize="int8"))
    w = Workload(global_batch=8, dtype="bf16")
    assert any("quantized frozen base" in p for p in layout_problems(spec, Layout(data=4, tensor=2), w))
    cluster = HARDWARE["a100-80gb"].cluster(8)
    assert all(e.layout.tensor == 1 for e in plan(spec, cluster, w, top=50).ranked)


def test_the_data_axis_averages_the_adapters_gradients_only():
    spec = llama_spec(targets=("q_proj", "v_proj"))
    w = Workload(global_batch=4, dtype="fp32")
    traffic = step_traffic(spec, Layout(data=2, micro_batch=2), w)[("all_reduce", "data")]
    assert traffic.bytes == 2 * (2 - 1) / 2 * (trainable_parameters(spec) * 4 + 4)  # ring all-reduce, + the loss


def test_tessera_plan_prints_trainable_frozen_and_quantized_bytes(tmp_path, capsys):
    argv = ["plan", "--model", "llama:7b", "--devices", "1", "--device-memory", "24GiB", "--global-batch", "8",
            "--seq-len", "1024", "--top", "3"]  # fmt: skip
    assert main(argv) == 2  # full fine-tuning: nothing fits
    assert "GiB over" in capsys.readouterr().err
    out = tmp_path / "best.toml"
    code = main([*argv, "--set", "lora.rank=16", "--set", "lora.quantize=nf4", "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    spec = dataclasses.replace(resolve_model("llama:7b"), adapters=Adapters(16, quantize="nf4"))
    line = next(line for line in printed.out.splitlines() if line.startswith("lora: rank 16"))
    assert f"trainable {trainable_parameters(spec) / 1e6:,.2f}M parameters" in line
    assert f"frozen {frozen_parameters(spec) / 1e9:,.2f}B parameters, {frozen_bytes(spec) / 2**30:,.2f} GiB" in line
    assert "quantized base 6.48B weights in nf4" in line
    assert "model states per rank: trainable" in printed.out and "frozen base" in printed.out
    config = load_config(out)
    assert (config.lora.rank, config.lora.quantize) == (16, "nf4")
    assert math.isclose(frozen_bytes(spec) / frozen_parameters(spec), 0.65, abs_tol=0.05)  # NF4 and fp32 rest


def test_parallel_auto_plans_for_the_configs_adapters():
    from tessera.config.auto import model_spec

    config = load_config(None, ["model.preset=tiny", "lora.rank=8", 'lora.targets=["qkv"]', "lora.dropout=0.1"])
    assert model_spec(config).adapters == Adapters(8, ("qkv",), dropout=0.1)
    assert model_spec(load_config(None, ["model.preset=tiny"])).adapters is None
