"""``tessera bench pp``: tessera's pipeline step against ``torch.distributed.pipelining``.

Per schedule and world size (the world is the pipeline; data=1, tensor=1): the step time of one
optimizer step (``microbatches`` micro-batches through the schedule, then an SGD step) of an MLP
(``layers`` blocks of ``[Linear(hidden, hidden), GELU]`` and a head ``Linear(hidden, 10)``,
cross-entropy), cut into equal parts the same way on both sides (explicit boundaries), against
torch's own schedule on the same chunks and micro-batches. Both sides build the model from the
same seed and run in the same pool in alternating blocks of steps (ABAB, then BABA), each block
timed between barriers; a block's time is its slowest rank's, the value is the median over
blocks of the time per step. An informational row gives the bubble each schedule predicts
(``simulate`` with unit costs F=B=W=1) against GPipe's.

The measured bubble (GPipe and 1F1B): ``PipelineRuntime.run(..., measure=True)`` on stages that
sleep one unit in the forward and two in the backward (:class:`SleepStage`: costs F = 1, BW = 2
whatever the load, with trivial real compute), ``bubble_microbatches`` micro-batches, one rank
per stage; the bubble of a step is ``1 - sum(busy) / (p * slowest rank's step time)`` and the
value is the least over ``bubble_repeats`` steps (overheads only add idle time), against the
idle fraction ``simulate`` predicts for the same costs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tessera.bench.pools import rank_pool
from tessera.bench.report import Row, print_rows, write_rows
from tessera.bench.timing import alternate

if TYPE_CHECKING:
    from tessera.context import ParallelContext
    from tessera.parallel.pipeline.runtime import PipelineRuntime
    from tessera.testing import PoolSet

CLASSES = 10

# tessera schedule -> (torch.distributed.pipelining class, chunks per rank)
TORCH_SCHEDULES: dict[str, tuple[str, int]] = {
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved": ("ScheduleInterleaved1F1B", 2),
    "zero_bubble": ("ScheduleInterleavedZeroBubble", 1),
}


def _model(hidden: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(hidden, hidden), nn.GELU()) for _ in range(layers)]
    return nn.Sequential(*blocks, nn.Linear(hidden, CLASSES))


def _boundaries(layers: int, parts: int) -> list[int]:
    """Equal parts of the ``layers`` blocks (the head joins the last part)."""
    if layers % parts:
        raise ValueError(f"{layers} blocks do not split into {parts} equal parts")
    return [k * layers // parts for k in range(1, parts)]


def _rank_body(
    schedule: str, hidden: int, layers: int, micro_batch: int, microbatches: int, blocks: int, steps: int
) -> dict[str, list[float]]:
    import tessera
    from tessera.testing import use_layout

    torch_name, v = TORCH_SCHEDULES[schedule]
    world_size = torch.distributed.get_world_size()
    parts = world_size * v
    bounds = _boundaries(layers, parts)
    pipeline = {"size": world_size, "schedule": schedule, "microbatches": microbatches, "chunks": v,
                "partition": "explicit", "boundaries": bounds}  # fmt: skip
    ctx = use_layout(pipeline=world_size, config={"parallel": {"pipeline": pipeline}})
    world = ctx.group("world")
    criterion = nn.CrossEntropyLoss()

    ours = _model(hidden, layers)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=1e-3)
    engine, *_ = tessera.initialize(ours, opt_ours, criterion)

    from torch.distributed import pipelining

    theirs = list(_model(hidden, layers))
    edges = [0, *bounds, len(theirs)]
    rank = ctx.rank
    stage_ids = [rank + k * world_size for k in range(v)]
    stages = [
        pipelining.PipelineStage(nn.Sequential(*theirs[edges[s] : edges[s + 1]]), s, parts, torch.device("cpu"))
        for s in stage_ids
    ]
    opt_theirs = torch.optim.SGD([p for st in stages for p in st.submod.parameters()], lr=1e-3)
    cls = getattr(pipelining, torch_name)
    sched = cls(stages if v > 1 or torch_name == "ScheduleInterleavedZeroBubble" else stages[0], microbatches,
                loss_fn=nn.functional.cross_entropy)  # fmt: skip

    g = torch.Generator().manual_seed(1)
    x = torch.randn(microbatches * micro_batch, hidden, generator=g)
    y = torch.randint(0, CLASSES, (microbatches * micro_batch,), generator=g)
    micro = list(zip(x.split(micro_batch), y.split(micro_batch), strict=True))
    first, last = 0 in stage_ids, parts - 1 in stage_ids

    def tessera_block() -> None:
        for _ in range(steps):
            engine.train_batch(iter(micro))

    def torch_block() -> None:
        for _ in range(steps):
            opt_theirs.zero_grad(set_to_none=True)
            args = (x,) if first else ()
            kwargs: dict[str, Any] = {"target": y, "losses": []} if last else {}
            sched.step(*args, **kwargs)
            opt_theirs.step()

    tessera_block()  # warm-up: torch's stages allocate their buffers on the first step
    torch_block()
    return alternate({"tessera": tessera_block, "torch": torch_block}, blocks, steps, world)


class _Sleep(torch.autograd.Function):
    """``x * w`` whose forward sleeps ``unit_s`` and backward ``2 * unit_s``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, unit_s: float) -> torch.Tensor:
        time.sleep(unit_s)
        ctx.save_for_backward(x, w)
        ctx.unit_s = unit_s
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        time.sleep(2 * ctx.unit_s)
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(), None


