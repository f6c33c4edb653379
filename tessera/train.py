"""The training recipe behind ``tessera train``: a reference model on the byte-level corpus, or
a Hugging Face causal LM (``model.name = "hf:PATH"``, :mod:`tessera.hf.train`); the Python
standard library's sources or the user's text files (``data.name = "text_files"``).

Every rank runs :func:`main` (``tessera train`` starts them through torchrun). Rank 0 writes the
run folder: ``config.json`` (the resolved config), ``metrics.jsonl`` (one line per step),
``loss.png`` (the loss curve; below it tokens/s and MFU), ``experts.png`` for a mixture-of-experts model (each layer's
expert load over the steps; the counts are in ``metrics.jsonl``) and the final weights: ``model.safetensors`` for the reference
model, an ``hf/`` folder that ``transformers`` loads for a Hugging Face one; and ``memory.json``
under ZeRO and Gemini (their chunks and bytes per tier, ``Strategy.report``).

The engine is closed at the end of training and when it raises (``Trainer.fit``), and
``tessera.shutdown()`` closes it if the error came before: Gemini's offload files are removed
however the run ends, short of a kill (then the next run over the same folder removes them).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

import tessera
from tessera import comm
from tessera.config import Config, DataConfig, OptimizerConfig, default_run_dir
from tessera.data import ByteSequences, load_byte_corpus, split_sequences
from tessera.engine import (
    CheckpointHook,
    CompileReportHook,
    EvalHook,
    Hook,
    LogHook,
    LRSchedulerHook,
    MemoryHook,
    ProgressBarHook,
    RoutingHook,
    ThroughputHook,
    Trainer,
    UtilisationHook,
)
from tessera.engine.flops import ReportsFlops
from tessera.engine.utilisation import shared_peak
from tessera.errors import ConfigError
from tessera.files import atomic_path, write_atomically
from tessera.hf.adapters import merged_state_dict, save_adapters
from tessera.hf.train import CausalLMLoss, SavePretrainedHook, build_model, find_causal_lm, sequence_length, tokens_of
from tessera.lora.quant import quantize
from tessera.models import NextTokenLoss, gpt
from tessera.optim import LAMB, LARS, lr_schedule
from tessera.optim.kernels import use_step_kernel


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The configured optimizer; weight decay applies to matrices only (not biases, norms)."""
    trained = [p for p in model.parameters() if p.requires_grad]  # a frozen base is not the optimizer's
    decay = [p for p in trained if p.dim() >= 2]
    no_decay = [p for p in trained if p.dim() < 2]
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


def step_kernel(cfg: Config) -> str:
    """``optimizer.kernel``, with ``auto`` made ``fused`` for a compiled adam/adamw run (measured
    faster on CPU; eager runs keep torch's choice and their numbers)."""
    o = cfg.optimizer
    return "fused" if o.kernel == "auto" and cfg.compile.enabled and o.name in ("adam", "adamw") else o.kernel


def write_run_config(cfg: Config, world_size: int, path: Path) -> None:
    """The resolved config (every field, defaults included) and the world size, as JSON."""
    resolved = {"world_size": world_size, **dataclasses.asdict(cfg)}
    write_atomically(path, json.dumps(resolved, indent=2) + "\n")


