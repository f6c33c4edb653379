"""``tessera bench zero``: tessera's ZeRO stages against torch FSDP2 and DeepSpeed ZeRO, on CPU.

Every side trains its own copy of the same GPT (same seed, so the same initial weights) with
``torch.optim.AdamW`` on the same micro-batches, on the same ranks (gloo, one intra-op thread per
rank), used the way its users use it:

- tessera: ``use_layout(config={"parallel": {"data": N}, "zero": {...}, "mixed_precision": {...}})``,
  ``tessera.initialize(model, AdamW, criterion)``, ``engine.train_batch(iter([(x, y)]))``;
- torch FSDP2: ``fully_shard`` on every block, then on the root (ZeRO-3); with
  ``reshard_after_forward=False`` the parameters stay gathered from forward to backward, which
  is what ZeRO-2 keeps (sharded gradients and optimizer states, whole parameters in the step);
- DeepSpeed: ``deepspeed.initialize`` with a config dict (``zero_optimization.stage`` 1/2/3;
  ZeRO-Offload is stage 2 with ``offload_optimizer.device = "cpu"`` and DeepSpeed's own
  ``DeepSpeedCPUAdam``, torch AdamW where that op cannot be built), its CPU accelerator
  (``DS_ACCELERATOR=cpu``) on the process group tessera already started.

Rows, for each world size N: ``zero1 dpN`` (tessera stage 1 vs DeepSpeed ZeRO-1), ``zero2 dpN``
(stage 2 vs DeepSpeed ZeRO-2 and FSDP2 without resharding), ``zero3 dpN`` (stage 3 vs FSDP2 and
DeepSpeed ZeRO-3), ``offload dpN`` (stage 2 with the optimizer on the host vs DeepSpeed
ZeRO-Offload). DeepSpeed is optional (``pip install 'tessera[bench]'``): without it its rows
are absent and the run says so.

Step time: the sides of one row group are built in one rank pool and run in alternating blocks
of steps (ABAB, then BABA; ``tessera.bench.timing``), each block timed between barriers with the
slowest rank's time; the value is the median over blocks of the time per step.

Peak memory, per rank above a baseline, the largest over the ranks (``reset_peak_rss`` then
``peak_rss_bytes``, i.e. VmHWM): ``peak_rss_setup_bytes`` while the side sets up (the user code
builds the full model, the side shards or wraps it and makes its optimizer), and
``peak_rss_train_bytes`` while it then trains a few steps: what stays after set-up (sharded
parameters, gradient buffers, optimizer states once they exist) plus what training adds
(activations, gathered parameters, communication buffers). Before the baseline and again before
training, garbage is collected and glibc's ``malloc_trim`` returns freed heap to the system, so
that the full model a sharding side lets go of after set-up does not count against training.
Each side is measured in a fresh rank pool of its own, because a process that has already run
another side keeps that side's freed memory in its allocator and would hand it to the next side
without raising the RSS: measured in turn in one process, whichever side comes later looks
smaller. Before the baseline, the fresh process runs the same side once on a miniature GPT (one
block of width 16), so that imports and lazy one-time set-up (DeepSpeed's comm backend and
JIT-built ops, autograd's and gloo's threads) are paid outside the measurement while the
miniature leaves next to nothing behind.

After the timed blocks every side has taken the same steps on the same data; each evaluates its
loss on one micro-batch, and the run reports those losses, so a side that trained something
else is seen at once (fp32: they agree to about 1e-5).

Where the code is: the workload, the sides, the row groups and tessera's side in
:mod:`tessera.bench.zero_sides`; FSDP2 and DeepSpeed in :mod:`tessera.bench.zero_anchors`; what
every rank of a pool runs (timing, memory) in :mod:`tessera.bench.zero_ranks`; this module starts
the pools and turns the measurements into rows.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tessera.bench.pools import rank_pool
from tessera.bench.report import Row, print_rows, write_rows
from tessera.bench.zero_ranks import memory_body, timing_body
from tessera.bench.zero_sides import GROUPS, Side, Workload, deepspeed_available, sides_of

if TYPE_CHECKING:
    from tessera.testing import PoolSet

MEMORY_METRICS = {"setup": "peak_rss_setup_bytes", "train": "peak_rss_train_bytes"}


@dataclass
class Result:
    """What one world size measured: per side label, the block times, the memory growth, the
    loss after training, and the anchor names as reported."""

    times: dict[str, list[float]]
    memory: dict[str, dict[str, int]]
    losses: dict[str, float]
    names: dict[str, str]


def measure(
    world_size: int,
    groups: list[str],
    w: Workload,
    blocks: int,
    steps: int,
    memory_steps: int,
    with_deepspeed: bool,
    pools: PoolSet | None = None,
) -> Result:
    """Time the groups' sides on one pool and measure each side's memory on a fresh pool of its
    own; with ``pools``, all of it on ``pools``' pool (:func:`~tessera.bench.pools.rank_pool`)."""
    result = Result({}, {}, {}, {})
    with rank_pool(world_size, pools) as pool:
        for group in groups:
            out = pool.run(timing_body, sides_of(group, with_deepspeed), w, blocks, steps, timeout=1800)[0]
            result.times.update(out["times"])
            result.losses.update(out["losses"])
            result.names.update(out["names"])
    for group in groups:
        for side in sides_of(group, with_deepspeed):
            with rank_pool(world_size, pools) as pool:  # fresh processes: see the module docstring
                grown = pool.run(memory_body, side, w, memory_steps, timeout=900)
            if all(g is not None for g in grown):  # the largest over the ranks
                result.memory[side.label] = {k: max(g[k] for g in grown if g is not None) for k in MEMORY_METRICS}
    return result


