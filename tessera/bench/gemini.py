"""``tessera bench gemini``: Gemini against DeepSpeed ZeRO-3 with CPU and with NVMe offload, on
CPU, and a model several times the host budget trained within it.

Rows:

- ``gemini vs cpu offload``: tessera's Gemini (``auto`` placement, a device budget of half the
  rank's model state, host memory unbounded) against DeepSpeed ZeRO-3 with parameters and
  optimizer states offloaded to the CPU (``DeepSpeedCPUAdam``);
- ``gemini vs nvme offload``: Gemini (``auto``, the same device budget, a host budget of a
  quarter of the state, the rest on disk, ``map_large_buffers`` off) against DeepSpeed ZeRO-3 with parameters and
  optimizer states on NVMe (its async I/O op needs ``libaio-dev``).

Every side trains the same GPT (same seed and initial weights) with AdamW on the same
micro-batches on the same 2 ranks (gloo, one thread per rank). Step time: both sides of a row are
built in one rank pool and timed in alternating blocks (``tessera.bench.timing``); the median
over blocks. Peak RSS: each side in a fresh pool, warmed up on a miniature model first, the
largest over the ranks of the peak above the baseline while it sets up and trains (VmHWM,
reset through ``/proc/self/clear_refs``), as in ``tessera bench zero``.

``budget`` (:mod:`tessera.bench.gemini_budget`): a GPT whose fp32 parameters, gradients and
Adam states need more than 4x the host budget trains 3 steps on one rank under Gemini with a
disk tier (static placement, everything homed off the device), built deferred; its peak RSS is
compared with baseline RSS + host budget + 25% + one micro-batch's activations (plain
PyTorch's forward growth for that batch), its losses with single-process PyTorch run in a
separate process. ``largest`` (:mod:`tessera.bench.gemini_largest`): the largest GPT each
system trains under one memory budget per rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tessera.bench.gemini_budget import BudgetRun, budget_rows
from tessera.bench.gemini_common import deepspeed_offload, peak_growth
from tessera.bench.gemini_largest import Largest, largest_rows
from tessera.bench.pools import rank_pool
from tessera.bench.report import Row, print_rows, write_rows
from tessera.bench.timing import alternate
from tessera.bench.zero_sides import LossFn, StepFn, Workload, batches_of, deepspeed_available, model_of

if TYPE_CHECKING:
    from tessera.testing import PoolSet

_MIB = 2**20


@dataclass(frozen=True)
class Side:
    """``system``: "tessera" (Gemini) or "deepspeed"; ``offload``: "cpu" or "nvme"."""

    system: str
    offload: str

    @property
    def label(self) -> str:
        if self.system == "tessera":
            return "tessera gemini auto" + (" +disk" if self.offload == "nvme" else "")
        return f"DeepSpeed ZeRO-3 {self.offload} offload"


ROWS = {"cpu": (Side("tessera", "cpu"), Side("deepspeed", "cpu")),
        "nvme": (Side("tessera", "nvme"), Side("deepspeed", "nvme"))}  # fmt: skip


def state_bytes_per_rank(w: Workload, world: int) -> int:
    """fp32 parameters, gradients and Adam's two states of the workload's GPT, per rank."""
    import tessera

    with tessera.deferred_init():
        model = model_of(w)
    return 16 * sum(p.numel() for p in model.parameters()) // world


def build(side: Side, w: Workload, folder: str) -> tuple[StepFn, LossFn, Any]:
    """``side`` on this rank: a training step, the loss of a batch, and a closer."""
    world = torch.distributed.get_world_size()
    if side.system == "tessera":
        return _build_gemini(side, w, folder, world)
    return _build_deepspeed(side, w, folder, world)


def _build_gemini(side: Side, w: Workload, folder: str, world: int) -> tuple[StepFn, LossFn, Any]:
    import tessera
    from tessera.models import NextTokenLoss
    from tessera.testing import use_layout

    state = state_bytes_per_rank(w, world)
    gemini: dict[str, Any] = {"placement": "auto", "device_budget": state // 2 + 64 * _MIB, "chunk_mb": 4}
    if side.offload == "nvme":
        # map_large_buffers off: this row measures speed (the budget row keeps the resident set
        # on the ledger, at the price of fresh pages for every large buffer)
        gemini.update(host_budget=max(state // 4, 8 * _MIB), offload_dir=folder, map_large_buffers=False)
    if w.miniature:
        gemini = {"enabled": True, "placement": "auto"}
    use_layout(config={"parallel": {"data": world}, "gemini": gemini})
    with tessera.deferred_init():
        model = model_of(w)
    engine, *_ = tessera.initialize(model, torch.optim.AdamW(model.parameters(), lr=w.lr), NextTokenLoss())

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        engine.train_batch(iter([(x, y)]))

    def loss(x: torch.Tensor, y: torch.Tensor) -> float:
        with torch.no_grad():
            return float(engine.criterion(engine(x), y))

    return step, loss, engine.strategy.close


def _build_deepspeed(side: Side, w: Workload, folder: str, world: int) -> tuple[StepFn, LossFn, Any]:
    step, loss = deepspeed_offload(model_of(w), side.offload, folder, w.micro_batch, w.lr)
    return step, loss, lambda: None


def _prepare(side: Side) -> None:
    if side.system == "deepspeed":
        from tessera.bench.zero_anchors import _deepspeed

        _deepspeed(load_cpu_adam=True)


def timing_body(pair: tuple[Side, Side], w: Workload, blocks: int, steps: int) -> dict[str, Any]:
    """Both sides of a row built on this rank, timed in alternating blocks, then evaluated."""
    from tessera.testing import use_layout

    world = use_layout(config={}).group("world")
    built = {}
    with tempfile.TemporaryDirectory() as folder:
        for side in pair:
            _prepare(side)
            built[side] = build(side, w, f"{folder}/{side.system}")
        batches = batches_of(w, world.rank, steps)

        def block_of(step: StepFn) -> Any:
            def block() -> None:
                for x, y in batches:
                    step(x, y)

            return block

        blocks_by_side = {side.label: block_of(step) for side, (step, _, _) in built.items()}
        for block in blocks_by_side.values():  # warm-up (Gemini's trace, DeepSpeed's buffers)
            block()
        times = alternate(blocks_by_side, blocks, steps, world)
        x, y = batches[0]
        losses = {side.label: loss(x, y) for side, (_, loss, _) in built.items()}
        for _, _, close in built.values():
            close()
    return {"times": times, "losses": losses}


def memory_body(side: Side, w: Workload, steps: int) -> int | None:
    """This rank's peak RSS above its baseline while ``side`` sets up and trains ``steps`` steps
    (a fresh pool; warmed up on a miniature model first)."""
    from tessera.testing import use_layout

    world = use_layout(config={}).group("world")
    _prepare(side)
    with tempfile.TemporaryDirectory() as folder:

        def built(workload: Workload, sub: str) -> tuple[StepFn, Callable[[], None]]:
            step, _, close = build(side, workload, f"{folder}/{sub}")
            return step, close

        return peak_growth(
            lambda: built(dataclasses.replace(w, miniature=True), "warm"),
            lambda: built(w, "run"),
            batches_of(w, world.rank, steps),
        )


# ---- the rows ------------------------------------------------------------------------------------


def run(
    w: Workload | None = None, world: int = 2, blocks: int = 6, steps: int = 2, memory_steps: int = 3,
    rows_wanted: tuple[str, ...] = ("cpu", "nvme"), losses: dict[str, float] | None = None,
    pools: PoolSet | None = None,
) -> list[Row]:  # fmt: skip
    """Step time and peak RSS rows for each wanted row ("cpu", "nvme"), each measurement on a
    fresh pool, or on ``pools``' (:func:`~tessera.bench.pools.rank_pool`)."""
    w = w or Workload("small", 64, 4)
    rows: list[Row] = []
    for key in rows_wanted:
        pair = ROWS[key]
        with rank_pool(world, pools) as pool:
            out = pool.run(timing_body, pair, w, blocks, steps, timeout=3600)[0]
        if losses is not None:
            losses.update(out["losses"])
        peaks = {}
        for side in pair:
            with rank_pool(world, pools) as pool:
                grown = pool.run(memory_body, side, w, memory_steps, timeout=1800)
            if all(g is not None for g in grown):
                peaks[side.label] = max(g for g in grown if g is not None)
        ours, theirs = pair
        name = f"gemini vs {key} dp{world} {w.tag}"
        rows.append(Row(name, "step_time_s", statistics.median(out["times"][ours.label]), theirs.label,
                        statistics.median(out["times"][theirs.label])))  # fmt: skip
        if ours.label in peaks and theirs.label in peaks:
            rows.append(Row(name, "peak_rss_bytes", float(peaks[ours.label]), theirs.label, float(peaks[theirs.label])))
    return rows


