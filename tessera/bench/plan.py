"""``tessera bench plan``: the planner's predictions against measurement.

For each layout of :data:`LAYOUTS` (a GPT preset trained with AdamW on 4 or 8 ranks: data
parallelism, every tensor mode, pipeline schedules, ZeRO stages, activation checkpointing), the
ranks train a few steps and report their peak resident memory above the baseline taken just
before the model was built (VmHWM after a reset; the same code paths ran once on a miniature
model first, so lazy imports and one-time set-up stay outside), the memory ledger's model-state
bytes, and the median step time. Beside each: the planner's prediction for the same model,
layout and step. ``--calibrate`` measures this machine first (tessera.planner.calibrate) so that
the predicted step times can be ranked against the measured ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tessera.planner.layout import Layout

PRESET = "small"
SEQ = 256
TIMED = 5  # steps timed per layout; the median is kept


def _l(**kw: Any) -> Layout:
    return Layout(**kw)


#: (label, layout): GPT small, 8 samples of 256 tokens per step on 4 ranks (16 on 8)
LAYOUTS: list[Layout] = [
    _l(data=4, micro_batch=2),
    _l(data=4, micro_batch=1, microbatches=2),
    _l(data=4, micro_batch=2, zero=1),
    _l(data=4, micro_batch=2, zero=2),
    _l(data=4, micro_batch=2, zero=3),
    _l(data=4, micro_batch=2, zero=3, checkpoint="full"),
    _l(data=4, micro_batch=2, checkpoint="selective"),
    _l(data=2, tensor=2, micro_batch=4),
    _l(data=2, tensor=2, sequence_parallel=True, micro_batch=4),
    _l(tensor=4, micro_batch=8),
    _l(tensor=4, tensor_mode="2d", micro_batch=8),
    _l(tensor=4, tensor_mode="2d", micro_batch=8, checkpoint="full"),
    _l(data=2, pipeline=2, schedule="1f1b", microbatches=4, micro_batch=1),
    _l(data=2, pipeline=2, schedule="gpipe", microbatches=4, micro_batch=1),
    _l(pipeline=4, schedule="1f1b", microbatches=8, micro_batch=1),
    _l(pipeline=4, schedule="zero_bubble", microbatches=8, micro_batch=1),
    _l(pipeline=2, schedule="interleaved", chunks=2, microbatches=4, micro_batch=2),
    _l(data=2, pipeline=2, microbatches=2, micro_batch=2, zero=1),
    _l(data=2, sequence=2, micro_batch=4),
    _l(data=2, sequence=2, sequence_mode="all_to_all", micro_batch=4),
    _l(tensor=8, tensor_mode="2.5d", depth=2, micro_batch=16),
    _l(tensor=8, tensor_mode="3d", micro_batch=16),
    _l(data=2, tensor=4, tensor_mode="2d", micro_batch=8),
    _l(data=8, micro_batch=2, zero=2),
]


def _batches(
    layout: Layout, vocab: int, seq: int, steps: int, rank_seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank_seed)
    out = []
    for _ in range(steps * layout.microbatches):
        tokens = torch.randint(0, vocab, (layout.micro_batch, seq + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def use_planned_layout(layout: Layout):  # type: ignore[no-untyped-def]
    """This rank's context for ``layout`` (a pool's rank), with the engine's config sections
    (ZeRO, checkpointing, the pipeline's schedule) in the session."""
    from tessera.testing import use_layout

    config = layout.to_config()
    config.pop("data", None)  # the data section is tessera train's, not the engine's
    return use_layout(
        data=layout.data,
        pipeline=layout.pipeline,
        sequence=layout.sequence,
        tensor=layout.tensor,
        mode=layout.tensor_mode,
        depth=layout.depth,
        sequence_parallel=layout.sequence_parallel,
        sequence_mode=layout.sequence_mode,
        config=config,
    )


def _build(layout: Layout, preset: str, seq: int, overrides: dict[str, Any]):  # type: ignore[no-untyped-def]
    import tessera
    from tessera.models import NextTokenLoss, gpt

    with tessera.deferred_init():
        model = gpt(preset, max_seq_len=seq, **overrides)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = tessera.initialize(model, optimizer, NextTokenLoss())
    return engine, optimizer


def measure_body(layout_fields: dict[str, Any], preset: str, seq: int, steps: int, timed: int) -> dict[str, Any]:
    """On every rank: the peak RSS growth, ledger bytes and step time of ``layout``."""
    from tessera import comm
    from tessera.memory.report import (
        map_large_allocations,
        model_state_bytes,
        peak_rss_bytes,
        reset_peak_rss,
        trim_heap,
    )
    from tessera.models.gpt import PRESETS

    layout = Layout(**layout_fields)
    ctx = use_planned_layout(layout)
    map_large_allocations()
    vocab = PRESETS[preset].vocab_size
    batches = _batches(layout, vocab, seq, steps + timed, 1 + ctx.group("data").rank)
    # the same code paths once on a miniature of the model: imports and one-time set-up stay
    # outside. Every stage (and chunk) gets a block of its own: the first block a process runs
    # forward and backward sets up about 20 MiB it keeps (kernels' scratch, the autograd
    # engine), which a stage warmed up without one would count in its peak.
    tiny = {"n_layers": layout.pipeline * layout.chunks, "d_model": 64, "n_heads": 8}
    engine, _ = _build(layout, preset, seq, tiny)
    engine.train_batch(iter(batches[: layout.microbatches]))
    del engine
    gc.collect()
    trim_heap()
    comm.barrier(ctx.group("world"))
    reset_peak_rss()
    base = peak_rss_bytes()
    engine, optimizer = _build(layout, preset, seq, {})
    losses = []
    it = iter(batches)
    for _ in range(steps):
        losses.append(engine.train_batch(it))
    peak = peak_rss_bytes()
    ledger = model_state_bytes(engine.model, engine.optimizer)
    times = []
    for _ in range(timed):
        comm.barrier(ctx.group("world"))
        start = time.perf_counter()
        engine.train_batch(it)
        elapsed = torch.tensor([time.perf_counter() - start])
        comm.all_reduce(elapsed, ctx.group("world"), op="max")
        times.append(float(elapsed))
    del engine, optimizer
    gc.collect()
    trim_heap()
    assert base is not None and peak is not None
    step_s = statistics.median(times) if times else None  # timed=0: memory only
    return {"peak": peak - base, "ledger": ledger["total"], "step_s": step_s, "loss": losses[-1]}


def measure(
    layouts: list[Layout],
    preset: str = PRESET,
    seq: int = SEQ,
    steps: int = 2,
    timed: int = 3,
    start_method: str = "spawn",
) -> list[dict[str, Any]]:
    """Measure each layout on fresh ranks: a process that ran another layout before keeps part
    of what it freed resident (glibc's heaps), and a later peak would grow less above it
    (``start_method="forkserver"``: fresh ranks forked from a server that has imported torch)."""
    from tessera.testing import RankPool

    out = []
    for layout in layouts:
        pool = RankPool(layout.world, start_method=start_method)
        try:
            ranks = pool.run(measure_body, dataclasses.asdict(layout), preset, seq, steps, timed, timeout=600)
        finally:
            pool.close()
        peak = max(r["peak"] for r in ranks)
        out.append(
            {
                "layout": layout.name(),
                "fields": dataclasses.asdict(layout),
                "measured_peak": peak,
                "measured_ledger": max(r["ledger"] for r in ranks),
                "measured_step_s": ranks[0]["step_s"],
                "per_rank_peak": [r["peak"] for r in ranks],
            }
        )
        step = ranks[0]["step_s"]
        print(
            f"  {layout.name():<40} peak {peak / 2**20:8.1f} MiB"
            + (f"  step {step:.3f} s" if step is not None else ""),
            file=sys.stderr,
            flush=True,
        )
    return out


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation of ``xs`` and ``ys`` (tied values share their mean rank)."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0


def predict(rows: list[dict[str, Any]], preset: str, seq: int, clusters: dict[int, Any] | None) -> dict[str, Any]:
    """Add the planner's predictions to measured ``rows`` (in place): peak memory and model states,
    and with ``clusters`` (world size -> calibrated Cluster) the step time. Returns the summary:
    layouts within 10% of the measured peak, and with clusters the Spearman correlation of
    predicted and measured seconds per sample and how much slower the predicted best measured
    than the measured best."""
    from tessera.planner import Workload, from_gpt_preset
    from tessera.planner.memory import predict_memory
    from tessera.planner.timing import predict_time

    model = from_gpt_preset(preset, seq_len=seq)
    for row in rows:
        layout = Layout(**row["fields"])
        workload = Workload(global_batch=layout.global_batch)
        memory = predict_memory(model, layout, workload)
        row["predicted_peak"] = memory.peak
        row["predicted_states"] = memory.model_states
        row["peak_error"] = memory.peak / row["measured_peak"] - 1
        row["samples"] = layout.global_batch
        if clusters:
            row["predicted_step_s"] = predict_time(model, layout, workload, clusters[layout.world]).step
    summary: dict[str, Any] = {
        "layouts": len(rows),
        "peak_within_10pct": sum(abs(r["peak_error"]) <= 0.10 for r in rows),
        "max_peak_error": max((abs(r["peak_error"]) for r in rows), default=0.0),
    }
    if clusters and len(rows) > 1:
        measured = [r["measured_step_s"] / r["samples"] for r in rows]
        predicted = [r["predicted_step_s"] / r["samples"] for r in rows]
        chosen = min(range(len(rows)), key=predicted.__getitem__)
        best = min(range(len(rows)), key=measured.__getitem__)
        summary.update(
            spearman=spearman(predicted, measured),
            predicted_best=rows[chosen]["layout"],
            measured_best=rows[best]["layout"],
            best_gap=measured[chosen] / measured[best] - 1,
        )
    return summary


def table(rows: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """The markdown table of docs/planner.md: measured against predicted, per layout."""
    mib = 2**20
    timed = "predicted_step_s" in (rows[0] if rows else {})
    head = "| layout | ranks | measured peak (MiB) | predicted (MiB) | error | ledger (MiB) | predicted states (MiB) |"
    rule = "| --- | --- | --- | --- | --- | --- | --- |"
    if timed:
        head += " measured ms/sample | predicted ms/sample |"
        rule += " --- | --- |"
    lines = [head, rule]
    for r in rows:
        line = (
            f"| {r['layout']} | {Layout(**r['fields']).world} | {r['measured_peak'] / mib:.1f} | "
            f"{r['predicted_peak'] / mib:.1f} | {r['peak_error']:+.1%} | {r['measured_ledger'] / mib:.1f} | "
            f"{r['predicted_states'] / mib:.1f} |"
        )
        if timed:
            line += (
                f" {1e3 * r['measured_step_s'] / r['samples']:.1f} | {1e3 * r['predicted_step_s'] / r['samples']:.1f} |"
            )
        lines.append(line)
    lines.append("")
    lines.append(
        f"{summary['peak_within_10pct']} of {summary['layouts']} peaks within 10% "
        f"(largest error {summary['max_peak_error']:.1%})"
    )
    if "spearman" in summary:
        lines.append(
            f"step time per sample: Spearman {summary['spearman']:.2f}; predicted best {summary['predicted_best']} "
            f"measured {summary['best_gap']:.1%} over the measured best ({summary['measured_best']})"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if getattr(args, "scenarios", False):  # the planner's own speed, no ranks
        from tessera.bench.plan_speed import main as scenarios_main

        return scenarios_main(args)
    layouts = LAYOUTS
    if getattr(args, "only", None):
        from tessera.errors import ConfigError

        try:
            layouts = [LAYOUTS[int(i)] for i in args.only.split(",")]
        except (ValueError, IndexError) as error:
            raise ConfigError(f"--only {args.only!r}: give indices 0-{len(LAYOUTS) - 1}, comma-separated") from error
    clusters: dict[int, Any] | None = None
    calibrations: dict[int, str] = {}
    if getattr(args, "calibrate", False):  # before the layouts, on a quiet machine
        from tessera.bench.calibrate import calibrate
        from tessera.planner.calibrate import calibrated_cluster, describe

        clusters = {}
        for world in sorted({layout.world for layout in layouts}):
            calibration = calibrate(world)
            print(describe(calibration), file=sys.stderr, flush=True)
            clusters[world] = calibrated_cluster(calibration)
            calibrations[world] = describe(calibration)
    rows = measure(layouts, timed=TIMED)
    summary = predict(rows, PRESET, SEQ, clusters)
    print(table(rows, summary))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps({"summary": summary, "calibration": calibrations, "rows": rows}, indent=2) + "\n"
        )
    return 0
