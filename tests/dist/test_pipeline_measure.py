"""``PipelineRuntime.run(..., measure=True)``: the measured bubble matches the schedule's
simulated idle fraction on stages of known cost, and the peak saved-activation bytes per stage
follow the schedule (GPipe holds all m micro-batches, 1F1B at most p)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

from tessera.parallel.pipeline import build_schedule
from tessera.parallel.pipeline.partition import chunks_of_rank, uniform
from tessera.parallel.pipeline.runtime import PipelineRuntime, StepMeasure, build_chunks
from tessera.parallel.pipeline.simulate import simulate
from tessera.testing import use_layout

UNIT_S = 0.05  # one cost unit: a forward sleeps 1 unit, a backward 2
REPEATS = 3


class _Sleep(torch.autograd.Function):
    """``x * w`` whose forward sleeps one unit and backward two: stage costs F = 1, BW = 2 no
    matter how loaded the CPU is, with trivial real compute."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        time.sleep(UNIT_S)
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(2 * UNIT_S)
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum()


class SleepStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.w)


def _sum_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return out.sum()


def body_timing(schedule: str, p: int, m: int) -> list[tuple[float, float]]:
    ctx = use_layout(pipeline=p)
    group, rank = ctx.group("pipeline"), ctx.local_rank("pipeline")
    blocks = [SleepStage() for _ in range(p)]
    chunks = build_chunks(blocks, uniform(p, p), chunks_of_rank(rank, p, 1))
    runtime = PipelineRuntime(chunks, build_schedule(schedule, p, m)[rank], p, _sum_loss, group)
    inputs = [torch.ones(2, 2) for _ in range(m)]
    runtime.run(inputs, inputs)  # warm-up: the first step also exchanges shape headers
    out = []
    for _ in range(REPEATS):
        runtime.run(inputs, inputs, measure=True)
        stats = runtime.last_measure
        assert stats is not None
        out.append((stats.busy_s, stats.step_s))
    runtime.run(inputs, inputs)  # measurement off: last_measure keeps the previous step's
    assert runtime.last_measure is stats
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_measured_bubble_matches_simulation(pools, schedule):
    p, m = 2, 4
    results = pools.run(p, body_timing, schedule, p, m)
    predicted = float(simulate(build_schedule(schedule, p, m), costs={"F": 1, "B": 1, "W": 1}).idle_fraction)
    measured = []
    for repeat in range(REPEATS):
        busy = [results[r][repeat][0] for r in range(p)]
        step = max(results[r][repeat][1] for r in range(p))
        assert all(b >= m * 3 * UNIT_S for b in busy)  # m forwards and m backwards slept on every rank
        measured.append(1 - sum(busy) / (p * step))
    best = min(measured)  # overheads (p2p, Python) only add idle time
    print(f"{schedule}: predicted bubble {predicted:.4f}, measured {[round(x, 4) for x in measured]}")
    assert abs(best - predicted) <= 0.1 * predicted, (measured, predicted)


BLOCKS = 8
WIDTH = 16
CLASSES = 4
MICRO = 8


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(BLOCKS)]
    blocks[-1].append(nn.Linear(WIDTH, CLASSES))
    return nn.Sequential(*blocks)


def saved_bytes_of_one_forward(chunk: nn.Module, x: torch.Tensor, target: torch.Tensor | None) -> int:
    """Bytes one forward of ``chunk`` (plus the loss on the last stage) saves for backward,
    parameters excluded, each tensor counted once."""
    params = {q.untyped_storage().data_ptr() for q in chunk.parameters()}
    seen: dict[tuple[int, tuple[int, ...], tuple[int, ...]], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            seen[(t.data_ptr(), tuple(t.shape), tuple(t.stride()))] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = chunk(x)
        if target is not None:
            out = nn.functional.cross_entropy(out, target)
    return sum(seen.values())


def body_memory(schedule: str, p: int, m: int) -> tuple[StepMeasure, int]:
    ctx = use_layout(pipeline=p)
    group, rank = ctx.group("pipeline"), ctx.local_rank("pipeline")
    model = make_model()
    chunks = build_chunks(list(model), uniform(BLOCKS, p), chunks_of_rank(rank, p, 1))
    runtime = PipelineRuntime(chunks, build_schedule(schedule, p, m)[rank], p, nn.functional.cross_entropy, group)
    g = torch.Generator().manual_seed(0)
    inputs = list(torch.randn(m, MICRO, WIDTH, generator=g))
    targets = list(torch.randint(0, CLASSES, (m, MICRO), generator=g))
    runtime.run(inputs, targets, measure=True)
    stats = runtime.last_measure
    assert stats is not None
    x = inputs[0] if rank == 0 else torch.randn(MICRO, WIDTH).requires_grad_(True)
    unit = saved_bytes_of_one_forward(chunks[rank], x, targets[0] if rank == p - 1 else None)
    return stats, unit


@pytest.mark.parametrize("p", [2, 4])
def test_peak_saved_activations(pools, p):
    m = 8
    gpipe = pools.run(p, body_memory, "gpipe", p, m)
    one_f_one_b = pools.run(p, body_memory, "1f1b", p, m)
    for rank in range(p):
        for stats, unit in (gpipe[rank], one_f_one_b[rank]):
            assert unit > 0
            assert sorted(stats.saved_bytes) == [(rank, i) for i in range(m)]
            assert set(stats.saved_bytes.values()) == {unit}  # every micro-batch saves the same
            assert stats.live_saved_bytes == 0  # all released by the end of the step
        stats, unit = gpipe[rank]
        assert stats.peak_saved_bytes == m * unit
        stats, unit = one_f_one_b[rank]
        assert stats.peak_saved_bytes <= p * unit
        assert stats.peak_saved_bytes == (p - rank) * unit  # 1F1B warms up p - rank forwards
    print(
        f"p={p} m={m}: unit bytes {[u for _, u in gpipe]}, "
        f"gpipe peaks {[s.peak_saved_bytes for s, _ in gpipe]}, 1f1b peaks {[s.peak_saved_bytes for s, _ in one_f_one_b]}"
    )
