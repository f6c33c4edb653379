"""tessera.inference.quantize: int8 weights with a float32 scale per output channel.

Each quantized layer computes exactly what it computes with the dequantized weight put back;
whole models stay near their fp32 logits. The bound: rounding to a step of max|w|/127 leaves a
uniform error of standard deviation step/sqrt(12), about 0.7% of a Gaussian row's spread when
its largest entry is ~3 sigma (rows of 64-512 weights), so each layer's output is off by ~0.7%
and the logits of these 2-layer models by 0.5-1.0% (measured: tessera GPT 0.90-0.93%, GPT-2
0.54-0.56%, LLaMA 0.83-0.94% over three seeds). We allow 2%, and 3% under bf16 autocast, which
alone costs ~0.4%.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

from tessera.comm.group import AxisGroup, single_rank_group
from tessera.context import ParallelContext
from tessera.context.dims import ParallelDims
from tessera.hf.grid import GridLinear
from tessera.hf.layers import ColumnParallel, RowParallel
from tessera.inference.quantize import dequantize_weight, output_dim, quantize_int8, quantize_weight
from tessera.models.gpt import gpt
from tessera.parallel.tensor.modes import MODES
from tessera.parallel.tensor.tp1d.layers import Linear1D_Col, Linear1D_Row
from tessera.parallel.tensor.tp2d.layers import Linear2D
from tessera.parallel.tensor.tp3d.layers import Linear3D

Conv1D = transformers.pytorch_utils.Conv1D

FP32_LOGITS_RTOL = 0.02
BF16_LOGITS_RTOL = 0.03


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def dequantized(layer: nn.Module, out_dim: int) -> torch.Tensor:
    """A quantized layer's weight as its forward sees it (float32)."""
    return dequantize_weight(layer.get_buffer("weight_int8"), layer.get_buffer("weight_scale"), out_dim)


def by_hand(weight: torch.Tensor, out_dim: int) -> torch.Tensor:
    """The dequantized weight, computed here from the definition."""
    w = weight.detach().float()
    keep = 1 - out_dim
    scale = w.abs().amax(dim=keep, keepdim=True) / 127
    return torch.round(w / scale).clamp(-127, 127) * scale


def test_linear_computes_with_the_dequantized_weight_exactly():
    torch.manual_seed(0)
    layer = nn.Linear(64, 48)
    expected_weight = by_hand(layer.weight, out_dim=0)
    x = torch.randn(5, 64)
    report = quantize_int8(layer)
    assert report.quantized == [""] and "weight" not in dict(layer.named_parameters())
    q, scale = layer.get_buffer("weight_int8"), layer.get_buffer("weight_scale")
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (48,)
    assert int(q.abs().amax(dim=1).min()) == 127  # every row uses the full range
    assert torch.equal(layer(x), F.linear(x, expected_weight, layer.bias))
    assert "weight" not in layer._parameters  # dropped after the call
    assert quantize_int8(layer).quantized == []  # nothing left to quantize


def test_conv1d_scales_its_output_channels_on_dim_1():
    torch.manual_seed(1)
    layer = Conv1D(48, 64)  # weight [in=64, out=48]
    expected_weight = by_hand(layer.weight, out_dim=1)
    x = torch.randn(2, 5, 64)
    quantize_int8(layer)
    assert layer.get_buffer("weight_scale").shape == (48,)
    expected = torch.addmm(layer.bias, x.view(-1, 64), expected_weight).view(2, 5, 48)  # as Conv1D.forward
    assert torch.equal(layer(x), expected)


def test_an_all_zero_channel_stays_zero():
    weight = torch.randn(4, 8)
    weight[2] = 0.0  # a padding row of an uneven tensor-parallel split
    q, scale = quantize_weight(weight, out_dim=0)
    assert not q[2].any() and torch.isfinite(scale).all()
    assert torch.equal(dequantize_weight(q, scale, 0)[2], torch.zeros(8))


def single_rank(mode: str) -> ParallelContext:
    return ParallelContext(ParallelDims(world_size=1, tensor=1, tensor_mode=mode))


def tensor_parallel_layers() -> list[tuple[str, nn.Module, torch.Tensor]]:
    """Each kind of tensor-parallel linear on a single-rank context, with an input."""
    one_d, two_d, three_d = single_rank("1d"), single_rank("2d"), single_rank("3d")
    x = torch.randn(3, 16)
    return [
        ("ColumnParallel(Conv1D)", ColumnParallel(Conv1D(24, 16), ctx=one_d, groups=3), x),
        ("RowParallel(Conv1D)", RowParallel(Conv1D(8, 16), ctx=one_d), x),
        ("RowParallel(Linear)", RowParallel(nn.Linear(16, 8), ctx=one_d), x),
        ("Linear1D_Col", Linear1D_Col(16, 8, ctx=one_d), x),
        ("Linear1D_Row", Linear1D_Row(16, 8, ctx=one_d), x),
        ("Linear2D", Linear2D(16, 8, ctx=two_d), x),
        ("Linear3D", Linear3D(16, 8, ctx=three_d), x),
        ("GridLinear(Conv1D)", GridLinear(Conv1D(24, 16), ctx=two_d, mode=MODES["2d"], groups=3), x),
    ]


