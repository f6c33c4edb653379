"""FLOPs per token, the device peak and MFU: the transformer formula against torch's
FlopCounterMode, MoE experts at their active share, the peak's cache, the data sheet table,
the MFU arithmetic and the trainer's metrics."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tessera
from tessera.engine import ThroughputHook, Trainer, UtilisationHook
from tessera.engine.flops import (
    achieved_flops_per_rank,
    counted_flops_per_token,
    flops_per_token,
    matmul_parameters,
    mfu,
    transformer_flops_per_token,
)
from tessera.engine.peak import DevicePeak, cache_file, datasheet_peak, device_peak
from tessera.models import NextTokenLoss, gpt
from tessera.testing import use_layout

TINY = {"n_layers": 2, "d_model": 64, "n_heads": 4, "max_seq_len": 64}


def test_the_formula_is_6n_plus_4f_plus_12_l_d_s():
    assert transformer_flops_per_token(1000, 2, 64, 128) == 6 * 1000 + 12 * 2 * 64 * 128
    assert transformer_flops_per_token(1000, 2, 64, 128, frozen_params=500) == 6000 + 2000 + 196608


def test_the_gpt_formula_agrees_with_flopcountermode_and_the_difference_is_explained():
    """The formula and torch's count differ by two known terms: 6 FLOPs per element of the norms
    and biases (in N, but elementwise work the counter does not count) and the backward's
    recomputed attention scores (2 L d s: torch counts five products in the attention backward,
    the formula four). Embedding lookups, softmax and the loss are in neither."""
    use_layout(config={})
    torch.manual_seed(0)
    model = gpt("tiny", **TINY)
    seq = 64
    inputs, targets = torch.randint(0, 256, (2, seq)), torch.randint(0, 256, (2, seq))
    formula = flops_per_token(model, seq)
    counted = counted_flops_per_token(model, inputs, lambda out: NextTokenLoss()(out, targets))
    elementwise = sum(p.numel() for name, p in model.named_parameters() if "pos_emb" not in name and p.dim() < 2)
    layers, width = TINY["n_layers"], TINY["d_model"]
    assert formula - counted == 6 * elementwise - 2 * layers * width * seq
    assert abs(formula - counted) / counted < 0.02  # the margin at this size: 0.7%
    assert all(p.grad is None for p in model.parameters()), "counting leaves .grad alone"


def test_tied_and_untied_embeddings_count_the_heads_product_once():
    tied, untied = gpt("tiny", **TINY), gpt("tiny", **TINY, tie_weights=False)
    head = 256 * TINY["d_model"]
    pos = TINY["max_seq_len"] * TINY["d_model"]
    assert matmul_parameters(tied, [tied.pos_emb.weight]).trained == tied.num_parameters() - pos
    # untied: the token embedding is a lookup, the head a product of the same size
    assert untied.flops_per_token(32) == tied.flops_per_token(32)
    assert untied.num_parameters() == tied.num_parameters() + head


def test_moe_experts_count_top_k_of_num_experts():
    d, ff, experts, top_k = 32, 48, 8, 2
    model = gpt("tiny-moe", n_layers=2, d_model=d, n_heads=4, d_ff=ff, num_experts=experts, moe_top_k=top_k)
    dense = gpt("tiny", n_layers=2, d_model=d, n_heads=4, d_ff=ff)  # the same but one plain MLP per block
    expert_params = 3 * d * ff  # a SwiGLU expert: w_in, w_gate, w_out
    router = d * experts
    dense_mlp = 2 * d * ff + ff + d  # fc1 and fc2 with biases
    per_block = top_k * expert_params + router - dense_mlp
    lookups = [model.pos_emb.weight]
    assert matmul_parameters(model, lookups).trained == (
        matmul_parameters(dense, [dense.pos_emb.weight]).trained + 2 * per_block
    )
    full = sum(p.numel() for m in model.modules() if isinstance(m, tessera.nn.MoE) for p in m.experts.parameters())
    assert full == 2 * experts * expert_params  # all of them are held; a token meets top_k
    assert model.flops_per_token(16) == transformer_flops_per_token(matmul_parameters(model, lookups).trained, 2, d, 16)


def test_frozen_parameters_count_four_flops_not_six():
    model = gpt("tiny", **TINY)
    trained = matmul_parameters(model, [model.pos_emb.weight]).trained
    for block in model.blocks:
        block.requires_grad_(False)
    counts = matmul_parameters(model, [model.pos_emb.weight])
    assert counts.trained + counts.frozen == trained and counts.frozen > 0
    assert model.flops_per_token(32) == 6 * counts.trained + 4 * counts.frozen + 12 * 2 * 64 * 32


def test_any_other_model_is_counted_from_an_example_batch():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    state = torch.get_rng_state()
    # forward 2 x (16x32 + 32x4) per row; backward: both weight gradients, the second layer's input gradient
    assert flops_per_token(mlp, 1, example_inputs=x) == 2 * (16 * 32 + 32 * 4) + 2 * (16 * 32 + 32 * 4) + 2 * 32 * 4
    assert torch.equal(torch.get_rng_state(), state)
    with pytest.raises(ValueError, match="pass example_inputs="):
        flops_per_token(mlp, 1)


def test_the_peak_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    tiny = {"sizes": (16,), "seconds": 0.001}
    first = device_peak("cpu", "fp32", **tiny)
    assert first.source == "measured" and first.flops_per_s > 0 and first.dtype == "fp32"
    assert cache_file() == tmp_path / "tessera" / "peak_flops.json"
    second = device_peak("cpu", "fp32", **tiny)
    assert second.source == "cached" and second.flops_per_s == first.flops_per_s
    (key,) = json.loads(cache_file().read_text())
    assert f"torch {torch.__version__}" in key and "fp32" in key and f"{torch.get_num_threads()} threads" in key
    assert device_peak("cpu", "bf16", **tiny).source == "measured", "another dtype is another key"
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert device_peak("cpu", "fp32", **tiny).source == "measured", "other threads, another key"
    finally:
        torch.set_num_threads(threads)
    assert len(json.loads(cache_file().read_text())) == 3
    assert device_peak("cpu", "fp32", **tiny, use_cache=False).source == "measured"


def test_a_broken_cache_file_is_measured_over(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache_file().parent.mkdir(parents=True)
    cache_file().write_text("{not json")
    assert device_peak("cpu", "fp32", sizes=(16,), seconds=0.001).source == "measured"
    assert len(json.loads(cache_file().read_text())) == 1


@pytest.mark.parametrize(
    ("name", "dtype", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H100 NVL", "tf32", 417.5),
        ("NVIDIA H200", "bf16", 989.4),
        ("NVIDIA GH200 480GB", "fp32", 67.0),
        ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),
        ("NVIDIA A100 80GB PCIe", "tf32", 156.0),
        ("NVIDIA L40S", "bf16", 362.05),
        ("NVIDIA L40", "bf16", 181.05),
        ("NVIDIA L4", "bf16", 121.0),
        ("NVIDIA A10", "bf16", 125.0),
        ("Tesla V100-SXM2-16GB", "fp16", 125.0),
        ("Tesla V100-PCIE-32GB", "fp16", 112.0),
        ("Tesla T4", "fp32", 8.1),
        ("AMD Instinct MI300X", "bf16", 1307.4),
    ],
)
def test_the_data_sheet_table_finds_devices_by_their_cuda_names(name, dtype, tflops):
    assert datasheet_peak(name, dtype) == pytest.approx(tflops * 1e12)


def test_devices_and_dtypes_the_table_does_not_list_are_none():
    assert datasheet_peak("NVIDIA A10G", "bf16") is None  # no published data sheet: measured
    assert datasheet_peak("NVIDIA GeForce RTX 4090", "bf16") is None
    assert datasheet_peak("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 on Volta


def test_mfu_is_the_global_rate_shared_over_the_ranks_over_one_ranks_peak():
    # 4 ranks, the global batch at 1,000 tokens/s, 6 MFLOPs a token: 1.5 GFLOP/s per rank
    assert achieved_flops_per_rank(1000.0, 6e6, 4) == 1.5e9
    assert mfu(1000.0, 6e6, 4, 3e9) == 0.5
    assert mfu(1000.0, 6e6, 1, 3e9) == 2.0  # one rank doing it all would be past its peak


def test_a_short_trainer_run_reports_flops_per_token_and_mfu(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cached = device_peak("cpu", "fp32", sizes=(16,), seconds=0.001)  # what the hook will read
    use_layout(config={})
    torch.manual_seed(0)
    seq = 16
    model = gpt("tiny", n_layers=1, d_model=32, n_heads=2, max_seq_len=seq)
    per_token = model.flops_per_token(seq)
    tokens = torch.randint(0, 256, (8, seq + 1))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    engine, loader, _, _ = tessera.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), NextTokenLoss(), loader
    )
    given = DevicePeak(1e9, "fp32", "measured", "a stand-in")
    hooks = [ThroughputHook(tokens_per_sample=seq), UtilisationHook(per_token, given), UtilisationHook(per_token)]
    history = Trainer(engine, hooks).fit(loader, steps=2)
    assert hooks[2].peak == DevicePeak(cached.flops_per_s, "fp32", "cached", cached.device)  # found at the start
    for step in history:  # the last hook's numbers: against the cached peak
        assert step["flops_per_token"] == per_token
        assert step["tflops_per_rank"] == pytest.approx(step["tokens_per_s"] * per_token / 1e12)
        assert step["mfu"] == pytest.approx(step["tokens_per_s"] * per_token / cached.flops_per_s)
        assert step["mfu"] > 0
