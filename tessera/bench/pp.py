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
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch
from torch import nn

from tessera.bench.report import Row, print_rows, write_rows
from tessera.bench.timing import alternate

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
) -> list[Row]:
    from tessera.testing import RankPool

    rows: list[Row] = []
    for world_size in ranks or [2, 4]:
        pool = RankPool(world_size)
        try:
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
        finally:
            pool.close()
    return rows


def main(args: argparse.Namespace) -> int:
    ranks = getattr(args, "ranks", None)
    rows = run(ranks=[ranks] if isinstance(ranks, int) else ranks)
    print_rows(rows)
    if args.out:
        write_rows(rows, args.out)
    return 0