def plot_losses(history: list[dict[str, Any]], path: Path, unit: str = "byte") -> None:
    """Write the training (and evaluation) loss curve as a PNG (``unit``: what one target is);
    below it, when the steps have them, tokens/s and MFU over the steps (from the second step:
    the first one's warm-up would flatten the rest)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speed = [m for m in history[1:] if "tokens_per_s" in m]
    if speed:
        fig, (ax, lower) = plt.subplots(2, 1, figsize=(7, 6), dpi=110, height_ratios=(2, 1), sharex=True)
        plot_throughput(lower, speed)
    else:
        fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    steps = [m["step"] for m in history]
    ax.plot(steps, [m["loss"] for m in history], label="train loss", linewidth=1.2)
    evals = [(m["step"], m["eval_loss"]) for m in history if "eval_loss" in m]
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss", markersize=4)
    if not speed:  # else the panel below says it
        ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"cross-entropy (nats per {unit})")
    ax.set_title("tessera train")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def plot_throughput(ax: Any, steps: list[dict[str, Any]]) -> None:
    """Tokens/s of the global batch over ``steps`` on ``ax``, with MFU (per rank, in percent) as
    a second scale at its right when the steps have it: MFU is tokens/s times a constant (FLOPs
    per token over the world size and the peak), so one curve reads on both."""
    at = [m["step"] for m in steps]
    ax.plot(at, [m["tokens_per_s"] for m in steps], color="tab:green", linewidth=1.0)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("tokens/s (global batch)", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if all("mfu" in m and m["tokens_per_s"] > 0 for m in steps):
        per_token_s = steps[0]["mfu"] / steps[0]["tokens_per_s"] * 100  # percent of MFU per token/s
        right = ax.secondary_yaxis("right", functions=(lambda v: v * per_token_s, lambda v: v / per_token_s))
        right.set_ylabel("MFU per rank (%)", fontsize=9)


# ---- data ------------------------------------------------------------------------------------


def text_files(paths: Sequence[str]) -> list[Path]:
    """The files ``data.files`` names: each file as given, each folder's files (recursively, in
    path order, hidden files and folders and ``__pycache__`` left out). Raises ConfigError for a
    path that does not exist and a folder without files."""
    found: list[Path] = []
    for given in paths:
        path = Path(given)
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            inside = []
            for folder, subfolders, names in os.walk(path):
                subfolders[:] = [d for d in subfolders if not d.startswith(".") and d != "__pycache__"]
                inside += [Path(folder, n) for n in names if not n.startswith(".")]
            if not inside:
                raise ConfigError(f"data.files: the folder {given} holds no files to read")
            found += sorted(inside, key=lambda p: p.relative_to(path).parts)
        else:
            raise ConfigError(f"data.files: {given} does not exist (give text files or folders of them)")
    return found


def corpus_bytes(data: DataConfig) -> torch.Tensor:
    """The text ``data`` names as one uint8 tensor of at most ``data.max_bytes`` bytes: the Python
    standard library's sources (:func:`tessera.data.load_byte_corpus`), or the ``text_files``
    read in order, joined by b"\\n" and cut at ``max_bytes``."""
    if data.name == "python_bytes":
        return load_byte_corpus(data.max_bytes)
    chunks: list[bytes] = []
    total = 0
    for path in text_files(data.files):
        if total >= data.max_bytes:
            break
        chunk = path.read_bytes() if not chunks else b"\n" + path.read_bytes()
        chunks.append(chunk)
        total += len(chunk)
    text = b"".join(chunks)[: data.max_bytes]
    if not text:
        raise ConfigError(f"data.files={list(data.files)}: the files are empty")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


def split_tokens(tokens: torch.Tensor, seq_len: int, data: DataConfig) -> tuple[ByteSequences, ByteSequences]:
    """Train and eval next-token windows of ``seq_len`` over a 1-D tensor of token ids: the eval
    set from the last ``data.eval_fraction`` of the tokens, the train set from the rest (as
    :func:`tessera.data.byte_datasets` splits the byte corpus). ConfigError when a part is
    shorter than one window."""
    hint = (
        f"give more text (data.max_bytes={data.max_bytes}, data.files), a shorter data.seq_len, or another "
        f"data.eval_fraction (={data.eval_fraction})"
    )
    try:
        return split_sequences(tokens, seq_len, data.eval_fraction, hint)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


class MemoryReportHook(Hook):
    """At the end of training, writes what the strategy tells of its memory (``Strategy.report``:
    ZeRO's and Gemini's chunks, utilisation and bytes per tier at their peak) to ``path`` as
    JSON, when it tells something (rank 0's; nothing for plain data parallelism)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def after_fit(self, trainer: Any) -> None:
        report = trainer.engine.strategy.report()
        if self.path is not None and report:
            text = json.dumps({"strategy": trainer.engine.strategy.name, **report}, indent=2, default=str)
            write_atomically(self.path, text + "\n")


# ---- the recipe --------------------------------------------------------------------------------


@dataclasses.dataclass
class Recipe:
    """What a model brings to the training loop: the model (built, deferred or not: initialize
    makes it), its loss ``criterion(outputs, targets)``, train and eval sets of ``(inputs,
    targets)`` windows of ``seq_len`` tokens, how the run names it, what one token is (the loss
    curve's unit) and the hook that writes the final weights into the run folder."""

    model: nn.Module
    criterion: Callable[..., torch.Tensor]
    train_set: ByteSequences
    eval_set: ByteSequences
    seq_len: int
    title: str
    unit: str
    final_weights: Callable[[Path], Hook]


def gpt_recipe(cfg: Config) -> Recipe:
    """The reference GPT (``model.name = "gpt"``) on the bytes of the configured text."""
    # a base quantized from random weights needs them made first (a folder's are quantized as read)
    deferred = cfg.model.deferred and not (cfg.lora.rank and cfg.lora.quantize != "none")
    with tessera.deferred_init() if deferred else contextlib.nullcontext():
        model = gpt(cfg.model.preset, **cfg.model.options)
    seq_len = cfg.data.seq_len or model.config.max_seq_len
    train_set, eval_set = split_tokens(corpus_bytes(cfg.data), seq_len, cfg.data)
    title = f"{cfg.model.name}-{cfg.model.preset} ({model.num_parameters():,} parameters)"
    # the final weights, as model.safetensors
    return Recipe(model, NextTokenLoss(), train_set, eval_set, seq_len, title, "byte", CheckpointHook)


HF_FOLDER = "hf"  # <run folder>/hf: the fine-tuned Hugging Face model


def hf_recipe(cfg: Config) -> Recipe:
    """A Hugging Face causal LM (``model.name = "hf:PATH"``, :mod:`tessera.hf.train`) on the
    configured text, tokenized by its folder's tokenizer or read as bytes; its final weights go
    to ``<run folder>/hf`` as a folder ``transformers`` loads, with the tokenizer's files."""
    assert cfg.model.hf_path is not None
    lm = find_causal_lm(cfg.model.hf_path, cfg.model.options)
    seq_len = sequence_length(lm, cfg.data.seq_len)
    quantized = cfg.lora.rank and cfg.lora.quantize != "none"  # random weights quantized need making first
    model = build_model(lm, cfg.model.options, deferred=cfg.model.deferred and not quantized)
    train_set, eval_set = split_tokens(tokens_of(corpus_bytes(cfg.data), lm.tokenizer), seq_len, cfg.data)
    count = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())  # full shapes: not made yet
    weights = f"weights of {lm.path}" if lm.weights else "random weights"
    tokens = "its tokenizer" if lm.tokenizer is not None else "byte ids"
    title = f"{lm.cls.__name__} ({count:,} parameters, {weights}, {tokens})"
    tokenizer = lm.tokenizer
    return Recipe(
        model,
        CausalLMLoss(),
        train_set,
        eval_set,
        seq_len,
        title,
        lm.unit,
        lambda run_dir: SavePretrainedHook(run_dir / HF_FOLDER, tokenizer),
    )


