"""LoRA adapters in the `tessera rlhf` configs: a `lora` section on every trained model; a policy
or actor with adapters takes its own base, adapters off, as its reference (no model of its own),
and a reference configured otherwise is refused; the layouts and targets adapters cannot take
are refused before any process starts; a value model's head trains whole beside them."""

from __future__ import annotations

import pytest
import torch

from tessera import lora
from tessera.config.schema import LoraConfig
from tessera.errors import ConfigError
from tessera.hf.adapters import read_adapters
from tessera.lora.quant import QuantizedLinear
from tessera.models import gpt
from tessera.rlhf import AdaptersOff, value_model
from tessera.rlhf_pipeline import load_stage_config, plan_stage
from tessera.rlhf_pipeline.build import put_adapters
from tests.unit.test_rlhf_pipeline import TINY, ppo, refused, stage_folder


def test_every_trained_model_has_a_lora_section_and_frozen_models_none():
    cfg = load_stage_config("dpo", {}, ["policy.lora.rank=8", 'policy.lora.targets=["qkv"]'])
    assert cfg.policy.lora == LoraConfig(rank=8, targets=["qkv"])  # type: ignore[attr-defined]
    for stage, key in (("sft", "policy"), ("rm", "reward_model"), ("ppo", "actor"), ("ppo", "critic")):
        cfg = load_stage_config(
            stage, {"reward": {"rule": "sorting"}} if stage == "ppo" else {}, [f"{key}.lora.rank=4"]
        )
        assert getattr(cfg, key).lora.rank == 4
    with pytest.raises(ConfigError, match=r"unknown config key 'reference.lora'"):
        load_stage_config("ppo", {"reward": {"rule": "sorting"}, "reference": {"lora": {"rank": 4}}})
    with pytest.raises(ConfigError, match=r"^policy.lora.rank=-1 must be >= 0"):
        load_stage_config("sft", {}, ["policy.lora.rank=-1"])
    quantized = ["actor.lora.rank=4", "actor.lora.quantize=nf4"]
    assert load_stage_config("grpo", {"reward": {"rule": "sorting"}}, quantized).actor.lora.quantize == "nf4"  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match=r"^actor.lora.quantize='nf4': a quantized base cannot be split by tensor"):
        load_stage_config("grpo", {"reward": {"rule": "sorting"}, "actor": {"parallel": {"tensor": 2}}}, quantized)


def test_a_dpo_policy_with_adapters_is_its_own_reference(tmp_path):
    sft = str(stage_folder(tmp_path / "sft"))
    config = {"policy": {"init": sft, "lora": {"rank": 4}}, "train": {"batch_size": 8}}
    plans = plan_stage("dpo", load_stage_config("dpo", config), 2)
    assert list(plans) == ["policy", "reference"]
    policy, reference = plans["policy"], plans["reference"]
    assert reference.base_of == "policy" and reference.lora is None and reference.optimizer is None
    assert reference.ranks == policy.ranks and reference.weights == policy.weights
    assert "LoRA rank 4 on all-linear" in policy.describe()
    assert (
        reference.describe()
        == "reference: the policy's frozen base with its LoRA adapters off (ranks [0, 1]; no copy of its own)"
    )
    # the policy's own starting weights, named again, are that base; other weights are refused
    plans = plan_stage("dpo", load_stage_config("dpo", {**config, "reference": {"init": sft}}), 2)
    assert plans["reference"].base_of == "policy"
    other = str(stage_folder(tmp_path / "other"))
    message = refused("dpo", {**config, "reference": {"init": other}})
    assert message.startswith(f"reference.init={other!r}: with policy.lora the reference is the policy's frozen base")
    assert "policy.lora.rank=0" in message
    assert "reference" not in plan_stage(
        "dpo", load_stage_config("dpo", {**config, "dpo": {"reference_free": True}}), 2
    )
    # without adapters the reference is a model of its own
    assert plan_stage("dpo", load_stage_config("dpo", {"policy": {"init": sft}}), 1)["reference"].base_of is None


def test_an_actor_with_adapters_is_its_own_reference_on_its_ranks(tmp_path):
    adapters = {"lora": {"rank": 4}}
    plans = plan_stage("ppo", load_stage_config("ppo", ppo(tmp_path, actor=adapters, reference={"ranks": None})), 2)
    assert plans["reference"].base_of == "actor" and plans["reference"].ranks == (0,)
    for reference in ({"ranks": [1]}, {"zero": {"stage": 3}}):
        message = refused("ppo", ppo(tmp_path, actor=adapters, reference=reference))
        assert message.startswith(
            "reference: with actor.lora the reference runs on the actor's ranks, under its layout"
        )
    grpo = {"actor": {"lora": {"rank": 4}}, "reward": {"rule": "sorting"}, "train": {"batch_size": 4}}
    assert plan_stage("grpo", load_stage_config("grpo", grpo), 1)["reference"].base_of == "actor"
    assert "reference" not in plan_stage("grpo", load_stage_config("grpo", grpo, ["grpo.beta=0"]), 1)
    # a critic with adapters leaves the reference as it was
    plans = plan_stage("ppo", load_stage_config("ppo", ppo(tmp_path, critic=adapters)), 2)
    assert plans["critic"].lora is not None and plans["reference"].base_of is None


