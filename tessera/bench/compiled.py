"""``tessera bench compile``: compiled training against eager training, and against torch FSDP2 with
each block compiled, on CPU.

For each layout on 2 ranks (``dp2``; ``zero3-dp2``; ``tp1d-tp2``, 1D tensor parallelism;
``pp2-1f1b``, two pipeline stages under 1F1B; ``sp2-ring``, ring attention over the sequence
axis) and each model (GPT-2 small, 124M, and GPT-2 medium, 355M, over 128-token sequences; 4
sequences a step), one engine is built as a user builds a compiled run:
``use_layout(config={..., "compile": {"enabled": True}})``, ``tessera.initialize(model,
AdamW(fused=True), NextTokenLoss())`` (each transformer block compiled by inductor on its own),
``engine.train_batch(...)``. Its sides, every one trained with ``torch.optim.AdamW(fused=True)``
(torch's default AdamW on CPU steps the tensors one by one: a third of GPT-2 small's step here):

- ``tessera compiled``: the engine's step;
- ``tessera eager``: the same engine's step with every compiled function run as plain eager code
  (``torch.compiler.set_stance("force_eager")``): the same weights, optimizer and strategy, so
  that GPT-2 medium's single copy per rank fits this machine's memory. Under ZeRO-3 the eager
  side gathers each block's chunks once around the block, as the compiled side does (eager
  tessera without ``compile`` gathers them around each layer of the block, the same chunks);
- beside ``zero3-dp2`` only, ``torch FSDP2 + per-block compile``: torchtitan's recipe on the same
  model: each block ``torch.compile``'d, then ``fully_shard`` on every block and on the root.

The global batch is the same in every layout: under data parallelism each rank takes 2 of the 4
sequences; the ranks of a tensor, pipeline or sequence group take all 4 (the pipeline as 4
micro-batches of one sequence; the sequence axis splits each sequence in two).

Timing: every side runs one eager step first (``force_eager``: optimizer states, buffers,
FSDP2's lazy set-up), then its first compiled step (``compile_cold_s``: its time less the median
compiled step; inductor's caches in a new directory of the side's own, the in-memory ones
emptied), then the sides alternate in blocks of steps (ABC, then CBA;
:func:`tessera.bench.timing.alternate`), each block timed between barriers with the slowest
rank's time; the value is the median over blocks of the time per step. ``tokens_per_s``: the
global batch's tokens over it. ``compile_warm_s``: a second run of the same sides in fresh
processes reusing each side's cache directory (inductor's FX graph cache and AOT autograd's
cache), its first compiled step less its second.

MFU (:func:`tessera.engine.flops.mfu`, as the trainer logs it): the model's FLOPs per token (GPT's
``6 N + 12 L d s``, :meth:`tessera.models.gpt.GPT.flops_per_token`) times tokens/s over the two
ranks' peak, an fp32 matmul on one thread (:func:`tessera.engine.peak.measure_matmul_peak`)
measured on both ranks at once in every timed run (the run's best; not the cached peak, which a
quiet machine measured).

Where the code is: the workload, the layouts, the sides and what each rank runs in
:mod:`tessera.bench.compiled_sides`; this module starts the pools (a fresh one per run and
layout, so that every cold compile is a new process's) and turns the measurements into rows.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tessera.bench.compiled_sides import (
    COMPILED,
    EAGER,
    FSDP2,
    LAYOUTS,
    RANKS,
    STARTUP,
    Workload,
    timing_body,
    warm_body,
)
from tessera.bench.pools import rank_pool
from tessera.bench.report import Row, print_rows, write_rows
from tessera.engine.flops import flops_per_token, mfu

if TYPE_CHECKING:
    from tessera.testing import PoolSet

#: the models: GPT-2 small and medium over 128-token sequences, 4 sequences a step
WORKLOADS = {"gpt2": Workload("gpt2"), "gpt2-medium": Workload("gpt2-medium")}
#: what a run without ``--only gpt2-medium`` measures (GPT-2 medium's five layouts take 12 minutes more)
DEFAULT_MODELS = ("gpt2",)


@dataclass
class Result:
    """What one layout of one workload measured: per side, the block times, the first compiled
    step, the warm compile and the losses of its steps (mean over the replicas); the matmul peak
    of every rank; tessera's compile report; the sides that could not run, with their errors."""

    layout: str
    workload: Workload
    times: dict[str, list[float]]
    first: dict[str, float]
    warm: dict[str, float]
    peaks: list[float]
    losses: dict[str, list[float]] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.layout} {self.workload.tag}"

    def step(self, label: str) -> float:
        return statistics.median(self.times[label])

    def cold(self, label: str) -> float:
        return self.first[label] - self.step(label)


