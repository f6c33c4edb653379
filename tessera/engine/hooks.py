"""Trainer hooks: LR scheduling, throughput, memory, expert routing, evaluation, checkpoints,
logging, progress.

Hooks run in order of ``priority`` (lower first) at each event, so the logging hooks, which
run last, see the numbers the others added to ``trainer.metrics``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, Protocol, TextIO

import torch

from tessera import comm
from tessera.checkpoint import full_state_dict, save_weights
from tessera.engine.engine import Engine
from tessera.files import atomic_path
from tessera.memory import model_state_bytes, peak_rss_bytes
from tessera.nn.moe import moe_layers, take_routing_counts


class TrainingLoop(Protocol):
    """What a hook reads of the loop that calls it (``tessera.Trainer`` is one). Named here
    rather than imported: the trainer imports the hooks."""

    @property
    def engine(self) -> Engine:
        """The engine the loop trains."""
        ...

    @property
    def step(self) -> int:
        """Optimizer steps taken so far in the loop (the current step's number after it)."""
        ...

    @property
    def metrics(self) -> dict[str, Any]:
        """The current step's numbers: hooks read them and add their own."""
        ...

    @property
    def history(self) -> list[dict[str, Any]]:
        """Every finished step's metrics."""
        ...

    @property
    def train_dataloader(self) -> Any:
        """The loader being trained on (None before ``fit``)."""
        ...

    @property
    def test_dataloader(self) -> Any:
        """The held-out loader given to ``fit``, or None."""
        ...

    @property
    def max_steps(self) -> int | None:
        """The steps ``fit`` runs, when known."""
        ...


class Hook:
    """Base class: override the events you need; each gets the loop that calls it."""

    priority = 50

    def before_fit(self, trainer: TrainingLoop) -> None: ...
    def before_epoch(self, trainer: TrainingLoop) -> None: ...
    def before_step(self, trainer: TrainingLoop) -> None: ...
    def after_step(self, trainer: TrainingLoop) -> None: ...
    def after_epoch(self, trainer: TrainingLoop) -> None: ...
    def after_fit(self, trainer: TrainingLoop) -> None: ...


def _is_rank0(trainer: TrainingLoop) -> bool:
    return trainer.engine.ctx.rank == 0


class LRSchedulerHook(Hook):
    """Steps an LR scheduler after every optimizer step that was taken; records ``lr``."""

    priority = 10

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def before_step(self, trainer: TrainingLoop) -> None:
        trainer.metrics["lr"] = trainer.engine.optimizer.param_groups[0]["lr"]

    def after_step(self, trainer: TrainingLoop) -> None:
        if not trainer.engine.last_step_skipped:
            self.scheduler.step()


class ThroughputHook(Hook):
    """Adds ``step_time_s``, ``samples_per_s`` and (given ``tokens_per_sample``) ``tokens_per_s``
    for the global batch: per-rank micro-batch x data-parallel ranks x micro-batches per step (a
    loader without a ``batch_size``: the rows of this rank's step x data-parallel ranks)."""

    priority = 20

    def __init__(self, tokens_per_sample: int | None = None) -> None:
        self.tokens_per_sample = tokens_per_sample
        self._start = 0.0

    def before_step(self, trainer: TrainingLoop) -> None:
        self._start = time.perf_counter()

    def after_step(self, trainer: TrainingLoop) -> None:
        elapsed = time.perf_counter() - self._start
        loader = trainer.train_dataloader
        engine = trainer.engine
        if loader is not None and loader.batch_size:
            samples = loader.batch_size * engine.ctx.size("data") * engine.micro_batches_per_step
        else:  # batches of their own sizes (a batch sampler's): the rows this rank's step had, times the data ranks
            samples = engine.last_step_rows * engine.ctx.size("data")
        trainer.metrics["step_time_s"] = elapsed
        trainer.metrics["samples_per_s"] = samples / elapsed if elapsed > 0 else float("nan")
        if self.tokens_per_sample is not None:
            trainer.metrics["tokens_per_s"] = trainer.metrics["samples_per_s"] * self.tokens_per_sample


class MemoryHook(Hook):
    """Adds this rank's bytes of parameters, gradients and optimizer states, its peak RSS, and
    the peak RSS of the init phase (process start to the end of ``initialize``)."""

    priority = 30

    def __init__(self, every: int = 1) -> None:
        self.every = every

    def after_step(self, trainer: TrainingLoop) -> None:
        if trainer.step % self.every:
            return
        report = model_state_bytes(trainer.engine.module, trainer.engine.optimizer)
        trainer.metrics.update(
            param_bytes=report["parameters"],
            grad_bytes=report["gradients"],
            optimizer_bytes=report["optimizer_states"],
            peak_rss_bytes=peak_rss_bytes(),
            init_peak_rss_bytes=getattr(trainer.engine, "init_peak_rss", None),
        )


class RoutingHook(Hook):
    """The load of a mixture-of-experts model's experts: after each step, per MoE layer, the
    assignments each expert computed in the step (``moe_tokens_per_expert``: layer name -> counts,
    over the whole global batch), the assignments dropped over capacity (``moe_dropped``, all
    layers) and the busiest expert's load over the mean (``moe_imbalance``, the largest over the
    layers; 1 when balanced). With ``plot``, rank 0 draws each layer's expert shares over the steps
    into that PNG at the end. Collective (a sum over the world); nothing for a model without MoE."""

    priority = 35  # before evaluation's forwards, which route tokens too

    def __init__(self, plot: str | Path | None = None) -> None:
        self.plot = Path(plot) if plot is not None else None
        self._layers: list[tuple[str, Any]] = []

    def before_fit(self, trainer: TrainingLoop) -> None:
        self._layers = moe_layers(trainer.engine.module)

    def before_step(self, trainer: TrainingLoop) -> None:
        take_routing_counts(self._layers)  # what ran between steps (evaluation) does not count

    def after_step(self, trainer: TrainingLoop) -> None:
        engine = trainer.engine
        counts = take_routing_counts(self._layers)
        if not counts:
            return
        names = list(counts)
        table = torch.stack([c.to(torch.float64).cpu() for c, _ in counts.values()])
        dropped = torch.tensor([float(sum(n for _, n in counts.values()))], dtype=torch.float64)
        both = torch.cat([table.reshape(-1), dropped]).to(engine.ctx.device)
        comm.all_reduce(both, engine.ctx.group("world"))  # other data ranks' tokens, other stages' layers
        both = (both / engine.ctx.size("tensor")).round().cpu()  # tensor ranks route the same tokens
        table = both[:-1].reshape(table.shape)
        mean = table.mean(dim=1).clamp(min=1e-12)
        trainer.metrics["moe_tokens_per_expert"] = {n: [int(v) for v in row] for n, row in zip(names, table)}
        trainer.metrics["moe_dropped"] = int(both[-1])
        trainer.metrics["moe_imbalance"] = float((table.max(dim=1).values / mean).max())

    def after_fit(self, trainer: TrainingLoop) -> None:
        if self.plot is not None and _is_rank0(trainer) and self._layers:
            plot_expert_load(trainer.history, self.plot)


def plot_expert_load(history: list[dict[str, Any]], path: Path) -> None:
    """Each MoE layer's share of the assignments per expert over the steps (stacked), from the
    ``moe_tokens_per_expert`` the :class:`RoutingHook` recorded, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(m["step"], m["moe_tokens_per_expert"]) for m in history if "moe_tokens_per_expert" in m]
    if not rows:
        return
    layers = list(rows[0][1])
    cols = min(len(layers), 4)
    lines = -(-len(layers) // cols)
    fig, axes = plt.subplots(lines, cols, figsize=(3.2 * cols, 2.6 * lines), dpi=110, squeeze=False)
    steps = [step for step, _ in rows]
    for ax, layer in zip(axes.flat, layers):
        counts = torch.tensor([per_layer[layer] for _, per_layer in rows], dtype=torch.float64)
        shares = counts / counts.sum(dim=1, keepdim=True).clamp(min=1)
        ax.stackplot(steps, shares.t().numpy(), labels=[f"expert {e}" for e in range(shares.shape[1])])
        ax.set_ylim(0, 1)
        ax.set_title(layer, fontsize=8)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(layers) :]:
        ax.axis("off")
    axes.flat[0].set_ylabel("share of assignments", fontsize=8)
    fig.suptitle("share of each expert in the assignments, per MoE layer (balanced: equal bands)", fontsize=9)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


Metric = Callable[[torch.Tensor, torch.Tensor], torch.Tensor | float]


class EvalHook(Hook):
    """Every ``every`` steps (and at the end) computes ``eval_loss`` and each named metric
    ``fn(outputs, targets)`` over at most ``max_batches`` batches of the test loader, averaged
    over batches and data-parallel ranks. Dict batches: the model is called with ``**batch``,
    the metrics get ``fn(outputs, batch)``, and ``eval_loss`` is the mean over every item the
    batches' losses count (``engine.loss_items``), on every rank."""

    priority = 40

    def __init__(
        self,
        test_dataloader: Any = None,
        *,
        every: int | None = None,
        max_batches: int | None = None,
        metrics: dict[str, Metric] | None = None,
    ) -> None:
        self.loader = test_dataloader
        self.every = every
        self.max_batches = max_batches
        self.metric_fns = metrics or {}
        self.last: dict[str, float] = {}

    def evaluate(self, trainer: TrainingLoop) -> dict[str, float]:
        engine = trainer.engine
        loader = self.loader if self.loader is not None else trainer.test_dataloader
        if loader is None:
            return {}
        engine.eval()
        sums: dict[str, float] = {"eval_loss": 0.0, **{name: 0.0 for name in self.metric_fns}}
        batches = 0
        dicts, items = False, 0.0  # dict batches, and the items their losses counted (each weighs its loss)
        with torch.no_grad():
            for i, batch in enumerate(loader):
                if self.max_batches is not None and i >= self.max_batches:
                    break
                if isinstance(batch, Mapping):
                    batch = engine.local_tokens({k: _on(v, engine.ctx.device) for k, v in batch.items()})
                    outputs = engine(**batch)
                    count = float(engine.loss_items(batch))
                    if count:  # a mean over no items is NaN
                        sums["eval_loss"] += float(engine.dict_loss(outputs, batch)) * count
                    dicts, items = True, items + count
                    targets = batch
                else:
                    inputs, targets = batch
                    inputs, targets = inputs.to(engine.ctx.device), targets.to(engine.ctx.device)
                    outputs = engine(inputs)
                    sums["eval_loss"] += float(engine.criterion(outputs, targets))
                for name, fn in self.metric_fns.items():
                    sums[name] += float(fn(outputs, targets))
                batches += 1
        engine.train()
        if batches == 0:
            return {}
        self.last = {name: engine.mean_over_data(total / batches) for name, total in sums.items()}
        if dicts:  # the mean over every item of every rank's batches, as one process would weigh them
            counted = engine.mean_over_data(items)
            self.last["eval_loss"] = engine.mean_over_data(sums["eval_loss"]) / counted if counted else float("nan")
        return self.last

    def after_step(self, trainer: TrainingLoop) -> None:
        if self.every and trainer.step % self.every == 0:
            trainer.metrics.update(self.evaluate(trainer))

    def after_fit(self, trainer: TrainingLoop) -> None:
        if not (self.every and trainer.step % self.every == 0):
            trainer.metrics.update(self.evaluate(trainer))
            if trainer.history:
                trainer.history[-1].update(self.last)


class CheckpointHook(Hook):
    """Every ``every`` steps and at the end, rank 0 writes the full model weights atomically to
    ``folder/step_{N}/model.safetensors`` (and ``folder/model.safetensors`` at the end);
    ``state_of(engine)``: the weights written (collective; default the full state dict)."""

    priority = 60

    def __init__(
        self, folder: str | Path, every: int | None = None, state_of: Callable[[Any], dict[str, Any]] | None = None
    ) -> None:
        self.folder = Path(folder)
        self.every = every
        self.state_of = state_of or full_state_dict

    def _save(self, trainer: TrainingLoop, path: Path) -> None:
        state = self.state_of(trainer.engine)  # collective; the fp32 masters where ZeRO keeps them
        if _is_rank0(trainer):
            save_weights(state, path)

    def after_step(self, trainer: TrainingLoop) -> None:
        if self.every and trainer.step % self.every == 0:
            self._save(trainer, self.folder / f"step_{trainer.step}" / "model.safetensors")

    def after_fit(self, trainer: TrainingLoop) -> None:
        self._save(trainer, self.folder / "model.safetensors")


def _on(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def print_beside_bars(line: str) -> None:
    """Print ``line`` to stderr; a progress bar drawn there is cleared first and redrawn after,
    so the line never runs into it."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stderr)
    sys.stderr.flush()


class LogHook(Hook):
    """Rank 0 prints the metrics every ``every`` steps (to stderr, beside any progress bar) and
    appends every step's metrics to a JSON-lines file when ``jsonl`` is given."""

    priority = 90

    def __init__(self, every: int = 10, jsonl: str | Path | None = None, printer: Callable[[str], None] | None = None):
        self.every = every
        self.jsonl = Path(jsonl) if jsonl is not None else None
        self.printer = printer or print_beside_bars

    def before_fit(self, trainer: TrainingLoop) -> None:
        if self.jsonl is not None and _is_rank0(trainer):
            self.jsonl.parent.mkdir(parents=True, exist_ok=True)
            # a resumed run appends to its file (``Trainer.resumed_from``; a loop that never resumes has none)
            if getattr(trainer, "resumed_from", None) is None:
                self.jsonl.write_text("")

    def _write(self, metrics: dict[str, Any]) -> None:
        if self.jsonl is not None:
            with self.jsonl.open("a") as f:
                f.write(json.dumps(metrics) + "\n")

    def after_step(self, trainer: TrainingLoop) -> None:
        if not _is_rank0(trainer):
            return
        self._write(trainer.metrics)
        if trainer.step % self.every == 0 or trainer.step == 1:
            shown = (
                "step",
                "loss",
                "eval_loss",
                "lr",
                "samples_per_s",
                "tokens_per_s",
                "mfu",
                "peak_rss_bytes",
                "moe_imbalance",
            )
            self.printer(" ".join(f"{k}={_fmt(trainer.metrics[k])}" for k in shown if k in trainer.metrics))

    def after_fit(self, trainer: TrainingLoop) -> None:
        final = {k: v for k, v in trainer.metrics.items() if k.startswith("eval_") or k in ("step",)}
        if _is_rank0(trainer) and any(k.startswith("eval_") for k in final):
            self._write({"final": True, **final})
            self.printer("final " + " ".join(f"{k}={_fmt(v)}" for k, v in final.items()))


ProgressBar = bool | Literal["auto"]


def bar_wanted(enabled: ProgressBar, stream: TextIO) -> bool:
    """Whether to draw a bar on ``stream``: always (True), never (False), or with "auto" only
    when the stream is a terminal; in a log file a bar's carriage returns run into the lines."""
    if enabled == "auto":
        isatty = getattr(stream, "isatty", None)
        return bool(isatty and isatty())
    return bool(enabled)


class ProgressBarHook(Hook):
    """A tqdm progress bar on rank 0 with the loss in its postfix, drawn on ``stream`` (default:
    stderr). ``enabled``: "auto" (a bar only when the stream is a terminal), True or False."""

    priority = 95

    def __init__(self, enabled: ProgressBar = "auto", stream: TextIO | None = None) -> None:
        if enabled not in (True, False, "auto"):
            raise ValueError(f"ProgressBarHook(enabled={enabled!r}): use True, False or 'auto'")
        self.enabled = enabled
        self.stream = stream
        self.bar: Any = None

    def before_fit(self, trainer: TrainingLoop) -> None:
        stream = self.stream if self.stream is not None else sys.stderr
        if _is_rank0(trainer) and bar_wanted(self.enabled, stream):
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=trainer.max_steps, desc="train", unit="step", file=stream, dynamic_ncols=True, mininterval=0.5
            )

    def after_step(self, trainer: TrainingLoop) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{trainer.metrics['loss']:.4f}", refresh=False)
            self.bar.update(1)

    def after_fit(self, trainer: TrainingLoop) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
