"""The training recipe behind ``tessera train``: a reference model on the byte-level corpus.

Every rank runs :func:`main` (``tessera train`` starts them through torchrun). Rank 0 writes the
run folder: ``config.json`` (the resolved config), ``metrics.jsonl`` (one line per step),
``loss.png`` (the loss curve) and ``model.safetensors`` (the final weights).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

import tessera
from tessera import comm
from tessera.config import Config, OptimizerConfig, default_run_dir
from tessera.data import byte_datasets
from tessera.engine import (
    CheckpointHook,
    EvalHook,
    LogHook,
    LRSchedulerHook,
    MemoryHook,
    ProgressBarHook,
    ThroughputHook,
    Trainer,
)
from tessera.files import atomic_path, write_atomically
from tessera.models import NextTokenLoss, gpt
from tessera.optim import LAMB, LARS, lr_schedule


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The configured optimizer; weight decay applies to matrices only (not biases, norms)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    if cfg.name == "lars":
        return LARS(groups, lr=cfg.lr, momentum=cfg.momentum, trust_coefficient=cfg.trust_coefficient)
    betas = (cfg.betas[0], cfg.betas[1])
    if cfg.name == "lamb":
        return LAMB(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
    if cfg.name == "adam":
        return torch.optim.Adam(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)


def write_run_config(cfg: Config, world_size: int, path: Path) -> None:
    """The resolved config (every field, defaults included) and the world size, as JSON."""
    resolved = {"world_size": world_size, **dataclasses.asdict(cfg)}
    write_atomically(path, json.dumps(resolved, indent=2) + "\n")


def plot_losses(history: list[dict[str, Any]], path: Path) -> None:
    """Write the training (and evaluation) loss curve as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    steps = [m["step"] for m in history]
    ax.plot(steps, [m["loss"] for m in history], label="train loss", linewidth=1.2)
    evals = [(m["step"], m["eval_loss"]) for m in history if "eval_loss" in m]
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss", markersize=4)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title("tessera train")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def run(cfg: Config, run_dir: Path) -> list[dict[str, Any]]:
    """Train under the current context and write the run folder (rank 0)."""
    ctx = tessera.get_context()
    with tessera.deferred_init() if cfg.model.deferred else contextlib.nullcontext():
        model = gpt(cfg.model.preset, **cfg.model.options)
    seq_len = cfg.data.seq_len or model.config.max_seq_len
    train_set, eval_set = byte_datasets(seq_len, cfg.data.max_bytes, cfg.data.eval_fraction)
    micro = cfg.data.micro_batch_size
    train_dl = DataLoader(train_set, batch_size=micro, shuffle=cfg.data.shuffle, drop_last=True)
    eval_dl = DataLoader(eval_set, batch_size=micro)
    optimizer = build_optimizer(model, cfg.optimizer)
    pipeline = cfg.parallel.pipeline
    per_step = (pipeline.microbatches or pipeline.size) if pipeline.size > 1 else cfg.gradient_accumulation
    per_epoch = len(train_set) // (micro * ctx.size("data") * per_step)
    total = cfg.trainer.steps or cfg.trainer.epochs * per_epoch
    scheduler = lr_schedule(optimizer, total, cfg.schedule.warmup_steps, cfg.schedule.decay, cfg.schedule.min_lr_ratio)
    engine, train_loader, eval_loader, scheduler = tessera.initialize(
        model, optimizer, NextTokenLoss(), train_dl, eval_dl, scheduler, init=cfg.model.init
    )
    assert train_loader is not None
    if ctx.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_run_config(cfg, ctx.world_size, run_dir / "config.json")
        print(
            f"tessera train: {cfg.model.name}-{cfg.model.preset} ({model.num_parameters():,} parameters) on "
            f"{ctx.world_size} rank(s), {total} steps of {micro * ctx.size('data') * per_step} "
            f"x {seq_len} tokens; run folder {run_dir}",
            file=sys.stderr,
            flush=True,
        )
    hooks = [
        LRSchedulerHook(scheduler),
        ThroughputHook(tokens_per_sample=seq_len),
        MemoryHook(every=cfg.trainer.log_every),
        EvalHook(eval_loader, every=cfg.trainer.eval_every, max_batches=cfg.trainer.eval_batches),
        CheckpointHook(run_dir),  # the final weights, as model.safetensors
        LogHook(every=cfg.trainer.log_every, jsonl=run_dir / "metrics.jsonl"),
        ProgressBarHook(enabled=cfg.trainer.progress_bar),
    ]
    trainer = Trainer(
        engine,
        hooks,
        checkpoint_dir=run_dir / "checkpoints",
        checkpoint_every=cfg.trainer.checkpoint_every,
        keep_last=cfg.trainer.keep_last,
        resume=cfg.trainer.resume,
    )
    history = trainer.fit(train_loader, steps=total)
    if ctx.rank == 0:
        plot_losses(history, run_dir / "loss.png")
        first, last = history[0]["loss"], history[-1]["loss"]
        print(f"tessera train: loss {first:.3f} -> {last:.3f}; wrote {run_dir}", file=sys.stderr, flush=True)
    return history


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of each rank (``python -m tessera.train`` under torchrun)."""
    parser = argparse.ArgumentParser(prog="python -m tessera.train")
    parser.add_argument("config", nargs="?", default=None)
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--run-dir", default=None)
    args = parser.parse_args(argv)
    ctx = tessera.launch_from_torch(args.config, overrides=args.set)
    cfg = tessera.current_config()
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(cfg)
    run_dir = Path(comm.broadcast_object(str(run_dir), ctx.group("world")))  # one folder for all ranks
    try:
        run(cfg, run_dir)
    finally:
        tessera.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
