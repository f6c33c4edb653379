"""Calibration's measurements: the ranks of this machine time compute, the optimizer and each
collective together (the figures and their fit are :mod:`tessera.planner.calibrate`'s)."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from tessera.planner.calibrate import (
    MESSAGE_BYTES,
    OPS,
    Calibration,
    fit_link,
    samples_of,
)


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


def _block_times(block: tuple[int, int, int, int], seconds: float) -> tuple[float, float, float, float]:
    """A GPT block's forward and backward (tessera's Block, no parallelism) at its own shapes:
    ``(flop/s, seconds a pass costs beyond its flops, time with full checkpointing over time
    without, the same with selective)``. The rate and the fixed cost come from two batch sizes
    (``block``'s batch and a quarter of it): a pass's dispatch and small-op costs do not shrink
    with its tokens, which is what makes many small micro-batches slower than few large ones."""
    import torch

    from tessera.models.transformer import Block
    from tessera.nn.recompute import checkpoint_blocks
    from tessera.planner.spec import ModelSpec

    d_model, heads, seq, batch = block
    spec = ModelSpec("calibration", "gpt", 1, d_model, heads, 4 * d_model, 1, seq)
    layer = Block(d_model, heads, 4 * d_model, 0.0, 1e-5, causal=True)

    def seconds_per_pass(module: Any, rows: int) -> float:
        x = torch.randn(rows, seq, d_model, requires_grad=True)

        def step() -> None:
            module(x).sum().backward()

        return 1.0 / _busy_rate(step, 1.0, seconds / 3)

    small, large = max(1, batch // 4), batch
    t_small, t_large = seconds_per_pass(layer, small), seconds_per_pass(layer, large)
    flops = [3 * spec.block_forward_flops(rows * seq, seq) for rows in (small, large)]
    rate = (flops[1] - flops[0]) / (t_large - t_small) if t_large > t_small else 0.0
    overhead = t_small - flops[0] / rate if rate > 0 else -1.0
    if not 0.0 <= overhead < t_small:  # noise: no fixed cost, the large batch's rate
        rate, overhead = flops[1] / t_large, 0.0
    costs = []
    for mode in ("full", "selective"):
        wrapped = torch.nn.Sequential(Block(d_model, heads, 4 * d_model, 0.0, 1e-5, causal=True))
        checkpoint_blocks(wrapped, lambda name, module: isinstance(module, Block), mode=mode)
        costs.append(max(1.0, seconds_per_pass(wrapped, large) / t_large))
    return rate, overhead, costs[0], costs[1]


#: figures a rank measures that are rates (each rank's share of the cores when ranks share them)
_RATES = ("matmul_flops", "flops", "optimizer_rate", "copy_rate")


def _compute_rates(matmul: tuple[int, int, int], block: tuple[int, int, int, int], seconds: float) -> dict[str, float]:
    """This rank's figures, named as :class:`Calibration`'s fields: the rates of a bare matmul
    (flop/s), a GPT block (flop/s), AdamW (bytes/s of parameters) and a copy (bytes/s); a block
    pass's fixed seconds; full and selective checkpointing's time factors."""
    import torch

    m, k, n = matmul
    a, b, out = torch.randn(m, k), torch.randn(k, n), torch.empty(m, n)
    matmul_rate = _busy_rate(lambda: torch.mm(a, b, out=out), 2.0 * m * k * n, seconds / 2)
    block_rate, overhead, full, selective = _block_times(block, seconds)
    numel = 2**20
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel)
    adam = torch.optim.AdamW([param], lr=1e-3)
    src, dst = torch.randn(4 * numel), torch.empty(4 * numel)
    return {
        "matmul_flops": matmul_rate,
        "flops": block_rate,
        "optimizer_rate": _busy_rate(adam.step, 4.0 * numel, seconds / 2),
        "copy_rate": _busy_rate(lambda: dst.copy_(src), 16.0 * numel, seconds / 4),
        "block_overhead": overhead,
        "full": full,
        "selective": selective,
    }


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


def _timed(work: Any, op: str | None, tensor: Any, group: Any, world: Any, calls: int) -> float:
    """Seconds of ``calls`` rounds of ``work()`` followed by one ``op`` (none: ``work`` alone),
    started together after a barrier over the world (every group runs at once)."""
    from tessera import comm

    comm.barrier(world)
    start = time.perf_counter()
    for _ in range(calls):
        work()
        if op is not None:
            _run_op(op, tensor, group)
    return time.perf_counter() - start


def _time_ops(group: Any, world: Any, work: Any, message_bytes: Sequence[int], repeats: int, calls: int) -> list[Any]:
    """(op, group, calls, logical bytes, seconds) per op and message size on this rank: the median
    over ``repeats`` of rounds of a compute chunk and the op, less the median of the chunk alone.
    Between computes, as in training: a collective waits for its members to be scheduled, which
    on ranks sharing cores costs more than back-to-back calls show."""
    import torch

    from tessera import comm

    tensors = {
        n: torch.randn(max(2 * group.size, n // 4 // (2 * group.size) * (2 * group.size))) for n in message_bytes
    }
    counted: dict[tuple[str, int], tuple[int, float]] = {}
    for op in OPS:  # warm up each op and size, and count its ledger bytes
        for n, tensor in tensors.items():
            with comm.ledger() as led:
                _run_op(op, tensor, group)
            counted[op, n] = (led.calls(), float(led.bytes()))
    alone: list[float] = []
    runs: dict[tuple[str, int], list[float]] = {}
    for _ in range(repeats):
        alone.append(_timed(work, None, None, group, world, calls))
        for op in OPS:
            for n, tensor in tensors.items():
                runs.setdefault((op, n), []).append(_timed(work, op, tensor, group, world, calls))
    base = statistics.median(alone)
    out = []
    for (op, n), times in runs.items():
        per_call, nbytes = counted[op, n]
        seconds = max(statistics.median(times) - base, 1e-6 * calls)
        out.append((op, group.size, calls * per_call, calls * nbytes, seconds))
    return out


def measure_rank(
    groups: Sequence[int],
    message_bytes: Sequence[int],
    matmul: tuple[int, int, int],
    block: tuple[int, int, int, int],
    seconds: float,
    repeats: int,
) -> dict[str, Any]:
    """The measurements of one rank (run on every rank of a pool at once): its compute rates, and
    per group size, op and message size the collective's time between compute chunks (a
    ``matmul`` product each)."""
    import torch

    from tessera import comm
    from tessera.testing import use_layout

    torch.set_num_threads(1)
    world = use_layout().group("data")
    # compute rates on one rank per core at most, the others waiting: ranks sharing cores take
    # turns, each its share of the cores (calibrate scales), rather than all at once (a core
    # switching between busy ranks loses its caches, which training's waits in collectives spare)
    rates = _compute_rates(matmul, block, seconds) if world.rank < cpu_cores() else None
    comm.barrier(world)
    m, k, n = matmul
    a, b, out = torch.randn(m, k), torch.randn(k, n), torch.empty(m, n)

    def work() -> None:
        torch.mm(a, b, out=out)

    timed: list[Any] = []
    for size in groups:
        group = use_layout(tensor=size).group("tensor")
        timed += _time_ops(group, world, work, message_bytes, repeats, calls=4)
    use_layout()
    return {"rates": rates, "timed": timed}


# ---- fitting -------------------------------------------------------------------------------------------


def calibrate(
    world_size: int,
    *,
    pool: Any = None,
    groups: Sequence[int] | None = None,
    message_bytes: Sequence[int] = MESSAGE_BYTES,
    matmul: tuple[int, int, int] = (512, 256, 512),
    block: tuple[int, int, int, int] = (256, 8, 256, 4),
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
    samples = samples_of(per_rank)
    links = {
        f"{op}:{size}": fit_link([s for s in samples if (s.op, s.group) == (op, size)]) for op in OPS for size in groups
    }
    took, sharing = time.perf_counter() - start, max(1.0, world_size / cpu_cores())
    measured = [r["rates"] for r in per_rank if r["rates"] is not None]
    figures = {key: statistics.fmean(r[key] for r in measured) for key in measured[0]}
    for key in _RATES:  # each rank's share of the cores
        figures[key] /= sharing
    figures["block_overhead"] *= sharing  # seconds
    recompute = {mode: figures.pop(mode) for mode in ("full", "selective")}
    return Calibration(
        world_size,
        links=links,
        samples=tuple(samples),
        seconds=took,
        ranks_per_core=sharing,
        recompute_cost=recompute,
        **figures,
    )


def cpu_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# ---- the cluster -----------------------------------------------------------------------------------------