def run(cfg: Config, run_dir: Path) -> list[dict[str, Any]]:
    """Train under the current context and write the run folder (rank 0)."""
    ctx = tessera.get_context()
    recipe = hf_recipe(cfg) if cfg.model.hf_path is not None else gpt_recipe(cfg)
    seq_len, train_set = recipe.seq_len, recipe.train_set
    micro = cfg.data.micro_batch_size
    train_dl = DataLoader(train_set, batch_size=micro, shuffle=cfg.data.shuffle, drop_last=True)
    eval_dl = DataLoader(recipe.eval_set, batch_size=micro)
    if cfg.lora.rank:
        lora = cfg.lora
        tessera.lora.apply(recipe.model, tessera.lora.LoraOptions(
            lora.rank, lora.alpha, lora.dropout, tuple(lora.targets), tuple(lora.modules_to_save), lora.init
        ))  # fmt: skip
        if lora.quantize != "none":
            quantize(recipe.model, lora.quantize, double_quant=lora.double_quant)
    # FLOPs per token, for MFU: from the whole model before initialize (a pipeline stage keeps its
    # layers only), after any adapters (a frozen base costs 4 FLOPs a parameter, not 6); tessera's
    # GPT knows them, a Hugging Face model is not counted (a forward and backward of it all first)
    per_token = recipe.model.flops_per_token(seq_len) if isinstance(recipe.model, ReportsFlops) else None
    optimizer = build_optimizer(recipe.model, cfg.optimizer)
    pipeline = cfg.parallel.pipeline
    per_step = (pipeline.microbatches or pipeline.size) if pipeline.size > 1 else cfg.gradient_accumulation
    per_epoch = len(train_set) // (micro * ctx.size("data") * per_step)
    total = cfg.trainer.steps or cfg.trainer.epochs * per_epoch
    scheduler = lr_schedule(optimizer, total, cfg.schedule.warmup_steps, cfg.schedule.decay, cfg.schedule.min_lr_ratio)
    engine, train_loader, eval_loader, scheduler = tessera.initialize(
        recipe.model, optimizer, recipe.criterion, train_dl, eval_dl, scheduler, init=cfg.model.init
    )
    assert train_loader is not None
    use_step_kernel(optimizer, step_kernel(cfg))
    # one rank's peak (the data sheet's, cached or measured on rank 0 now; collective)
    utilisation = UtilisationHook(per_token, shared_peak(ctx, engine.precision)) if per_token is not None else None
    if ctx.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_run_config(cfg, ctx.world_size, run_dir / "config.json")
        print(
            f"tessera train: {recipe.title} on "
            f"{ctx.world_size} rank(s), {total} steps of {micro * ctx.size('data') * per_step} "
            f"x {seq_len} tokens; run folder {run_dir}",
            file=sys.stderr,
            flush=True,
        )
        if utilisation is not None:
            assert utilisation.peak is not None
            print(
                f"tessera train: {utilisation.flops_per_token / 1e6:.4g} MFLOPs per token; "
                f"peak per rank {utilisation.peak.describe()}",
                file=sys.stderr,
                flush=True,
            )
    hooks = [
        LRSchedulerHook(scheduler),
        ThroughputHook(tokens_per_sample=seq_len),
        *([utilisation] if utilisation is not None else []),
        MemoryHook(every=cfg.trainer.log_every),
        RoutingHook(plot=run_dir / "experts.png" if ctx.rank == 0 else None),
        EvalHook(eval_loader, every=cfg.trainer.eval_every, max_batches=cfg.trainer.eval_batches),
        # with adapters on a Hugging Face base the run keeps the adapters alone (below), PEFT's way;
        # on tessera's GPT its weights with the adapters merged in (a model `tessera generate` reads)
        *([] if cfg.lora.rank and cfg.model.hf_path else [final_weights(recipe, cfg, run_dir)]),
        LogHook(every=cfg.trainer.log_every, jsonl=run_dir / "metrics.jsonl"),
        MemoryReportHook(run_dir / "memory.json" if ctx.rank == 0 else None),
        *([CompileReportHook(run_dir / "compile.json" if ctx.rank == 0 else None)] if engine.compile_report else []),
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
    if cfg.lora.rank:  # the adapters alone, as a PEFT folder (collective)
        save_adapters(engine, run_dir / "adapter", base_model=cfg.model.hf_path)
    if ctx.rank == 0:
        plot_losses(history, run_dir / "loss.png", recipe.unit)
        first, last = history[0]["loss"], history[-1]["loss"]
        print(f"tessera train: loss {first:.3f} -> {last:.3f}; wrote {run_dir}", file=sys.stderr, flush=True)
    return history


def final_weights(recipe: Recipe, cfg: Config, run_dir: Path) -> Hook:
    """The hook that writes the run's final weights; with adapters, merged into the base."""
    if cfg.lora.rank:
        return CheckpointHook(run_dir, state_of=merged_state_dict)
    return recipe.final_weights(run_dir)


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
