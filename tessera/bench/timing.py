"""Timing both sides of a benchmark fairly on a shared machine."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

from tessera import comm
from tessera.comm import AxisGroup


def step_block(
    fn: Callable[[torch.Tensor, torch.Tensor], float],
    data: list[tuple[torch.Tensor, torch.Tensor]],
    losses: list[float],
    steps: int,
) -> Callable[[], None]:
    """A block of ``steps`` steps of one side: each takes the batch of ``data`` after the last one
    the side took (``len(losses)``, in turn) and appends its loss to ``losses``."""

    def run() -> None:
        for _ in range(steps):
            x, y = data[len(losses) % len(data)]
            losses.append(fn(x, y))

    return run


def time_block(block: Callable[[], None], group: AxisGroup, steps: int) -> float:
    """Seconds per step of ``block()`` (which runs ``steps`` steps): started together after a
    barrier, the slowest rank's time."""
    comm.barrier(group)
    start = time.perf_counter()
    block()
    elapsed = torch.tensor([time.perf_counter() - start])
    comm.all_reduce(elapsed, group, op="max")
    return float(elapsed) / steps


def alternate(
    sides: dict[str, Callable[[], None]], blocks: int, steps: int, group: AxisGroup
) -> dict[str, list[float]]:
    """Per-step times of each side over ``blocks`` rounds, the order reversed every other round
    (ABAB, then BABA) so that drift and noise fall on every side alike."""
    names = list(sides)
    times: dict[str, list[float]] = {name: [] for name in names}
    every = max(1, blocks // 4)
    for block in range(blocks):
        for name in names if block % 2 == 0 else names[::-1]:
            times[name].append(time_block(sides[name], group, steps))
        if group.rank == 0 and ((block + 1) % every == 0 or block + 1 == blocks):
            latest = ", ".join(f"{name} {times[name][-1]:.4g} s/step" for name in names)
            print(
                f"  timed block {block + 1}/{blocks} on {len(group.ranks)} ranks: {latest}", file=sys.stderr, flush=True
            )
    return times