class SleepStage(nn.Module):
    """A pipeline stage of known cost: forward one ``unit_s``, backward two, trivial compute."""

    def __init__(self, unit_s: float) -> None:
        super().__init__()
        self.unit_s = unit_s
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _Sleep.apply(x, self.w, self.unit_s)
        assert isinstance(out, torch.Tensor)
        return out


def _sum_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return out.sum()


def sleep_runtime(ctx: ParallelContext, schedule: str, m: int, unit_s: float) -> PipelineRuntime:
    """This rank's runtime of ``schedule`` over ``m`` micro-batches on one :class:`SleepStage`
    per rank of ``ctx``'s pipeline group, loss ``sum``. Feed it ``m`` tensors of any shape as
    inputs and as targets."""
    from tessera.parallel.pipeline import build_schedule
    from tessera.parallel.pipeline.partition import chunks_of_rank, uniform
    from tessera.parallel.pipeline.runtime import PipelineRuntime, build_chunks

    group, rank, p = ctx.group("pipeline"), ctx.local_rank("pipeline"), ctx.dims.pipeline
    chunks = build_chunks([SleepStage(unit_s) for _ in range(p)], uniform(p, p), chunks_of_rank(rank, p, 1))
    return PipelineRuntime(chunks, build_schedule(schedule, p, m)[rank], p, _sum_loss, group)


def _bubble_body(schedule: str, m: int, unit_s: float, repeats: int) -> list[tuple[float, float]]:
    """``(busy_s, step_s)`` of this rank in each of ``repeats`` measured steps of :func:`sleep_runtime`."""
    from tessera.testing import use_layout

    runtime = sleep_runtime(use_layout(pipeline=torch.distributed.get_world_size()), schedule, m, unit_s)
    inputs = [torch.ones(2, 2) for _ in range(m)]
    runtime.run(inputs, inputs)  # warm-up: the first step also exchanges shape headers
    out = []
    for _ in range(repeats):
        runtime.run(inputs, inputs, measure=True)
        assert runtime.last_measure is not None
        out.append((runtime.last_measure.busy_s, runtime.last_measure.step_s))
    return out


def measured_bubble(per_rank: list[list[tuple[float, float]]]) -> float:
    """The least bubble over the repeats of :func:`_bubble_body`'s per-rank results:
    ``1 - sum(busy) / (p * slowest step)``."""
    p = len(per_rank)
    bubbles = []
    for repeat in zip(*per_rank, strict=True):
        busy, step = sum(b for b, _ in repeat), max(s for _, s in repeat)
        bubbles.append(1 - busy / (p * step))
    return min(bubbles)


def predicted_bubble(schedule: str, p: int, m: int) -> float:
    """The idle fraction ``simulate`` predicts for ``schedule`` on ``p`` ranks, unit costs."""
    from tessera.parallel.pipeline import build_schedule, simulate

    v = TORCH_SCHEDULES[schedule][1]
    return float(simulate(build_schedule(schedule, p, m, v), {"F": 1, "B": 1, "W": 1}).idle_fraction)


def run(
    ranks: list[int] | None = None,
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zero_bubble"),
    hidden: int = 512,
    layers: int = 8,
    micro_batch: int = 16,
    microbatches: int = 8,
    blocks: int = 12,
    steps: int = 3,
    bubble_microbatches: int = 4,
    bubble_unit_s: float = 0.05,
    bubble_repeats: int = 3,
    pools: PoolSet | None = None,
) -> list[Row]:
    """The rows of every schedule on every world size in ``ranks`` (default 2 and 4), each world
    size on a fresh pool, or on ``pools``' (:func:`~tessera.bench.pools.rank_pool`)."""
    rows: list[Row] = []
    for world_size in ranks or [2, 4]:
        with rank_pool(world_size, pools) as pool:
            for schedule in schedules:
                times = pool.run(
                    _rank_body, schedule, hidden, layers, micro_batch, microbatches, blocks, steps, timeout=900
                )[0]
                torch_name, v = TORCH_SCHEDULES[schedule]
                name = f"pp{world_size} {schedule}{f'-v{v}' if v > 1 else ''} m{microbatches}x{micro_batch}"
                ours, theirs = statistics.median(times["tessera"]), statistics.median(times["torch"])
                rows.append(Row(name, "step_time_s", ours, f"torch.distributed.pipelining {torch_name}", theirs))
                bubble = predicted_bubble(schedule, world_size, microbatches)
                gpipe = predicted_bubble("gpipe", world_size, microbatches)
                rows.append(Row(name, "bubble_pred", bubble, "gpipe prediction", gpipe))
                if schedule in ("gpipe", "1f1b"):  # stages of a whole backward (SleepStage cannot split B and W)
                    m = bubble_microbatches
                    per_rank = pool.run(_bubble_body, schedule, m, bubble_unit_s, bubble_repeats, timeout=900)
                    rows.append(
                        Row(
                            f"pp{world_size} {schedule} m{m} sleep F1 BW2",
                            "bubble_measured",
                            measured_bubble(per_rank),
                            "simulate prediction",
                            predicted_bubble(schedule, world_size, m),
                        )
                    )
    return rows


def main(args: argparse.Namespace) -> int:
    ranks = getattr(args, "ranks", None)
    rows = run(ranks=[ranks] if isinstance(ranks, int) else ranks)
    print_rows(rows)
    if args.out:
        write_rows(rows, args.out)
    return 0
