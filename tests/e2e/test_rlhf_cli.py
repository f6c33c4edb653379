"""`tessera rlhf` as a user runs it: SFT on one process, then PPO on two, the actor on rank 0 and
the critic and reference on rank 1, from the SFT folder. Each stage writes its folder; PPO's
models start from the SFT weights (learning rates of 1e-9 leave them where they started)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tessera.checkpoint import load_weights
from tests.e2e.test_cli import run, tessera_cmd

MODEL = {"name": "gpt", "preset": "tiny",
         "options": {"vocab_size": 256, "max_seq_len": 32, "d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64}}  # fmt: skip


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_sft_then_ppo_on_ranks_of_their_own(tmp_path):
    sft_dir, ppo_dir = tmp_path / "sft", tmp_path / "ppo"
    sft = tmp_path / "sft.json"
    sft.write_text(json.dumps({
        "model": MODEL,
        "policy": {"optimizer": {"lr": 3e-3, "weight_decay": 0.0}},
        "train": {"steps": 4, "batch_size": 8, "eval_size": 16, "eval_every": 2},
    }))  # fmt: skip
    out = run([*tessera_cmd(), "rlhf", "sft", str(sft), "--nproc", "1", "--output-dir", str(sft_dir)], timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert {p.name for p in sft_dir.iterdir()} == {
        "config.json", "loss.svg", "metrics.jsonl", "model.json", "model.safetensors", "summary.json",
    }  # fmt: skip
    assert [r["step"] for r in records(sft_dir)] == [0, 1, 2, 3, 4]
    assert "eval/loss" in records(sft_dir)[2] and "loss" in records(sft_dir)[-1]
    assert json.loads((sft_dir / "model.json").read_text())["model"] == MODEL
    assert (sft_dir / "loss.svg").read_text().startswith("<svg")

    ppo = tmp_path / "ppo.json"
    tiny_lr = {"optimizer": {"lr": 1e-9, "weight_decay": 0.0}}
    ppo.write_text(json.dumps({
        "actor": {"ranks": [0], "init": str(sft_dir), **tiny_lr},
        "critic": {"ranks": [1], **tiny_lr},
        "reference": {"ranks": [1]},
        "reward": {"rule": "sorting"},
        "generation": {"max_tokens": 6},
        "train": {"steps": 2, "batch_size": 4, "eval_size": 4},
    }))  # fmt: skip
    out = run([*tessera_cmd(), "rlhf", "ppo", str(ppo), "--nproc", "2", "--output-dir", str(ppo_dir),
               "--set", "ppo.minibatches=2"], timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "actor: rank 0, from " in out.stderr and "critic: rank 1, from " in out.stderr
    names = {p.name for p in ppo_dir.iterdir()}
    assert names >= {"config.json", "metrics.jsonl", "model.json", "model.safetensors", "critic.safetensors",
                     "summary.json", "reward.svg", "kl.svg", "loss.svg"}  # fmt: skip
    lines = records(ppo_dir)
    assert [r["step"] for r in lines] == [0, 1, 2]
    assert {"reward", "kl", "policy/loss", "value/loss"} <= set(lines[1]) and "eval/reward" in lines[-1]
    assert json.loads((ppo_dir / "config.json").read_text())["ppo"]["minibatches"] == 2

    # the actor and the critic's backbone started from the SFT weights
    start, actor, critic = (load_weights(p) for p in (sft_dir / "model.safetensors", ppo_dir / "model.safetensors",
                                                      ppo_dir / "critic.safetensors"))  # fmt: skip
    assert actor.keys() == start.keys()
    for key, value in start.items():
        torch.testing.assert_close(actor[key], value, rtol=0, atol=1e-6, msg=key)
        if key in critic:
            torch.testing.assert_close(critic[key], value, rtol=0, atol=1e-6, msg=key)
    assert set(start) - set(critic) <= {"lm_head.weight"}  # the critic has every weight but the LM head
    assert "score.weight" in critic
    summary = json.loads((ppo_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["eval_first"]["step"] == 0


def test_ppo_with_adapters_on_the_actor_and_the_critic(tmp_path):
    """The actor on rank 0 and the critic on rank 1 train LoRA adapters; the reference is the
    actor's base with its adapters off. The folder holds each model's adapters (PEFT folders) and
    its weights with them merged, which plain models load."""
    from tessera.checkpoint import load_full_state_dict, save_weights
    from tessera.hf.adapters import load_adapters, merged_state_dict
    from tessera.models import gpt
    from tessera.rlhf import value_model

    start, ppo_dir = tmp_path / "start", tmp_path / "ppo"
    torch.manual_seed(0)
    save_weights(gpt("tiny", **MODEL["options"]).state_dict(), start / "model.safetensors")
    (start / "model.json").write_text(json.dumps({"stage": "sft", "value": False, "model": MODEL}))
    adapters = {"optimizer": {"lr": 1e-2, "weight_decay": 0.0}, "lora": {"rank": 4, "targets": ["qkv", "out"]}}
    ppo = tmp_path / "ppo.json"
    ppo.write_text(json.dumps({
        "actor": {"ranks": [0], "init": str(start), **adapters},
        "critic": {"ranks": [1], **adapters},
        "reward": {"rule": "sorting"},
        "generation": {"max_tokens": 6},
        "train": {"steps": 2, "batch_size": 4, "eval_size": 4},
    }))  # fmt: skip
    out = run([*tessera_cmd(), "rlhf", "ppo", str(ppo), "--nproc", "2", "--output-dir", str(ppo_dir)], timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "reference: the actor's frozen base with its LoRA adapters off (rank 0; no copy of its own)" in out.stderr
    assert "actor: rank 0, from " in out.stderr and "LoRA rank 4 on qkv, out" in out.stderr
    names = {p.name for p in ppo_dir.iterdir()}
    assert names >= {"model.safetensors", "critic.safetensors", "adapter", "critic_adapter", "model.json"}
    card = json.loads((ppo_dir / "model.json").read_text())
    assert card["lora"]["actor"]["adapter"] == "adapter" and card["lora"]["critic"]["adapter"] == "critic_adapter"
    assert card["reference"] == "the actor's frozen base with its LoRA adapters off"
    assert {"reward", "kl", "policy/loss", "value/loss"} <= set(records(ppo_dir)[-1])

    # the merged weights are the start's with the saved adapters folded in, under a plain GPT's keys
    actor = gpt("tiny", **MODEL["options"])
    load_full_state_dict(actor, load_weights(start / "model.safetensors"))
    load_adapters(actor, ppo_dir / "adapter")
    merged = load_weights(ppo_dir / "model.safetensors")
    load_full_state_dict(gpt("tiny", **MODEL["options"]), merged)
    for key, value in merged_state_dict(actor).items():
        torch.testing.assert_close(merged[key], value, rtol=1e-6, atol=1e-6, msg=key)
    critic = load_weights(ppo_dir / "critic.safetensors")
    load_full_state_dict(value_model(gpt("tiny", **MODEL["options"])), critic)  # a plain value model's keys