def measure(w: Workload, layout: str, blocks: int, steps: int, peak_size: int = 2048,
            pools: PoolSet | None = None) -> Result:  # fmt: skip
    """The timed run of ``layout`` on a fresh pool (its cold compiles a new process's), then its
    warm-cache run on another (or both on ``pools``' pool); each compiled side's inductor caches
    in a temporary directory of its own, removed after."""
    root = tempfile.mkdtemp(prefix="tessera-bench-compile-")
    try:
        caches = {label: str(Path(root) / label.split()[0].lower()) for label in (COMPILED, FSDP2, STARTUP)}
        print(f"  {layout} {w.tag}: timed run", file=sys.stderr, flush=True)
        with rank_pool(RANKS, pools) as pool:
            timed = pool.run(timing_body, w, layout, blocks, steps, caches, peak_size, timeout=3600)
        print(f"  {layout} {w.tag}: warm-cache run", file=sys.stderr, flush=True)
        with rank_pool(RANKS, pools) as pool:  # fresh processes: nothing compiled in memory
            warm = pool.run(warm_body, w, layout, caches, timeout=1800)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = timed[0]
    return Result(layout, w, out["times"], out["first"], warm, [r["peak"] for r in timed], out["losses"],
                  out["report"], out["errors"])  # fmt: skip


def tokens_per_step(w: Workload) -> int:
    return w.global_batch * w.seq_len


def per_token(w: Workload) -> float:
    with torch.device("meta"):
        return flops_per_token(w.model(), w.seq_len)


def rows_of(result: Result, peak: float) -> list[Row]:
    """The rows of one layout: tessera compiled against tessera eager (tokens/s, MFU, step time,
    the cold compile against an eager step, the warm compile against the cold); beside ZeRO-3,
    against FSDP2 with per-block compile (step time, tokens/s, MFU, cold and warm compile)."""
    w, name = result.workload, result.name
    tokens, flops = tokens_per_step(w), per_token(w)

    def util(label: str) -> float:
        return mfu(tokens / result.step(label), flops, RANKS, peak)

    ours, eager = result.step(COMPILED), result.step(EAGER)
    rows = [
        Row(name, "tokens_per_s", tokens / ours, EAGER, tokens / eager),
        Row(name, "mfu", util(COMPILED), EAGER, util(EAGER)),
        Row(name, "step_time_s", ours, EAGER, eager),
        Row(name, "compile_cold_s", result.cold(COMPILED), f"{EAGER} step", eager),
        Row(name, "compile_warm_s", result.warm[COMPILED], "cold compile", result.cold(COMPILED)),
    ]
    if FSDP2 in result.times:
        theirs = result.step(FSDP2)
        rows += [
            Row(name, "step_time_s", ours, FSDP2, theirs),
            Row(name, "tokens_per_s", tokens / ours, FSDP2, tokens / theirs),
            Row(name, "mfu", util(COMPILED), FSDP2, util(FSDP2)),
            Row(name, "compile_cold_s", result.cold(COMPILED), FSDP2, result.cold(FSDP2)),
            Row(name, "compile_warm_s", result.warm[COMPILED], FSDP2, result.warm[FSDP2]),
        ]
    return rows


