"""The video model's row of ``tessera bench diffusion``: the longest clip (frames at a fixed
resolution) that trains one step under a fixed peak-RSS budget per rank, with the frames split
over 1, 2 and 4 ranks of the sequence axis (docs/video.md).

A clip length fits when every rank's peak RSS during one training step of tessera's video
diffusion transformer on one clip stays within the budget above the rank's resident size before
the step (the model, its optimizer, what a first short step allocated, and the process are outside
the budget), as ``tessera bench sp``'s ``longest`` rows measure sequences
(:func:`~tessera.bench.sp.search_longest`: doubling, then bisecting, in multiples of ``grain``
frames, which every layout's pieces divide).
"""

from __future__ import annotations

import gc
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tessera.bench.pools import rank_pool
from tessera.bench.report import Row
from tessera.bench.sp import longest_fit, search_longest

if TYPE_CHECKING:
    from tessera.testing import PoolSet

_MIB = 2**20


@dataclass(frozen=True)
class ClipSearch:
    """The longest-clip search: ``budget`` bytes per rank; clips of multiples of ``grain`` frames
    (divisible by ``2 * max(ranks)``: ring mode's pieces) up to ``max_frames``; ``bisections``
    halvings after the doubling; frames of ``size`` x ``size`` latents in patches of ``patch``;
    the model's width, blocks and heads; the sequence-axis sizes compared with one rank, and the
    modes."""

    budget: int = 256 * _MIB
    grain: int = 8
    max_frames: int = 1024
    bisections: int = 3
    size: int = 32
    patch: int = 2
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    ranks: tuple[int, ...] = (2, 4)
    modes: tuple[str, ...] = ("all_to_all", "ring")


SEARCH = ClipSearch()


def _clip_batch(frames: int, search: ClipSearch) -> dict[str, torch.Tensor]:
    """One clip's training item, filled (``torch.empty`` would not touch its pages)."""
    g = torch.Generator().manual_seed(frames)
    shape = (1, 3, frames, search.size, search.size)
    return {
        "latents": torch.randn(shape, generator=g),
        "timesteps": torch.rand(1, generator=g),
        "captions": torch.randint(1, 8, (1, 4), generator=g),
        "velocity": torch.randn(shape, generator=g),
    }


def _step_growth(mode: str, ranks: int, frames: int, search: ClipSearch) -> int | None:
    """This rank's peak RSS above its resident size while the video model trains one step on one
    clip of ``frames`` frames, after a warm-up step on ``grain`` frames; None where /proc cannot tell."""
    import tessera
    from tessera.memory.report import peak_rss_bytes, reset_peak_rss, trim_heap
    from tessera.models.video import VideoDiT, VideoDiTConfig
    from tessera.testing import use_layout

    config = {"parallel": {"sequence": {"size": ranks, "mode": mode}}} if ranks > 1 else {}
    use_layout(sequence=ranks, config=config)
    torch.manual_seed(0)
    shape = dict(height=search.size, width=search.size, patch=search.patch, d_model=search.d_model)
    model = VideoDiT(VideoDiTConfig(**shape, n_layers=search.n_layers, n_heads=search.n_heads))
    engine, *_ = tessera.initialize(model, torch.optim.SGD(model.parameters(), lr=0.01))
    engine.train_batch(iter([_clip_batch(search.grain, search)]))
    gc.collect()
    trim_heap()
    if not reset_peak_rss():
        return None
    base = peak_rss_bytes()
    engine.train_batch(iter([_clip_batch(frames, search)]))
    peak = peak_rss_bytes()
    engine.close()
    del engine, model
    gc.collect()
    trim_heap()
    return None if base is None or peak is None else peak - base


def longest_clip_body(mode: str, ranks: int, search: ClipSearch = SEARCH) -> dict[int, int | None]:
    """Growth per clip length tried on this rank (:func:`~tessera.bench.sp.search_longest`)."""
    return search_longest(
        lambda frames: _step_growth(mode, ranks, frames, search),
        search.budget, search.grain, search.max_frames, search.bisections, ranks,
    )  # fmt: skip


def longest_clip_rows(
    search: ClipSearch = SEARCH, pools: PoolSet | None = None
) -> tuple[list[Row], dict[str, dict[int, int | None]]]:
    """Rows ``longest clip sp <mode> x<N> vs sp1`` (metric ``frames``: the longest clip that
    fits on N ranks of the sequence axis, against one rank's), and the growth per clip length
    tried of every side; on fresh pools of 1 and each of ``search.ranks``, or on ``pools``'."""
    if search.grain % (2 * max(search.ranks, default=1)):
        raise ValueError(f"ClipSearch.grain={search.grain} must divide by 2 * {max(search.ranks)} (ring's pieces)")
    found: dict[str, dict[int, int | None]] = {}
    with ExitStack() as stack:
        pool_of = {n: stack.enter_context(rank_pool(n, pools)) for n in (1, *search.ranks)}
        found["sp1"] = pool_of[1].run(longest_clip_body, "ring", 1, search, timeout=3600)[0]
        for ranks in search.ranks:
            for mode in search.modes:
                label = f"sp {mode} x{ranks}"
                found[label] = pool_of[ranks].run(longest_clip_body, mode, ranks, search, timeout=3600)[0]
                print(f"  {label}: longest clip {longest_fit(found[label], search.budget)} frames", flush=True)
    one = longest_fit(found["sp1"], search.budget)
    rows = [
        Row(f"longest clip sp {mode} x{ranks} vs sp1", "frames", longest_fit(found[f"sp {mode} x{ranks}"], search.budget),
            "sp1", one)
        for ranks in search.ranks
        for mode in search.modes
    ]  # fmt: skip
    return rows, found


__all__ = ["SEARCH", "ClipSearch", "longest_clip_body", "longest_clip_rows"]
