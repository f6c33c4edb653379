"""``PipelineRuntime.run(..., measure=True)``: every rank records its busy time on stages of known
cost, and the peak saved-activation bytes per stage follow the schedule (GPipe holds all m
micro-batches, 1F1B at most p). How the measured bubble compares with the simulator's is timing,
so it is measured by ``tessera bench pp`` (its ``bubble_measured`` rows), not asserted here."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tessera.bench.pp import sleep_runtime
from tessera.parallel.pipeline import build_schedule
from tessera.parallel.pipeline.measure import StepMeasure
from tessera.parallel.pipeline.partition import chunks_of_rank, uniform
from tessera.parallel.pipeline.runtime import PipelineRuntime, build_chunks
from tessera.testing import use_layout

UNIT_S = 0.05  # one cost unit: a forward sleeps 1 unit, a backward 2
REPEATS = 3


def body_timing(schedule: str, p: int, m: int) -> list[tuple[float, float]]:
    runtime = sleep_runtime(use_layout(pipeline=p), schedule, m, UNIT_S)
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
def test_measure_records_busy_time(pools, schedule):
    p, m = 2, 4
    results = pools.run(p, body_timing, schedule, p, m)
    for repeat in range(REPEATS):
        busy = [results[r][repeat][0] for r in range(p)]
        assert all(b >= m * 3 * UNIT_S for b in busy)  # m forwards and m backwards slept on every rank


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
