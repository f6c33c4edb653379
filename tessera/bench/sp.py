"""``tessera bench sp``: how long a sequence trains under a fixed memory budget per rank with
sequence parallelism, against 1D tensor parallelism with sequence-parallel regions on as many
ranks; and the speed of ring attention against torch's ``context_parallel``.

Rows:

- ``longest``: a GPT of width 128 with 2 blocks and 4 heads (byte vocabulary, positions up to
  32768) trains one step on one sequence of a given length; a length fits when every
  rank's peak RSS during the step stays within the budget above the rank's resident size before
  it (the model, its optimizer, buffers a first short step made, and the process are outside
  the budget). For each mode on 1, 2 and 4 ranks of the sequence axis, and for 1D tensor
  parallelism with sequence-parallel regions on 2 and 4 ranks, the longest length that fits
  (found by doubling, then bisecting, in multiples of 256; :class:`Search`). Ratios: each mode's longest on N
  ranks against its longest on one rank (the target for ``ring``: at least 0.9 N), and against
  tensor parallelism's on N ranks.
- ``forward``: the forward time of one attention layer (qkv projection, non-causal attention,
  output projection) on ``SPEED_LENGTH`` tokens over 2 ranks: tessera's ring attention against
  torch's ``context_parallel`` (the only configuration it runs on CPU: its causal attention and
  its backward have no CPU kernel there), both in one pool, alternating blocks.
"""

from __future__ import annotations

import argparse
import gc
import statistics
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tessera.bench.pools import rank_pool
from tessera.bench.report import Row, print_rows, write_rows

if TYPE_CHECKING:
    from tessera.testing import PoolSet

_MIB = 2**20


@dataclass(frozen=True)
class Search:
    """The longest-sequence search: ``budget`` bytes per rank; lengths are multiples of
    ``grain`` (every layout's pieces divide it) up to ``max_length`` (the position embedding's
    size in every run, so that every run trains the same model); ``bisections`` halvings after
    the doubling; the GPT's width; the rank counts of the sequence axis compared with one rank."""

    budget: int = 96 * _MIB
    grain: int = 256
    max_length: int = 32768
    bisections: int = 3
    d_model: int = 128
    ranks: tuple[int, ...] = (2, 4)


SEARCH = Search()
SPEED_LENGTH = 4096
MODES = ("ring_qk", "ring", "all_to_all")


def _config(system: str, mode: str, ranks: int) -> dict[str, Any]:
    if ranks == 1:
        return {}
    if system == "sp":
        return {"parallel": {"sequence": {"size": ranks, "mode": mode}}}
    return {"parallel": {"tensor": {"size": ranks, "sequence_parallel": True}}}