def nvme_available() -> bool:
    """Whether DeepSpeed's async I/O op (its NVMe offload) can be built here (it needs libaio)."""
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        return bool(AsyncIOBuilder().is_compatible(verbose=False))
    except Exception:  # any failure: the row cannot run
        return False


def main(args: argparse.Namespace) -> int:
    rows: list[Row] = []
    losses: dict[str, float] = {}
    if deepspeed_available():
        wanted = ("cpu", "nvme") if nvme_available() else ("cpu",)
        if "nvme" not in wanted:
            print("DeepSpeed's NVMe offload needs its async I/O op, which needs libaio (apt install libaio-dev): "
                  "the nvme row is absent")  # fmt: skip
        rows += run(rows_wanted=wanted, losses=losses)
    else:
        print("DeepSpeed is not installed: its rows are absent (pip install 'tessera[bench]' to add them)")
    budget, outcome = budget_rows(BudgetRun())
    rows += budget
    search = Largest()
    found_rows, found = largest_rows(search, deepspeed_available(), deepspeed_available() and nvme_available())
    rows += found_rows
    print_rows(rows)
    if losses:
        print("loss on one micro-batch after training (the sides should agree):")
        for label, value in losses.items():
            print(f"  {label:<36} {value:.6f}")
    ours, reference = outcome["gemini"], outcome["reference"]
    print(
        f"budget run: {ours['params']:,} parameters, {outcome['state_bytes'] / _MIB:.0f} MiB of fp32 state, host budget "
        f"{BudgetRun().host_budget / _MIB:.0f} MiB; baseline RSS {ours['baseline'] / _MIB:.0f} MiB, peak "
        f"{ours['peak'] / _MIB:.0f} MiB, bound {outcome['bound'] / _MIB:.0f} MiB (one micro-batch's activations: "
        f"{reference['activation_bytes'] / _MIB:.1f} MiB of forward growth in plain PyTorch, "
        f"{(ours['report']['activation_bytes'] or 0) / _MIB:.1f} MiB saved for backward by the tracer's count); "
        f"disk written {ours['report']['disk_written_bytes'] / _MIB:.0f} MiB"
    )
    print("  losses gemini   ", " ".join(f"{v:.6f}" for v in ours["losses"]))
    print("  losses reference", " ".join(f"{v:.6f}" for v in reference["losses"]))
    print(f"largest GPT (width {search.d_model}) under {search.budget / _MIB:.0f} MiB per rank above the baseline:")
    for system, (params, seen) in found.items():
        tried = ", ".join(f"{n} blocks: {'failed' if g is None else f'{g / _MIB:.0f} MiB'}" for n, g in seen.items())
        print(f"  {system:<16} {params:>12,} parameters  ({tried})")
    if args.out:
        write_rows(rows, args.out)
    return 0


__all__ = ["ROWS", "BudgetRun", "Side", "budget_rows", "main", "nvme_available", "run"]
