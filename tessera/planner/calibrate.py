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
import time
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
    ``samples`` the links were fitted on and the ``seconds`` the calibration took."""

    world_size: int
    flops: float
    optimizer_rate: float
    copy_rate: float
    links: dict[str, Link]
    matmul_flops: float = 0.0
    samples: tuple[Sample, ...] = field(default=(), repr=False)
    seconds: float = 0.0

    def predict(self, sample: Sample) -> float:
        """Seconds the fitted link of ``sample``'s op and group gives for its calls and bytes."""
        return self.links[f"{sample.op}:{sample.group}"].time(sample.bytes, sample.calls)


# ---- on every rank -------------------------------------------------------------------------------------


def _busy_rate(work: Any, amount: float, seconds: float) -> float:
    """Calls ``work()`` for about ``seconds`` of wall time; ``amount`` per call per second."""
    work()  # warm up: allocations, kernels, lazy state
    count, start = 0, time.perf_counter()
    while True:
        work()
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return count * amount / elapsed


def _block_rate(block: tuple[int, int, int, int], seconds: float) -> float:
    """Flop/s of a GPT block's forward and backward (tessera's Block, no parallelism): the
    model's matmuls at its own shapes, with the elementwise work around them."""
    import torch

    from tessera.models.transformer import Block
    from tessera.planner.spec import ModelSpec

    d_model, heads, seq, batch = block
    layer = Block(d_model, heads, 4 * d_model, 0.0, 1e-5, causal=True)
    x = torch.randn(batch, seq, d_model, requires_grad=True)
    spec = ModelSpec("calibration", "gpt", 1, d_model, heads, 4 * d_model, 1, seq)

    def step() -> None:
        layer(x).sum().backward()

    return _busy_rate(step, 3 * spec.block_forward_flops(batch * seq, seq), seconds)


def _compute_rates(matmul: tuple[int, int, int], block: tuple[int, int, int, int], seconds: float) -> list[float]:
    """[matmul flop/s, block flop/s, AdamW bytes/s of parameters, copy bytes/s] on this rank."""
    import torch

    m, k, n = matmul
    a, b, out = torch.randn(m, k), torch.randn(k, n), torch.empty(m, n)
    rates = [_busy_rate(lambda: torch.mm(a, b, out=out), 2.0 * m * k * n, seconds / 2)]
    rates.append(_block_rate(block, seconds))
    numel = 2**20
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel)
    adam = torch.optim.AdamW([param], lr=1e-3)
    rates.append(_busy_rate(adam.step, 4.0 * numel, seconds / 2))
    src, dst = torch.randn(4 * numel), torch.empty(4 * numel)
    rates.append(_busy_rate(lambda: dst.copy_(src), 16.0 * numel, seconds / 4))
    return rates