def _step_growth(system: str, mode: str, ranks: int, length: int, search: Search) -> int | None:
    """This rank's peak RSS above its resident size while the GPT trains one step on one
    sequence of ``length`` tokens, after a warm-up step on a short one (so that buffers that do
    not depend on the length, such as DDP's, already exist); None where /proc cannot tell."""
    import tessera
    from tessera.memory.report import peak_rss_bytes, reset_peak_rss, trim_heap
    from tessera.models import NextTokenLoss, gpt
    from tessera.testing import use_layout

    sequence = ranks if system == "sp" else 1
    use_layout(sequence=sequence, tensor=ranks // sequence, config=_config(system, mode, ranks))
    torch.manual_seed(0)
    model = gpt("tiny", vocab_size=256, max_seq_len=search.max_length, d_model=search.d_model, n_layers=2, n_heads=4)
    engine, *_ = tessera.initialize(model, torch.optim.SGD(model.parameters(), lr=0.01), NextTokenLoss())
    g = torch.Generator().manual_seed(1)

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, 256, (1, n + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    engine.train_batch(iter([batch(search.grain)]))
    gc.collect()
    trim_heap()
    if not reset_peak_rss():
        return None
    base = peak_rss_bytes()
    engine.train_batch(iter([batch(length)]))
    peak = peak_rss_bytes()
    del engine, model
    gc.collect()
    trim_heap()
    return None if base is None or peak is None else peak - base


def longest_body(system: str, mode: str, ranks: int, search: Search = SEARCH) -> dict[int, int | None]:
    """Growth per length tried on this rank (:func:`search_longest` over :func:`_step_growth`)."""
    return search_longest(
        lambda length: _step_growth(system, mode, ranks, length, search),
        search.budget, search.grain, search.max_length, search.bisections, ranks,
    )  # fmt: skip


def search_longest(
    growth: Callable[[int], int | None], budget: int, grain: int, max_length: int, bisections: int, ranks: int
) -> dict[int, int | None]:
    """Growth per length tried on this rank (``growth(length)``: its peak RSS above its resident
    size over one step, None where /proc cannot tell): lengths double from ``grain`` until one
    exceeds ``budget`` (or ``max_length`` fits), then ``bisections`` halvings of the interval
    between the last that fit and the first that did not, in multiples of ``grain``. Each
    length is decided on the largest growth over the ``ranks`` ranks of the world, so that
    every rank tries the same ones."""
    from tessera import comm
    from tessera.memory.report import map_large_allocations

    map_large_allocations()  # freed blocks leave the process: the peak follows what is alive, on every side alike
    seen: dict[int, int | None] = {}

    def fits(length: int) -> bool:
        grown = growth(length)
        worst = torch.tensor([float(grown if grown is not None else 2 * budget)])
        if ranks > 1:
            comm.all_reduce(worst, "world", op="max")
        seen[length] = int(worst.item()) if grown is not None else None
        return bool(worst.item() <= budget)

    low, high = 0, grain
    while high <= max_length and fits(high):
        low, high = high, 2 * high
    high = min(high, max_length + grain)
    for _ in range(bisections):
        middle = (low + high) // 2 // grain * grain
        if middle in (low, high) or middle > max_length:
            break
        low, high = (middle, high) if fits(middle) else (low, middle)
    return seen


def longest_fit(seen: dict[int, int | None], budget: int) -> int:
    """The longest length of a :func:`search_longest` whose growth stayed within ``budget`` (0: none)."""
    fits = [length for length, grown in seen.items() if grown is not None and grown <= budget]
    return max(fits) if fits else 0


def longest_rows(
    search: Search = SEARCH, pools: PoolSet | None = None
) -> tuple[list[Row], dict[str, dict[int, int | None]]]:
    """The ``longest`` rows and the growth per length tried of every side, on fresh pools of 1, 2
    and 4 ranks, or on ``pools``' (:func:`~tessera.bench.pools.rank_pool`)."""
    found: dict[str, dict[int, int | None]] = {}
    with ExitStack() as stack:
        pool_of = {n: stack.enter_context(rank_pool(n, pools)) for n in (1, *search.ranks)}
        for ranks in (1, *search.ranks):
            sides = [("sp", mode) for mode in (MODES if ranks > 1 else ("plain",))]
            sides += [("tp", "1d-sp")] if ranks > 1 else []
            for system, mode in sides:
                label = f"{system} {mode} x{ranks}" if ranks > 1 else "one rank"
                found[label] = pool_of[ranks].run(longest_body, system, mode, ranks, search, timeout=3600)[0]
                print(f"  {label}: longest {longest_fit(found[label], search.budget)}", flush=True)
    one = longest_fit(found["one rank"], search.budget)
    rows = []
    for ranks in search.ranks:
        tp = longest_fit(found[f"tp 1d-sp x{ranks}"], search.budget)
        for mode in MODES:
            mine = longest_fit(found[f"sp {mode} x{ranks}"], search.budget)
            rows.append(Row(f"longest sp {mode} x{ranks} vs one rank", "tokens", mine, "one rank", one))
            rows.append(Row(f"longest sp {mode} x{ranks} vs tp1d-sp", "tokens", mine, f"tp 1d-sp x{ranks}", tp))
    return rows, found


# ---- speed against torch's context_parallel --------------------------------------------------


class _NoPeer(Exception):
    pass


def speed_body(blocks: int, steps: int, length: int = SPEED_LENGTH, peer: bool = True) -> dict[str, Any]:
    """Forward time of one attention layer over ``SPEED_LENGTH`` tokens on 2 ranks, tessera's
    ring attention against torch's context_parallel (non-causal). ``peer=False`` times tessera's
    side alone (torch's first call propagates DTensor shardings through SDPA's decomposition:
    about 10 s a rank here, paid once)."""
    import torch.nn.functional as F
    from torch import nn

    from tessera.bench.timing import alternate
    from tessera.parallel.sequence import layout_for, sequence_attention
    from tessera.testing import use_layout

    ctx = use_layout(sequence=2, config={"parallel": {"sequence": {"size": 2, "mode": "ring"}}})
    group = ctx.group("sequence")
    torch.manual_seed(0)
    d, heads = 256, 4
    qkv, proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
    x = torch.randn(1, length, d)
    layout = layout_for("ring", length, 2)
    mine = layout.split(x, 1, group.rank)

    def heads_of(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, s, _ = t.shape
        return tuple(p.view(b, s, heads, d // heads).transpose(1, 2) for p in t.chunk(3, dim=-1))

    def ours() -> None:
        with torch.no_grad():
            q, k, v = heads_of(qkv(mine))
            y = sequence_attention(q, k, v, group, layout, "ring", causal=False)
            proj(y.transpose(1, 2).reshape(1, -1, d))

    sides: dict[str, Any] = {"tessera ring": ours}
    note = "" if peer else "torch context_parallel not run (peer=False)"
    try:
        if not peer:
            raise _NoPeer
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh("cpu", (2,))

        def theirs() -> None:
            buffer = x.clone()
            with torch.no_grad(), context_parallel(mesh, buffers=[buffer], buffer_seq_dims=[1]):
                q, k, v = heads_of(qkv(buffer))
                y = F.scaled_dot_product_attention(q, k, v)
                proj(y.transpose(1, 2).reshape(1, -1, d))

        theirs()
        sides["torch context_parallel"] = theirs
    except _NoPeer:
        pass
    except Exception as error:  # it does not run here: the row is absent, the reason printed
        note = f"torch context_parallel does not run: {type(error).__name__}: {str(error)[:200]}"
    for side in sides.values():
        side()
    times = alternate(sides, blocks, steps, ctx.group("world"))
    return {"times": times, "note": note}


def speed_rows(
    blocks: int = 6, steps: int = 2, length: int = SPEED_LENGTH, pools: PoolSet | None = None
) -> tuple[list[Row], str]:
    """The ``forward`` row (absent where torch's context_parallel does not run here, the reason
    returned), on a fresh pool of 2 ranks or on ``pools``' (:func:`~tessera.bench.pools.rank_pool`)."""
    with rank_pool(2, pools) as pool:
        out = pool.run(speed_body, blocks, steps, length, timeout=1800)[0]
    times = {name: statistics.median(values) for name, values in out["times"].items()}
    rows = []
    if "torch context_parallel" in times:
        name = f"attention forward {length} tokens x2 non-causal"
        rows.append(Row(name, "step_time_s", times["tessera ring"], "torch context_parallel",
                        times["torch context_parallel"]))  # fmt: skip
    return rows, out["note"]


def main(args: argparse.Namespace) -> int:
    rows, found = longest_rows()
    speed, note = speed_rows()
    rows += speed
    print_rows(rows)
    print(f"growth during one training step (MiB; budget {SEARCH.budget / _MIB:.0f} MiB per rank):")
    for label, seen in found.items():
        grown = ", ".join(f"{n}: {'-' if g is None else f'{g / _MIB:.0f}'}" for n, g in seen.items())
        print(f"  {label:<20} {grown}")
    if note:
        print(note)
    if args.out:
        write_rows(rows, args.out)
    return 0


__all__ = ["SEARCH", "Search", "longest_fit", "longest_rows", "main", "search_longest", "speed_rows"]
