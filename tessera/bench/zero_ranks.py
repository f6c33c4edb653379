"""``tessera bench zero``, the bodies that run on every rank of a pool: build the sides, time
them in alternating blocks, or measure one side's peak memory (see :mod:`tessera.bench.zero`)."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from typing import Any

import torch

from tessera.bench.timing import alternate
from tessera.bench.zero_anchors import build_deepspeed, build_fsdp2, prepare
from tessera.bench.zero_sides import LossFn, Side, StepFn, Workload, batches_of, build_tessera
from tessera.memory import report


def build_side(side: Side, w: Workload) -> tuple[StepFn, LossFn, str]:
    """Build ``side`` on this rank: one training step ``step(x, y)``, the loss of a batch, and the
    anchor's name as reported (DeepSpeed's names the optimizer ZeRO-Offload steps with)."""
    world = torch.distributed.get_world_size()
    if side.system == "tessera":
        return build_tessera(side, w, world)
    if side.system == "fsdp2":
        return build_fsdp2(side, w)
    return build_deepspeed(side, w, world)


def timing_body(sides: list[Side], w: Workload, blocks: int, steps: int) -> dict[str, Any]:
    """Build every side of a row group, time them in alternating blocks, then evaluate each."""
    from tessera.testing import use_layout

    world = use_layout(config={}).group("world")
    for side in sides:
        prepare(side)
    built = {side: build_side(side, w) for side in sides}
    batches = batches_of(w, world.rank, steps)

    def block_of(step: StepFn) -> Callable[[], None]:
        def block() -> None:
            for x, y in batches:
                step(x, y)

        return block

    blocks_by_side = {side.label: block_of(step) for side, (step, _, _) in built.items()}
    for block in blocks_by_side.values():  # warm-up: buffers, hooks and optimizer states appear
        block()
    times = alternate(blocks_by_side, blocks, steps, world)
    x, y = batches[0]
    losses = {side.label: loss(x, y) for side, (_, loss, _) in built.items()}
    names = {side.label: name for side, (_, _, name) in built.items()}
    return {"times": times, "losses": losses, "names": names}


def trim_heap() -> None:
    """Collect garbage, then hand freed heap memory back to the system (``memory.report``)."""
    gc.collect()
    report.trim_heap()


def memory_body(side: Side, w: Workload, steps: int) -> dict[str, int] | None:
    """This rank's peak RSS above its baseline while ``side`` is set up (model built, wrapped)
    and while it trains ``steps`` steps; run in a fresh pool (see the module docstring)."""
    from tessera.memory.report import peak_rss_bytes, reset_peak_rss
    from tessera.testing import use_layout

    world = use_layout(config={}).group("world")
    prepare(side)
    batches = batches_of(w, world.rank, steps)
    step, _, _ = build_side(side, dataclasses.replace(w, miniature=True))
    for x, y in batches:  # the same code paths once: lazy imports and one-time set-up happen here
        step(x, y)
    del step
    trim_heap()
    if not reset_peak_rss():
        return None
    base = peak_rss_bytes()  # right after the reset, the peak is the current RSS
    step, _, _ = build_side(side, w)
    setup = peak_rss_bytes()
    trim_heap()  # what setting up freed (the full model a sharding side let go) does not count
    reset_peak_rss()
    for x, y in batches:
        step(x, y)
    train = peak_rss_bytes()
    if base is None or setup is None or train is None:
        return None
    return {"setup": setup - base, "train": train - base}
