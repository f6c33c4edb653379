"""The figures of docs/rlhf.md's SFT and reward-model sections: a tiny byte-level GPT on the
sorting task, on one CPU process. SFT on the chosen answers, then reward models from a fresh
backbone and from the SFT model's, each evaluated on the 100 held-out pairs after every epoch.

    python examples/rlhf_sft_rm_figures.py [--epochs 5]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from torch.utils.data import DataLoader

import tessera
from tessera.checkpoint import full_state_dict
from tessera.inference.text import ByteTokenizer
from tessera.models import gpt
from tessera.rlhf import (
    PreferenceDataset,
    SFTDataset,
    load_preferences,
    sft_from_preferences,
    sorting_files,
    value_model,
)
from tessera.rlhf.reward import RewardTrainer
from tessera.rlhf.sft import SFTTrainer


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt("tiny", vocab_size=256, max_seq_len=32, d_model=64, n_layers=2, n_heads=4, d_ff=128, dropout=0.0)


def engine_of(model: torch.nn.Module, lr: float):
    return tessera.initialize(model, torch.optim.AdamW(model.parameters(), lr=lr))[0]


def run(trainer: SFTTrainer | RewardTrainer, train: Any, held: Any, epochs: int, keys: tuple[str, ...]) -> None:
    """``epochs`` epochs of ``trainer`` on ``train`` (batches of 16), the held-out ``keys`` after each."""
    held_out = [held.collate(held.items)]

    def shown(metrics: dict[str, float]) -> str:
        return "  ".join(f"{k} {metrics[k]:.3f}" for k in keys)

    print(f"  before       {shown(trainer.evaluate(held_out))}")
    order = torch.Generator().manual_seed(0)
    steps, start = 0, time.perf_counter()
    for epoch in range(1, epochs + 1):
        for batch in DataLoader(train, batch_size=16, shuffle=True, collate_fn=train.collate, generator=order):
            trainer.train_step([batch])
            steps += 1
        seconds = time.perf_counter() - start
        print(f"  epoch {epoch} ({steps:3d} steps, {seconds:4.1f} s)  {shown(trainer.evaluate(held_out))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    epochs = parser.parse_args().epochs
    torch.set_num_threads(1)
    tessera.launch_from_torch()  # a world of one without torchrun's environment
    files, tokenizer = sorting_files(), ByteTokenizer()
    train, held = load_preferences(files.train), load_preferences(files.heldout)

    print("SFT on the chosen answers: held-out loss (nats per response token)")
    sft_model = build()
    sft_train, sft_held = (SFTDataset(sft_from_preferences(pairs), tokenizer) for pairs in (train, held))
    run(SFTTrainer(engine_of(sft_model, 3e-3)), sft_train, sft_held, epochs, ("loss",))

    rm_train, rm_held = PreferenceDataset(train, tokenizer), PreferenceDataset(held, tokenizer)
    for start in ("a fresh GPT", "the SFT model"):
        print(f"reward model from {start}: held-out accuracy and margin")
        model = value_model(build())
        if start == "the SFT model":
            model.load_backbone(full_state_dict(sft_model))
        run(RewardTrainer(engine_of(model, 1e-3)), rm_train, rm_held, epochs, ("accuracy", "margin", "loss"))
    tessera.shutdown()


if __name__ == "__main__":
    main()