def table(results: list[Result], peak: float) -> str:
    """Every side of every layout as a markdown table."""
    lines = [
        "| layout | side | step time (s) | tokens/s | MFU | vs eager | cold compile (s) | warm compile (s) | graphs, breaks |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for result in results:
        w, eager = result.workload, result.step(EAGER)
        tokens, flops = tokens_per_step(w), per_token(w)
        for label in (EAGER, COMPILED, FSDP2):
            if label not in result.times:
                if label in result.errors:
                    lines.append(f"| {result.name} | {label} | | | | | | | did not run: {result.errors[label]} |")
                continue
            step = result.step(label)
            compiled = label != EAGER
            graphs = ""
            if label == COMPILED:
                stats = result.report.values()
                breaks = sum(sum(s["graph_breaks"].values()) for s in stats)
                graphs = f"{sum(s['graphs'] for s in stats)}, {breaks}"
            lines.append(
                f"| {result.name} | {label} | {step:.3f} | {tokens / step:,.0f} | "
                f"{mfu(tokens / step, flops, RANKS, peak):.1%} | {eager / step:.3f} | "
                + (f"{result.cold(label):.1f} | {result.warm[label]:.1f} | {graphs} |" if compiled else "| | |")
            )
    return "\n".join(lines)


def run(
    workloads: list[Workload] | None = None,
    layouts: tuple[str, ...] = LAYOUTS,
    blocks: int = 4,
    steps: int = 1,
    peak_size: int = 2048,
    pools: PoolSet | None = None,
    report: dict[str, Any] | None = None,
) -> list[Row]:
    """The rows of every layout for every workload (default: GPT-2 small, :data:`DEFAULT_MODELS`);
    a layout whose run fails on a rank is left out, the others still run. ``report``, when given,
    receives the results, the failures, the peak and the markdown table."""
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown:
        raise ValueError(f"unknown layout(s) {', '.join(unknown)}; layouts: {', '.join(LAYOUTS)}")
    from tessera.testing import RankFailure

    results, failures = [], {}
    for w in workloads or [WORKLOADS[name] for name in DEFAULT_MODELS]:
        for layout in layouts:
            try:
                results.append(measure(w, layout, blocks, steps, peak_size, pools))
            except RankFailure as exc:  # the other layouts still run: a long run keeps what it measured
                failures[f"{layout} {w.tag}"] = str(exc)
                print(f"  {layout} {w.tag} failed:\n{exc}", file=sys.stderr, flush=True)
    peak = max((p for r in results for p in r.peaks), default=float("nan"))  # the machine's best: load only lowers it
    rows = [row for result in results for row in rows_of(result, peak)]
    if report is not None:
        report.update(results=results, failures=failures, peak=peak, table=table(results, peak))
    return rows


def selection(only: str | None) -> tuple[list[Workload], tuple[str, ...]]:
    """The workloads and layouts that ``--only`` names (comma-separated layouts and models); without
    a layout named, every layout; without a model named, :data:`DEFAULT_MODELS`."""
    names = [n.strip() for n in (only or "").split(",") if n.strip()]
    unknown = [n for n in names if n not in LAYOUTS and n not in WORKLOADS]
    if unknown:
        raise ValueError(f"--only {', '.join(unknown)}: not a layout ({', '.join(LAYOUTS)}) or a model "
                         f"({', '.join(WORKLOADS)})")  # fmt: skip
    models = [n for n in names if n in WORKLOADS] or list(DEFAULT_MODELS)
    return [WORKLOADS[n] for n in models], tuple(n for n in names if n in LAYOUTS) or LAYOUTS


def _load() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "unknown"


def main(args: argparse.Namespace) -> int:
    from tessera.errors import ConfigError

    try:
        workloads, layouts = selection(getattr(args, "only", None))
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    before = _load()
    report: dict[str, Any] = {}
    rows = run(workloads, layouts, report=report)
    print_rows(rows)
    print(report["table"])
    print(f"matmul peak per rank (fp32, one thread): {report['peak'] / 1e9:.1f} GFLOP/s")
    if report["results"]:
        cold = [r.first[STARTUP] for r in report["results"]]
        warm = [r.warm[STARTUP] for r in report["results"]]
        print(f"the compiler's start-up (a small compile before the first side's, in no row): {min(cold):.1f}-"
              f"{max(cold):.1f} s with an empty cache, {min(warm):.1f}-{max(warm):.1f} s with a warm one")  # fmt: skip
    print(f"load average: before {before}; after {_load()}")
    for result in report["results"]:
        for label, error in result.errors.items():
            print(f"{result.name}: {label} could not run here, its rows are absent: {error}", file=sys.stderr)
    for name, error in report["failures"].items():
        print(f"{name} failed, its rows are absent:\n{error}", file=sys.stderr)
    if args.out:
        write_rows(rows, args.out)
    return 1 if report["failures"] else 0


__all__ = [
    "DEFAULT_MODELS",
    "WORKLOADS",
    "Result",
    "Workload",
    "main",
    "measure",
    "rows_of",
    "run",
    "selection",
    "table",
]
