"""``tessera bench dp``: tessera's data-parallel training step against raw torch DDP.

Both sides train their own copy of the same model (same initial weights) on the same batches
on the same ranks. They run in alternating blocks of steps (ABAB, then BABA), each block timed
between barriers on every rank; a block's time is its slowest rank's. The reported value is
the median over blocks of the time per step.
"""

from __future__ import annotations

import argparse
import statistics
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel

from tessera.bench.pools import rank_pool
from tessera.bench.report import Row, print_rows, write_rows
from tessera.bench.timing import alternate

if TYPE_CHECKING:
    from tessera.testing import PoolSet


def _rank_body(preset: str, micro_batch: int, seq_len: int, blocks: int, steps_per_block: int) -> dict[str, Any]:
    import tessera
    from tessera.models import NextTokenLoss, gpt
    from tessera.testing import use_layout

    ctx = use_layout(config={})
    torch.manual_seed(0)
    ours = gpt(preset, max_seq_len=seq_len)
    theirs = gpt(preset, max_seq_len=seq_len)
    theirs.load_state_dict(ours.state_dict())
    loss_fn = NextTokenLoss()
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-3)
    engine, *_ = tessera.initialize(ours, opt_ours, loss_fn)
    ddp = DistributedDataParallel(theirs)

    g = torch.Generator().manual_seed(1000 + ctx.rank)
    batches = [torch.randint(0, 256, (micro_batch, seq_len + 1), generator=g) for _ in range(steps_per_block)]
    pairs = [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in batches]

    def tessera_block() -> None:
        it = iter(pairs)
        for _ in range(steps_per_block):
            engine.train_batch(it)

    def ddp_block() -> None:
        for x, y in pairs:
            opt_theirs.zero_grad(set_to_none=True)
            loss_fn(ddp(x), y).backward()
            opt_theirs.step()

    tessera_block()  # warm-up: DDP builds its buckets, allocators settle
    ddp_block()
    return alternate({"tessera": tessera_block, "ddp": ddp_block}, blocks, steps_per_block, ctx.group("world"))


def run(
    ranks: int = 4,
    preset: str = "tiny",
    micro_batch: int = 8,
    seq_len: int = 128,
    blocks: int = 24,
    steps: int = 3,
    pools: PoolSet | None = None,
) -> list[Row]:
    """The rows on a fresh pool of ``ranks`` ranks, or on ``pools``' (:func:`~tessera.bench.pools.rank_pool`)."""
    with rank_pool(ranks, pools) as pool:
        times = pool.run(_rank_body, preset, micro_batch, seq_len, blocks, steps, timeout=1800)[0]
    ours, theirs = statistics.median(times["tessera"]), statistics.median(times["ddp"])
    samples = micro_batch * ranks
    name = f"dp{ranks} gpt-{preset} b{micro_batch}x{seq_len}"
    return [
        Row(name, "step_time_s", ours, "torch DDP", theirs),
        Row(name, "samples_per_s", samples / ours, "torch DDP", samples / theirs),
    ]


def main(args: argparse.Namespace) -> int:
    rows = run(**({"ranks": args.ranks} if getattr(args, "ranks", None) else {}))
    print_rows(rows)
    if args.out:
        write_rows(rows, args.out)
    return 0