def test_layouts_and_targets_adapters_cannot_take_are_refused(tmp_path):
    message = refused("sft", {"policy": {"parallel": {"tensor": 2}, "lora": {"rank": 4}}})
    assert message.startswith("policy.lora: adapters on tessera's GPT do not yet follow tensor parallelism")
    assert "or an hf: model" in message
    message = refused("ppo", ppo(tmp_path, critic={"ranks": [0, 1], "parallel": {"tensor": 2}, "lora": {"rank": 4}}))
    assert message.startswith("critic.lora: adapters on a value model do not yet follow tensor parallelism")
    message = refused("rm", {"reward_model": {"lora": {"rank": 4, "targets": ["qkv", "score"]}}}, world=1)
    assert message.startswith("reward_model.lora.targets names 'score': a value model's head trains whole")


def test_a_value_models_head_trains_whole_beside_its_adapters():
    torch.manual_seed(0)
    model = value_model(gpt("tiny", **TINY))
    put_adapters(model, LoraConfig(rank=2), value=True)
    adapted = {name for name, _ in lora.adapters(model)}
    assert adapted == {n.removesuffix(".base_layer") for n in lora.linear_layers(model) if n.endswith(".base_layer")}
    assert "score" not in adapted and isinstance(model.score, torch.nn.Linear)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained == {"score.weight", "score.bias"} | {f"{n}.lora_{f}.weight" for n in adapted for f in "AB"}
    causal = gpt("tiny", **TINY)
    put_adapters(causal, LoraConfig(rank=2, targets=["qkv"], quantize="nf4"), value=False)
    assert all(isinstance(layer.base_layer, QuantizedLinear) for _, layer in lora.adapters(causal))


def test_the_adapters_off_reference_is_the_base_and_leaves_the_policy_as_it_was():
    torch.manual_seed(0)
    base = gpt("tiny", **TINY)
    policy = gpt("tiny", **TINY)
    policy.load_state_dict(base.state_dict())
    lora.apply(policy, rank=2, init="gaussian")
    for _, layer in lora.adapters(policy):
        torch.nn.init.normal_(layer.lora_B.weight)
    ids = torch.randint(0, 256, (2, 8))
    reference = AdaptersOff(policy)
    base.eval()
    torch.testing.assert_close(reference(ids), base(ids), rtol=0, atol=0)
    assert policy.training and all(layer.enabled for _, layer in lora.adapters(policy))
    assert not torch.allclose(policy(ids), base(ids))
    with pytest.raises(ConfigError, match=r"the policy has no LoRA adapters"):
        AdaptersOff(base)


def test_a_target_or_rank_the_model_lacks_is_refused_naming_the_model():
    from tessera.rlhf_pipeline.build import Built
    from tessera.testing import use_layout

    use_layout(config={})
    for lora_section, message in (({"targets": ["q_proj"]}, r"^policy: lora.targets \['q_proj'\] match no linear layer"),
                                  ({"rank": 64}, r"^policy: blocks.0.attn.qkv: lora.rank=64 must be between 1 and")):  # fmt: skip
        config = {"model": {"options": TINY}, "policy": {"lora": {"rank": 4, **lora_section}}}
        plans = plan_stage("sft", load_stage_config("sft", config), 1)
        with pytest.raises(ConfigError, match=message):
            Built(plans).module("policy")


def test_a_stage_on_a_quantized_base_writes_its_adapters_merged_into_full_weights(tmp_path):
    from tessera.checkpoint import load_full_state_dict, load_weights
    from tessera.rlhf_pipeline import run_stage
    from tessera.testing import use_layout

    use_layout(config={})
    sft = stage_folder(tmp_path / "sft")
    policy = {"init": str(sft), "lora": {"rank": 2, "quantize": "nf4"}, "optimizer": {"lr": 1e-2}}
    config = {"policy": policy, "train": {"steps": 2, "batch_size": 2}, "data": {"eval": None}}
    run_stage("dpo", load_stage_config("dpo", config), tmp_path / "dpo")
    merged, start = load_weights(tmp_path / "dpo" / "model.safetensors"), load_weights(sft / "model.safetensors")
    load_full_state_dict(gpt("tiny", **TINY), merged)  # a plain GPT's keys and shapes: the next stage's init
    _, adapters = read_adapters(tmp_path / "dpo" / "adapter")
    for name in ("blocks.0.attn.qkv", "blocks.0.mlp.fc"):  # the start's NF4 dequantization plus B A alpha / r
        base = torch.nn.Linear(*reversed(start[f"{name}.weight"].shape))
        base.weight.data.copy_(start[f"{name}.weight"])
        delta = adapters[f"{name}.lora_B.weight"] @ adapters[f"{name}.lora_A.weight"] * (16.0 / 2)
        assert float(delta.abs().max()) > 0  # the adapters trained
        expected = QuantizedLinear(base, "nf4").weight_value() + delta
        torch.testing.assert_close(merged[f"{name}.weight"], expected, rtol=1e-6, atol=1e-6)