def rows_of(world_size: int, groups: list[str], w: Workload, result: Result, with_deepspeed: bool) -> list[Row]:
    rows: list[Row] = []
    for group in groups:
        ours, *anchors = sides_of(group, with_deepspeed)
        name = f"{group} dp{world_size} {w.tag}"
        for anchor in anchors:
            anchor_name = result.names.get(anchor.label, anchor.label)
            rows.append(Row(name, "step_time_s", statistics.median(result.times[ours.label]), anchor_name,
                            statistics.median(result.times[anchor.label])))  # fmt: skip
            ours_rss, theirs_rss = result.memory.get(ours.label), result.memory.get(anchor.label)
            if ours_rss is not None and theirs_rss is not None:
                for key, metric in MEMORY_METRICS.items():
                    rows.append(Row(name, metric, float(ours_rss[key]), anchor_name, float(theirs_rss[key])))
                # the process's peak over the whole run: the larger of the two phases
                rows.append(Row(name, "peak_rss_bytes", float(max(ours_rss.values())), anchor_name,
                                float(max(theirs_rss.values()))))  # fmt: skip
    return rows


def run(
    ranks: list[int] | None = None,
    groups: tuple[str, ...] = tuple(GROUPS),
    preset: str = "small",
    seq_len: int = 64,
    micro_batch: int = 4,
    dtype: str = "fp32",
    blocks: int = 8,
    steps: int = 2,
    memory_steps: int = 3,
    with_deepspeed: bool | None = None,
    losses: dict[str, float] | None = None,
    pools: PoolSet | None = None,
) -> list[Row]:
    """Rows for every row group on every world size in ``ranks`` (default 4). ``with_deepspeed``
    defaults to whether DeepSpeed is installed. ``losses``, when given, receives each side's loss
    on one micro-batch after training, keyed ``"<label> dpN"`` (the sides should agree).
    ``pools``: run everything on its pools instead of fresh ones (:func:`measure`)."""
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        raise ValueError(f"unknown row group(s) {', '.join(unknown)}; groups: {', '.join(GROUPS)}")
    if with_deepspeed is None:
        with_deepspeed = deepspeed_available()
    w = Workload(preset, seq_len, micro_batch, dtype)
    rows: list[Row] = []
    for world_size in ranks or [4]:
        result = measure(world_size, list(groups), w, blocks, steps, memory_steps, with_deepspeed, pools)
        rows += rows_of(world_size, list(groups), w, result, with_deepspeed)
        if losses is not None:
            losses.update({f"{label} dp{world_size}": value for label, value in result.losses.items()})
    return rows


def main(args: argparse.Namespace) -> int:
    ranks = getattr(args, "ranks", None)
    with_deepspeed = deepspeed_available()
    losses: dict[str, float] = {}
    rows = run(ranks=[ranks] if isinstance(ranks, int) else None, with_deepspeed=with_deepspeed, losses=losses)
    print_rows(rows)
    print("loss on one micro-batch after training (the sides should agree):")
    for label, value in losses.items():
        print(f"  {label:<44} {value:.6f}")
    if not with_deepspeed:
        print("DeepSpeed is not installed: its rows are absent (pip install 'tessera[bench]' to add them)")
    if args.out:
        write_rows(rows, args.out)
    return 0


__all__ = ["GROUPS", "Result", "Side", "Workload", "deepspeed_available", "main", "measure", "rows_of", "run"]
