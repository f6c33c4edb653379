"""`tessera rlhf` stages with LoRA adapters, run as each rank runs them (``run_stage``, 2 ranks):
SFT trains adapters and writes them merged; DPO starts from that folder, trains adapters of its
own under ZeRO-2 with gradient accumulation, and builds no reference model (its reference is the
policy's base with the adapters off). Its losses and adapters are those of DPO built by hand with
tessera.rlhf against a separate frozen copy of the base, the SFT folder's weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import tessera
import tessera.lora
from tessera.checkpoint import full_state_dict, load_full_state_dict, load_weights
from tessera.config.schema import OptimizerConfig
from tessera.hf.adapters import read_adapters
from tessera.inference.text import ByteTokenizer
from tessera.models import gpt
from tessera.rlhf import AdaptersOff, DPOOptions, DPOTrainer, PreferenceDataset
from tessera.rlhf_pipeline import load_stage_config, plan_stage, run_stage
from tessera.rlhf_pipeline.plan import data_share, index_batches, preference_examples
from tessera.testing import use_layout
from tessera.train import build_optimizer

STEPS, PAIRS = 3, 8  # pairs per step over both ranks
OPTIONS = {"vocab_size": 256, "max_seq_len": 48, "d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "dropout": 0.0}
OPTIMIZER = {"lr": 1e-2, "weight_decay": 0.0}
LORA = {"rank": 4, "alpha": 8.0, "targets": ["qkv", "out"]}
LAYOUT = {"parallel": {"data": 2}, "zero": {"stage": 2}, "gradient_accumulation": 2}


def stages(folder: Path) -> tuple[list[dict], bool]:
    """SFT, then DPO from its folder, both with adapters; DPO's metrics and whether its
    reference was the policy's base with the adapters off."""
    use_layout(data=2, config={"parallel": {"data": 2}})
    model = {"name": "gpt", "preset": "tiny", "options": OPTIONS}
    sft = load_stage_config("sft", {"model": model, "policy": {"optimizer": OPTIMIZER, "lora": LORA},
                                    "train": {"steps": 2, "batch_size": 8}, "data": {"eval": None}})  # fmt: skip
    run_stage("sft", sft, folder / "sft")
    dpo = load_stage_config("dpo", {
        "policy": {"init": str(folder / "sft"), "optimizer": OPTIMIZER, "lora": LORA, **LAYOUT},
        "train": {"steps": STEPS, "batch_size": PAIRS}, "data": {"eval": None},
    })  # fmt: skip
    reference = plan_stage("dpo", dpo, 2)["reference"]
    run_stage("dpo", dpo, folder / "dpo")
    metrics = [json.loads(line) for line in (folder / "dpo" / "metrics.jsonl").read_text().splitlines()]
    return metrics, reference.base_of == "policy"


def by_hand(folder: Path) -> tuple[list[dict], dict[str, torch.Tensor]] | None:
    """DPO of the same adapters on the SFT folder's weights, against a separate frozen copy of them."""
    ctx = use_layout(data=2, config={**LAYOUT, "seed": 0})
    start = load_weights(folder / "sft" / "model.safetensors")
    torch.manual_seed(0)  # the stage seeds its models' draws (the adapters' A) with its seed
    policy = gpt("tiny", **OPTIONS)
    load_full_state_dict(policy, start)
    lora = tessera.lora.LoraOptions(LORA["rank"], LORA["alpha"], targets=tuple(LORA["targets"]))
    tessera.lora.apply(policy, lora)
    engine, *_ = tessera.initialize(policy, build_optimizer(policy, OptimizerConfig(**OPTIMIZER)))
    reference = gpt("tiny", **OPTIONS)
    load_full_state_dict(reference, start)
    trainer = DPOTrainer(engine, reference, DPOOptions())
    pairs = PreferenceDataset(preference_examples("sorting", "train"), ByteTokenizer())
    batches = index_batches(len(pairs), PAIRS, True, 0)
    history = []
    for _ in range(STEPS):
        mine = data_share(next(batches), ctx)
        halves = [mine[: len(mine) // 2], mine[len(mine) // 2 :]]
        history.append(trainer.train_step([pairs.collate([pairs[i] for i in rows]) for rows in halves]))
    adapters = full_state_dict(engine, select=lambda key: ".lora_" in key)
    return (history, adapters) if ctx.rank == 0 else None


def test_dpo_with_adapters_equals_dpo_against_a_separate_copy_of_the_base(pools, tmp_path):
    metrics, own_base = pools.run(2, stages, tmp_path, timeout=300)[0]
    assert own_base  # no reference model of its own was built
    card = json.loads((tmp_path / "dpo" / "model.json").read_text())
    assert card["reference"] == "the policy's frozen base with its LoRA adapters off"
    assert card["lora"]["policy"]["base"] == str((tmp_path / "sft" / "model.safetensors").resolve())
    history, adapters = pools.run(2, by_hand, tmp_path, timeout=300)[0]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for got, want in zip(metrics, history, strict=True):
        for key in ("loss", "margin", "chosen_reward", "rejected_reward"):
            torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(want[key]), rtol=1e-5, atol=1e-5, msg=key)
    assert history[-1]["margin"] != 0.0  # the policy moved away from its reference
    _, saved = read_adapters(tmp_path / "dpo" / "adapter")
    assert saved.keys() == adapters.keys()
    for key, value in adapters.items():
        torch.testing.assert_close(saved[key], value, rtol=1e-5, atol=1e-5, msg=key)
    # the merged weights load into a plain GPT: the next stage's init
    load_full_state_dict(gpt("tiny", **OPTIONS), load_weights(tmp_path / "dpo" / "model.safetensors"))