def _run_op(op: str, tensor: Any, group: Any) -> None:
    from tessera import comm

    if op == "all_reduce":
        comm.all_reduce(tensor, group)
    elif op == "all_gather":
        comm.all_gather(tensor[: tensor.numel() // group.size], group)
    elif op == "reduce_scatter":
        comm.reduce_scatter(tensor, group)
    elif op == "broadcast":
        comm.broadcast(tensor, group, src=0)
    elif op == "reduce":
        comm.reduce(tensor, group, dst=0)
    elif op == "all_to_all":
        comm.all_to_all(tensor.view(group.size, -1), group, 0, 0)
    else:
        half = tensor.numel() // 2
        nxt, prev = (group.rank + 1) % group.size, (group.rank - 1) % group.size
        comm.batch_p2p([comm.P2POp("send", tensor[:half], group, nxt), comm.P2POp("recv", tensor[half:], group, prev)])


def _time_op(op: str, nbytes: int, group: Any, world: Any, calls: int, warm: bool) -> tuple[int, float, float]:
    """(calls, logical bytes, seconds) of ``calls`` calls on this rank, after a barrier over the
    world (every group runs at once) and, with ``warm``, one call untimed."""
    import torch

    from tessera import comm

    numel = max(2 * group.size, nbytes // 4 // (2 * group.size) * (2 * group.size))
    tensor = torch.randn(numel)
    if warm:
        _run_op(op, tensor, group)
    comm.barrier(world)
    with comm.ledger() as led:
        start = time.perf_counter()
        for _ in range(calls):
            _run_op(op, tensor, group)
        seconds = time.perf_counter() - start
    return led.calls(), float(led.bytes()), seconds


def measure_rank(
    groups: Sequence[int],
    message_bytes: Sequence[int],
    matmul: tuple[int, int, int],
    block: tuple[int, int, int, int],
    seconds: float,
    repeats: int,
) -> dict[str, Any]:
    """The measurements of one rank (run on every rank of a pool at once): its compute rates,
    and per group size, op and message size the median of ``repeats`` timed runs (the runs of
    all ops interleaved, so that a burst of load elsewhere does not fall on one op)."""
    import torch

    from tessera.testing import use_layout

    torch.set_num_threads(1)
    world = use_layout().group("data")
    rates = _compute_rates(matmul, block, seconds)
    timed: list[tuple[str, int, int, float, float]] = []
    for size in groups:
        group = use_layout(tensor=size).group("tensor")
        runs: dict[tuple[str, int], list[tuple[int, float, float]]] = {}
        for rep in range(repeats):
            for op in OPS:
                for nbytes in message_bytes:
                    calls = 4 if nbytes <= 2**17 else 2
                    runs.setdefault((op, nbytes), []).append(_time_op(op, nbytes, group, world, calls, rep == 0))
        for (op, _), done in runs.items():
            timed.append((op, size, done[0][0], done[0][1], statistics.median(r[2] for r in done)))
    use_layout()
    return {"rates": rates, "timed": timed}


# ---- fitting -------------------------------------------------------------------------------------------


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


def _samples(per_rank: Sequence[dict[str, Any]]) -> list[Sample]:
    """Each timed run as one sample: the ledger's calls and bytes, the ranks' mean seconds."""
    out = []
    for i, (op, size, calls, nbytes, _) in enumerate(per_rank[0]["timed"]):
        seconds = statistics.fmean(r["timed"][i][4] for r in per_rank)
        out.append(Sample(op, size, calls, nbytes, seconds))
    return out


def calibrate(
    world_size: int,
    *,
    pool: Any = None,
    groups: Sequence[int] | None = None,
    message_bytes: Sequence[int] = MESSAGE_BYTES,
    matmul: tuple[int, int, int] = (512, 256, 512),
    block: tuple[int, int, int, int] = (256, 8, 256, 2),
    seconds: float = 0.5,
    repeats: int = 3,
) -> Calibration:
    """Measure this machine with ``world_size`` ranks busy at once (a ``RankPool`` of that size:
    ``pool``, or one started and closed here). ``groups``: the group sizes (default 2, 4, 8, those
    dividing ``world_size``); ``message_bytes``: the tensor sizes each collective is timed on,
    ``repeats`` times; ``matmul``: the (m, k, n) product and ``block`` the (d_model, heads, seq,
    batch) GPT block timed for about ``seconds`` each. 20-40 s for 8 ranks with a pool's start."""
    from tessera.testing import RankPool

    if groups is None:
        groups = [g for g in (2, 4, 8) if g <= world_size and world_size % g == 0]
    start = time.perf_counter()
    ranks = RankPool(world_size) if pool is None else pool
    try:
        args = (list(groups), list(message_bytes), matmul, block, seconds, repeats)
        per_rank = ranks.run(measure_rank, *args, timeout=600)
    finally:
        if pool is None:
            ranks.close()
    samples = _samples(per_rank)
    links = {
        f"{op}:{size}": fit_link([s for s in samples if (s.op, s.group) == (op, size)]) for op in OPS for size in groups
    }
    rates = [statistics.fmean(r["rates"][i] for r in per_rank) for i in range(4)]
    return Calibration(
        world_size, rates[1], rates[2], rates[3], links, rates[0], tuple(samples), time.perf_counter() - start
    )


# ---- the cluster -----------------------------------------------------------------------------------------


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
    )


def describe(calibration: Calibration) -> str:
    """A few lines: the rates and each collective's fitted latency and bandwidth."""
    c = calibration
    lines = [
        f"calibrated with {c.world_size} ranks in {c.seconds:.1f} s, per rank: GPT block {c.flops / 1e9:.2f} GFLOP/s "
        f"(bare matmul {c.matmul_flops / 1e9:.2f}), AdamW {c.optimizer_rate / 1e9:.2f} GB/s, copy {c.copy_rate / 1e9:.2f} GB/s"
    ]
    for key, link in sorted(calibration.links.items()):
        lines.append(f"  {key:18s} latency {link.latency * 1e6:8.1f} us  bandwidth {link.bandwidth / 1e9:7.3f} GB/s")
    return "\n".join(lines)