@pytest.mark.parametrize("index", range(8))
def test_tensor_parallel_linears_compute_with_their_dequantized_block(index: int):
    torch.manual_seed(index)
    name, layer, x = tensor_parallel_layers()[index]
    out_dim = output_dim(layer)
    assert out_dim == (1 if "Conv1D" in name else 0), name
    reference = copy.deepcopy(layer)
    with torch.no_grad():
        reference.weight.copy_(by_hand(layer.weight, out_dim))
    assert quantize_int8(layer).quantized == [""], name
    assert torch.equal(layer(x), reference(x)), name


class FakeContext:
    """Rank ``rank`` of a 2-rank tensor group, enough to build a layer's block (not to run it)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def size(self, axis: str) -> int:
        return 2

    def local_rank(self, axis: str) -> int:
        return self.rank

    def group(self, axis: str) -> AxisGroup:
        return single_rank_group(axis)


def test_a_tensor_parallel_block_is_scaled_on_this_ranks_block():
    torch.manual_seed(2)
    conv = Conv1D(12, 8)  # weight [in=8, out=12]
    ctx: Any = FakeContext(rank=1)
    column, row = ColumnParallel(conv, ctx=ctx), RowParallel(conv, ctx=ctx)
    assert column.weight.shape == (8, 6) and row.weight.shape == (4, 12)
    column_block, row_block = column.weight.detach().clone(), row.weight.detach().clone()
    quantize_int8(column), quantize_int8(row)
    # columns 6..11 of the output; all 12 outputs over inputs 4..7 only
    assert torch.equal(column.get_buffer("weight_scale"), conv.weight[:, 6:].detach().abs().amax(dim=0) / 127)
    assert torch.equal(row.get_buffer("weight_scale"), conv.weight[4:].detach().abs().amax(dim=0) / 127)
    assert torch.equal(dequantized(column, 1), by_hand(column_block, 1))
    assert torch.equal(dequantized(row, 1), by_hand(row_block, 1))


# ---- whole models ------------------------------------------------------------------------------


def tessera_gpt() -> nn.Module:
    return gpt("tiny", n_layers=2)


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


MODELS = {"tessera_gpt": (tessera_gpt, "lm_head"), "gpt2": (gpt2, "lm_head"), "llama": (llama, None)}


@pytest.mark.parametrize("family", sorted(MODELS))
def test_models_stay_near_their_fp32_logits(family: str):
    make, tied_head = MODELS[family]
    torch.manual_seed(3)
    model = make().eval()
    ids = torch.randint(0, 256, (2, 24))
    quantized = copy.deepcopy(model)
    report = quantize_int8(quantized)
    linears = [n for n, m in model.named_modules() if output_dim(m) is not None]
    assert sorted(report.quantized) == sorted(n for n in linears if n != tied_head)
    assert report.bytes_after < 0.5 * report.bytes_before
    kept = list(quantized.parameters())
    with torch.no_grad():
        ref = logits(model, ids)
        assert relative_error(logits(quantized, ids), ref) < FP32_LOGITS_RTOL
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert relative_error(logits(quantized, ids), ref) < BF16_LOGITS_RTOL
    assert [id(p) for p in quantized.parameters()] == [id(p) for p in kept]  # no dequantized weight stays


def test_tied_weights_and_embeddings_keep_full_precision():
    model = tessera_gpt()
    report = quantize_int8(model)
    assert report.skipped["tok_emb"] == "embedding" and report.skipped["pos_emb"] == "embedding"
    assert report.skipped["lm_head"] == "weight shared with tok_emb"
    assert model.lm_head.weight is model.tok_emb.weight and model.lm_head.weight.dtype == torch.float32
    assert report.skipped["ln_f"] == "not a linear layer (LayerNorm)"


def test_skip_keeps_the_layers_it_names():
    model = llama()
    report = quantize_int8(model, skip=lambda name, module: name.endswith("mlp.down_proj"))
    assert report.skipped["model.layers.0.mlp.down_proj"] == "skip() said so"
    assert isinstance(model.model.layers[1].mlp.down_proj.weight, nn.Parameter)
    assert "lm_head" in report.quantized


def test_multihead_attention_keeps_the_projection_it_reads_itself():
    torch.manual_seed(4)
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True).eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        ref = layer(x)
        report = quantize_int8(layer)
        out = layer(x)  # the hooks turn the encoder layer's fused fast path off: linear1/2 are called
    assert sorted(report.quantized) == ["linear1", "linear2"]
    assert "reads this weight" in report.skipped["self_attn.out_proj"]
    assert relative_error(out, ref) < FP32_LOGITS_RTOL


def test_the_weight_is_dropped_even_when_the_call_fails():
    layer = nn.Linear(8, 4, bias=False)
    quantize_int8(layer)
    with pytest.raises(RuntimeError):
        layer(torch.randn(2, 5))  # wrong input width
    assert "weight" not in layer._parameters
    assert layer(torch.randn(2, 8).to(torch.bfloat16)).dtype == torch.bfloat16  # the input's dtype
