"""Calibration: this machine's figures for the planner, measured with short runs while every rank
is busy at once (docs/planner.md, "Calibration").

``world_size`` ranks (a :class:`tessera.testing.RankPool`, one intra-op thread each) measure
together: the sustained matmul rate of one rank while all multiply (ranks sharing cores each get
their share), the rate of an AdamW step over fp32 parameters, the rate of a memory copy (the host
link of offloading), and for every collective tessera uses (all-reduce, all-gather,
reduce-scatter, broadcast, reduce, all-to-all, point-to-point) and group sizes 2, 4, 8 the time
of calls on a few message sizes, every group of that size running at once. Each collective's
times are fitted as ``latency + bytes / bandwidth`` per call, with the bytes the comm ledger
counts (logical bytes), so that the planner's byte counts convert to seconds directly.
:func:`calibrated_cluster` makes the :class:`~tessera.planner.spec.Cluster` of it.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tessera.planner.spec import Cluster, Link

#: the collectives measured (``p2p``: each rank sends to the next of its group and receives from
#: the previous, at once, as a pipeline stage does)
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "p2p")
MESSAGE_BYTES = (4 * 2**10, 128 * 2**10, 2 * 2**20)
#: the bandwidth of a link whose times do not grow with the bytes (noise), bytes/s
UNBOUNDED = 1e15


@dataclass(frozen=True)
class Sample:
    """One timed run of ``op`` on groups of ``group`` ranks: ``calls`` calls moving ``bytes``
    logical bytes per rank (the ledger's count) in ``seconds`` (mean over ranks)."""

    op: str
    group: int
    calls: int
    bytes: float
    seconds: float


@dataclass(frozen=True)
class Calibration:
    """Figures per rank with ``world_size`` ranks busy: ``flops`` (a GPT block's forward and
    backward, flop/s: what the planner divides a layout's work by), ``optimizer_rate`` (AdamW,
    bytes of fp32 parameters per second), ``copy_rate`` (memory copy, bytes/s), ``links``
    ("OP:SIZE" -> fitted :class:`Link`), ``matmul_flops`` (one bare product, flop/s), the
    ``samples`` the links were fitted on, the ``seconds`` the calibration took, and
    ``ranks_per_core``: ranks over the cores they run on (at least 1), how much faster one rank
    computes while the others wait; ``block_overhead``: seconds a block's forward and backward
    cost beyond their flops at ``flops`` (dispatch, small ops: paid once per micro-batch);
    ``recompute_cost``: a block's time under each checkpointing mode over its time without."""

    world_size: int
    flops: float
    optimizer_rate: float
    copy_rate: float
    links: dict[str, Link]
    matmul_flops: float = 0.0
    samples: tuple[Sample, ...] = field(default=(), repr=False)
    seconds: float = 0.0
    ranks_per_core: float = 1.0
    block_overhead: float = 0.0
    recompute_cost: dict[str, float] = field(default_factory=dict)

    def predict(self, sample: Sample) -> float:
        """Seconds the fitted link of ``sample``'s op and group gives for its calls and bytes."""
        return self.links[f"{sample.op}:{sample.group}"].time(sample.bytes, sample.calls)


# ---- on every rank -------------------------------------------------------------------------------------


def fit_link(samples: Sequence[Sample]) -> Link:
    """``latency + bytes / bandwidth`` per call, least squares over the samples' per-call times.
    Where noise makes that unphysical, a line through the origin (no latency) if the times grow
    with the bytes, else the mean time as latency alone (bandwidth unbounded)."""
    xs = [s.bytes / s.calls for s in samples]
    ys = [s.seconds / s.calls for s in samples]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread if spread else 0.0
    latency = mean_y - slope * mean_x
    if slope > 0 and latency >= 0:
        return Link(bandwidth=1.0 / slope, latency=latency)
    if slope > 0:
        through_origin = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
        return Link(bandwidth=1.0 / through_origin, latency=0.0)
    return Link(bandwidth=UNBOUNDED, latency=mean_y)


def samples_of(per_rank: Sequence[dict[str, Any]]) -> list[Sample]:
    """Each timed run as one sample: the ledger's calls and bytes, the ranks' mean seconds."""
    out = []
    for i, (op, size, calls, nbytes, _) in enumerate(per_rank[0]["timed"]):
        seconds = statistics.fmean(r["timed"][i][4] for r in per_rank)
        out.append(Sample(op, size, calls, nbytes, seconds))
    return out


def host_memory_bytes() -> int:
    """This machine's memory (``MemTotal`` of /proc/meminfo; the physical pages otherwise)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def calibrated_cluster(
    calibration: Calibration, devices: int | None = None, device_memory: int | None = None
) -> Cluster:
    """This machine as a one-node :class:`Cluster` of ``devices`` ranks (default: the ranks
    calibrated; the rates hold for that many ranks at once): ``device_memory`` per rank (default:
    the machine's memory shared evenly), the measured matmul, AdamW and copy rates, the fitted
    links per collective and group size as ``axis_links``, and ``intra`` (= ``inter``) the
    all-reduce over the largest group measured."""
    devices = devices or calibration.world_size
    sizes = [int(key.split(":")[1]) for key in calibration.links if key.startswith("all_reduce:")]
    intra = calibration.links[f"all_reduce:{max(sizes)}"] if sizes else Link(1e9, 1e-4)
    return Cluster(
        devices=devices,
        device_memory=device_memory or host_memory_bytes() // devices,
        flops=calibration.flops,
        intra=intra,
        inter=intra,
        devices_per_node=devices,
        host_link=calibration.copy_rate,
        axis_links=dict(calibration.links),
        optimizer_rate=calibration.optimizer_rate,
        name=f"this machine, {devices} ranks (calibrated with {calibration.world_size})",
        ranks_per_core=calibration.ranks_per_core,
        block_overhead=calibration.block_overhead,
        recompute_cost=dict(calibration.recompute_cost),
    )


def describe(calibration: Calibration) -> str:
    """A few lines: the rates and each collective's fitted latency and bandwidth."""
    c = calibration
    lines = [
        f"calibrated with {c.world_size} ranks in {c.seconds:.1f} s, per rank: GPT block {c.flops / 1e9:.2f} GFLOP/s "
        f"(bare matmul {c.matmul_flops / 1e9:.2f}), AdamW {c.optimizer_rate / 1e9:.2f} GB/s, copy {c.copy_rate / 1e9:.2f} GB/s, "
        f"{c.ranks_per_core:g} ranks per core; a block pass {c.block_overhead * 1e3:.2f} ms beyond its flops, "
        + ", ".join(f"{mode} checkpointing x{cost:.2f}" for mode, cost in c.recompute_cost.items())
    ]
    for key, link in sorted(calibration.links.items()):
        lines.append(f"  {key:18s} latency {link.latency * 1e6:8.1f} us  bandwidth {link.bandwidth / 1e9:7.3f} GB/s")
    return "\n".join(lines)
