"""``tessera bench recompute``: what activation checkpointing saves and what it costs.

The GPT "small" preset (6 blocks of width 256, 8 heads), one micro-batch of ``BATCH`` x ``SEQ``
byte tokens, AdamW, one process: for ``full`` and ``selective`` checkpointing of every block,
the bytes kept for the backward pass (saved-tensor hooks, plus the matmul outputs selective
checkpointing keeps inside its checkpoints) and the training step time, each against no
checkpointing measured in the same run (the three sides alternate in timed blocks).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from tessera.bench.pools import rank_pool
from tessera.bench.report import Row, print_rows, write_rows

if TYPE_CHECKING:
    from tessera.testing import PoolSet

BATCH, SEQ = 4, 256
MODES = ("none", "full", "selective")


def _model(mode: str, preset: str, seq: int) -> torch.nn.Module:
    from tessera.models import gpt
    from tessera.nn import checkpoint_blocks

    torch.manual_seed(0)
    model = gpt(preset, max_seq_len=seq)
    checkpoint_blocks(model, mode=mode)
    return model


def saved_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes one forward pass of ``model`` on ``x`` keeps for the backward (parameters left out)."""
    from tessera.nn.recompute import kept_for_backward

    return kept_for_backward(lambda: model(x).sum(), model.parameters())


def body(blocks: int, steps: int, preset: str = "small", batch: int = BATCH, seq: int = SEQ) -> dict[str, Any]:
    from tessera.bench.timing import alternate
    from tessera.models import NextTokenLoss
    from tessera.testing import use_layout

    ctx = use_layout()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (batch, seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    loss_fn = NextTokenLoss()
    saved: dict[str, int] = {}
    sides: dict[str, Callable[[], None]] = {}

    def stepper(model: torch.nn.Module) -> Callable[[], None]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step() -> None:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()

        return step

    for mode in MODES:
        model = _model(mode, preset, seq)
        saved[mode] = saved_bytes(model, x)
        sides[mode] = stepper(model)
        sides[mode]()  # warm-up
    times = alternate(sides, blocks, steps, ctx.group("world"))
    return {"saved": saved, "times": {m: statistics.median(t) for m, t in times.items()}}


def run(
    blocks: int = 6,
    steps: int = 2,
    preset: str = "small",
    batch: int = BATCH,
    seq: int = SEQ,
    pools: PoolSet | None = None,
) -> list[Row]:
    """The rows, measured in a fresh process, or in ``pools``' one-rank pool (:func:`~tessera.bench.pools.rank_pool`)."""
    with rank_pool(1, pools) as pool:
        out = pool.run(body, blocks, steps, preset, batch, seq, timeout=1800)[0]
    rows = []
    name = f"recompute gpt-{preset} b{batch}x{seq}"
    for mode in ("full", "selective"):
        rows.append(Row(f"{name} {mode}", "saved_bytes", out["saved"][mode], "no checkpointing", out["saved"]["none"]))
        rows.append(Row(f"{name} {mode}", "step_time_s", out["times"][mode], "no checkpointing", out["times"]["none"]))
    return rows


def main(args: argparse.Namespace) -> int:
    rows = run()
    print_rows(rows)
    if args.out:
        write_rows(rows, args.out)
    return 0


__all__ = ["main", "run", "saved_bytes"]
