"""The Trainer and its hooks on two ranks: metrics, logs, evaluation and checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

import tessera
from tessera.checkpoint import full_state_dict, load_weights
from tessera.engine import (
    CheckpointHook,
    EvalHook,
    LogHook,
    LRSchedulerHook,
    MemoryHook,
    ProgressBarHook,
    ThroughputHook,
)
from tessera.optim import lr_schedule
from tessera.testing import use_layout
from tests.dist.test_engine import make_dataset, make_model


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(-1) == targets).float().mean()


def body_fit(folder: str):
    ctx = use_layout(config={"gradient_accumulation": 2})
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = lr_schedule(opt, total_steps=6, warmup_steps=2, decay="linear", min_ratio=0.5)
    train = DataLoader(make_dataset(64), batch_size=4, shuffle=True)
    test = DataLoader(make_dataset(32), batch_size=8)
    engine, train, test, sched = tessera.initialize(model, opt, nn.CrossEntropyLoss(), train, test, sched)
    printed: list[str] = []
    hooks = [
        ProgressBarHook(enabled=False),
        LogHook(every=2, jsonl=Path(folder) / "metrics.jsonl", printer=printed.append),
        CheckpointHook(folder, every=3),
        EvalHook(test, every=3, metrics={"accuracy": accuracy}),
        MemoryHook(),
        ThroughputHook(tokens_per_sample=1),
        LRSchedulerHook(sched),
    ]
    trainer = tessera.Trainer(engine, hooks)
    history = trainer.fit(train, epochs=2)
    return ctx.rank, history, printed, full_state_dict(model), sorted(h.priority for h in trainer.hooks)


def test_fit_with_every_hook(pools, tmp_path):
    results = pools.run(2, body_fit, str(tmp_path))
    rank0, rank1 = results
    history = rank0[1]
    # 64 samples / (2 ranks x 4 per micro-batch x 2 accumulation) = 4 steps per epoch, 2 epochs
    assert [m["step"] for m in history] == list(range(1, 9)) and [m["epoch"] for m in history] == [0] * 4 + [1] * 4
    assert [m["loss"] for m in history] == [m["loss"] for m in rank1[1]], "ranks agree on the global loss"
    # linear warm-up over 2 steps, then linear decay to half over the remaining 4, then flat
    assert [round(m["lr"], 6) for m in history] == [0.005, 0.01, 0.01, 0.00875, 0.0075, 0.00625, 0.005, 0.005]
    for m in history:
        assert m["samples_per_s"] > 0 and m["tokens_per_s"] == m["samples_per_s"]
        assert m["param_bytes"] == m["grad_bytes"] > 0 and m["optimizer_bytes"] > 2 * m["param_bytes"]
    evals = [m for m in history if "eval_loss" in m]
    assert [m["step"] for m in evals] == [3, 6, 8]  # every 3 steps, and at the end
    assert all(0.0 <= m["accuracy"] <= 1.0 for m in evals)
    # rank 0 logs, rank 1 stays quiet
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [*range(1, 9), 8] and lines[-1]["final"] is True
    assert rank0[2][0].startswith("step=1 loss=") and len(rank0[2]) == 1 + 4 + 1 and rank1[2] == []
    # checkpoints at steps 3 and 6 and at the end; the last holds the final weights
    assert (tmp_path / "step_3" / "model.safetensors").exists() and (tmp_path / "step_6" / "model.safetensors").exists()
    final = load_weights(tmp_path / "model.safetensors")
    assert final.keys() == rank0[3].keys()
    for key, value in rank0[3].items():
        assert torch.equal(final[key], value), key
    assert rank0[4] == sorted(rank0[4])
