"""LoRA adapters on MoE experts in one process: each expert's projections get their own adapter,
computed as PEFT computes a LoRA ``nn.Linear`` (``W x + B A x * alpha / r``), expert by expert;
the stacked experts stay frozen, and the adapters switch off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tessera.lora
from tessera.errors import ConfigError
from tessera.lora.experts import LoraExperts
from tessera.nn.moe import GroupedExperts, MoE

RANK, ALPHA = 2, 6.0


def reference(experts: LoraExperts, x: torch.Tensor) -> torch.Tensor:
    """Each expert as three LoRA linears, written from the definition, one expert at a time."""
    base, scaling = experts.base_layer, ALPHA / RANK

    def lora(name: str, e: int, h: torch.Tensor) -> torch.Tensor:
        a, b = experts.lora_A[name].weight[e], experts.lora_B[name].weight[e]  # nn.Linear weights
        return h @ getattr(base, name)[e] + F.linear(F.linear(h, a), b) * scaling

    out = []
    for e in range(x.shape[0]):
        hidden = F.silu(lora("w_gate", e, x[e])) * lora("w_in", e, x[e])
        out.append(lora("w_out", e, hidden))
    return torch.stack(out)


def test_each_expert_computes_its_own_lora_linears():
    torch.manual_seed(0)
    experts = LoraExperts(GroupedExperts(3, 8, 12, "swiglu"), RANK, ALPHA).double()  # float64: no rounding noise
    assert experts.lora_A["w_in"].weight.shape == (3, RANK, 8) and experts.lora_B["w_out"].weight.shape == (3, 8, RANK)
    with torch.no_grad():
        for factor in [*experts.lora_A.values(), *experts.lora_B.values()]:
            factor.weight.normal_()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    torch.testing.assert_close(experts(x), reference(experts, x))
    experts(x).square().sum().backward()
    assert all(p.grad is None for p in experts.base_layer.parameters()), "the stacked experts are frozen"
    assert all(f.weight.grad is not None for f in [*experts.lora_A.values(), *experts.lora_B.values()])


def test_apply_adapts_the_experts_of_an_moe_and_disabled_switches_them_off():
    torch.manual_seed(0)
    moe = MoE(8, 12, 4, top_k=2, activation="gelu")
    x = torch.randn(6, 8)
    before = moe(x)
    tessera.lora.apply(moe, rank=RANK, alpha=ALPHA, targets=("experts",))
    assert isinstance(moe.experts, LoraExperts) and list(moe.experts.lora_A) == ["w_in", "w_out"]
    torch.testing.assert_close(moe(x), before)  # B starts at zero: the model starts unchanged
    with torch.no_grad():
        moe.experts.lora_B["w_out"].weight.fill_(0.5)
    assert not torch.allclose(moe(x), before)
    with tessera.lora.disabled(moe):
        torch.testing.assert_close(moe(x), before)
    assert [n for n, p in moe.named_parameters() if p.requires_grad] == [
        "experts.lora_A.w_in.weight", "experts.lora_A.w_out.weight",
        "experts.lora_B.w_in.weight", "experts.lora_B.w_out.weight",
    ]  # fmt: skip


def test_a_rank_larger_than_the_experts_is_refused_naming_them():
    with pytest.raises(ConfigError, match=r"experts: lora.rank=9 must be between 1 and the experts' smaller"):
        tessera.lora.apply(MoE(8, 12, 4), rank=9, targets=("experts",))


def small_moe_gpt() -> torch.nn.Module:
    from tessera.models import gpt

    torch.manual_seed(0)
    return gpt("tiny-moe", vocab_size=32, max_seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ff=16, num_experts=4)


def test_adapted_experts_save_load_and_merge_into_the_plain_model(tmp_path):
    from tessera.hf.adapters import load_adapters, merged_state_dict, save_adapters

    model = tessera.lora.apply(small_moe_gpt(), rank=RANK, alpha=ALPHA, targets=("qkv", "experts"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.normal_(std=0.2)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(tokens)
    save_adapters(model, tmp_path / "adapter")
    loaded = load_adapters(small_moe_gpt(), tmp_path / "adapter")
    assert isinstance(loaded.get_submodule("blocks.1.mlp.experts"), LoraExperts)
    plain = small_moe_gpt()
    plain.load_state_dict(merged_state_dict(model))  # strict: the plain model's keys exactly
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), expected)
        torch.testing.assert_close(plain(tokens), expected, rtol=1e-5, atol=1e-5)
