"""``tessera bench init``: start-up memory and time of a model larger than one rank's share.

The GPT preset ``gpt2-medium`` (355M parameters, fp32) on 4 ranks (gloo, one intra-op thread
per rank), from an empty process to a model ready for its first step: built, placed and given
its optimizer. Sides, each in fresh processes of its own (a process that already built a model
keeps the freed memory in its allocator and would hand it to the next one unseen):

- ``tessera``: ``with tessera.deferred_init(): model = gpt(...)``, then ``tessera.initialize``
  under ZeRO-3 dp4, 1d tp4 and pp4 (1F1B); and ``tessera (whole build)``: the same without
  ``deferred_init`` (every rank builds the whole model first, then keeps its part);
- ``FSDP2 (meta init)``: the model built under ``torch.device("meta")``, ``fully_shard`` on each
  block and on the model, ``to_empty``, then GPT-2 initialisation on the sharded parameters
  (``nn.init`` on the DTensors), as FSDP2's documentation and torchtitan do; ZeRO-3 dp4 only;
- ``DeepSpeed (zero.Init)``: the model built inside ``deepspeed.zero.Init`` (each layer's
  parameters partitioned as soon as it is built; the GPT's own init left out, since it writes
  whole parameters), then ``deepspeed.initialize`` with ZeRO stage 3; ZeRO-3 dp4 only, when
  DeepSpeed is installed.

Measured on every rank: the baseline RSS after imports and a miniature build of the same side
(lazy imports and one-time set-up paid outside; garbage collected and ``malloc_trim``-ed), the
peak RSS (VmHWM, reset at the baseline) when the model is ready, and the seconds it took. Rows
(the largest rank's): ``init_rss_growth_bytes`` (peak minus baseline) against each anchor;
``init_peak_rss_bytes`` against the bound a rank should keep, ``(baseline + parameter bytes / 4
+ largest parameter's bytes) x 1.15``; ``init_seconds`` against each anchor.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import Any

import torch

from tessera.bench.report import Row, print_rows, write_rows
from tessera.bench.zero_sides import deepspeed_available

# layout -> (use_layout's arguments, the run's config)
LAYOUTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "zero3": ({"data": 4}, {"parallel": {"data": 4}, "zero": {"stage": 3}}),
    "tp4": ({"tensor": 4, "mode": "1d"}, {"parallel": {"tensor": {"size": 4, "mode": "1d"}}}),
    "pp4": ({"pipeline": 4}, {"parallel": {"pipeline": {"size": 4, "schedule": "1f1b"}}}),
}
SIDES = (("tessera", "zero3"), ("tessera (whole build)", "zero3"), ("FSDP2 (meta init)", "zero3"),
         ("DeepSpeed (zero.Init)", "zero3"), ("tessera", "tp4"), ("tessera (whole build)", "tp4"),
         ("tessera", "pp4"), ("tessera (whole build)", "pp4"))  # fmt: skip
MINIATURE = {"vocab_size": 64, "max_seq_len": 16, "d_model": 16, "n_layers": 4, "n_heads": 4}


def parameter_sizes(preset: str, overrides: dict[str, Any]) -> tuple[int, int]:
    """(bytes of all parameters, bytes of the largest one) of the GPT, fp32, tied ones once."""
    from tessera.init import deferred_init
    from tessera.models import gpt

    with deferred_init():
        model = gpt(preset, **overrides)
    sizes = [p.numel() * 4 for p in {id(p): p for p in model.parameters()}.values()]
    return sum(sizes), max(sizes)


def _build(side: str, layout: str, preset: str, overrides: dict[str, Any]) -> Any:
    """Build ``side`` ready for its first step; returns what must stay alive."""
    import tessera
    from tessera.models import NextTokenLoss, gpt

    if side.startswith("tessera"):
        deferred = tessera.deferred_init() if side == "tessera" else contextlib.nullcontext()
        with deferred:
            model = gpt(preset, **overrides)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return tessera.initialize(model, optimizer, NextTokenLoss())[0]
    if side.startswith("FSDP2"):
        return _fsdp2(preset, overrides)
    return _deepspeed(preset, overrides)


def _gpt2_init(model: torch.nn.Module) -> None:
    """GPT-2 initialisation on whatever the parameters are (DTensors under FSDP2)."""
    from torch import nn

    from tessera.models.transformer import gpt2_init

    with torch.no_grad():
        for name, p in model.named_parameters():
            how = gpt2_init(name, len(model.blocks))  # type: ignore[arg-type]
            if how == "ones":
                nn.init.ones_(p)
            elif how == "zeros":
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, 0.0, float(how))


def _fsdp2(preset: str, overrides: dict[str, Any]) -> Any:
    from torch.distributed.fsdp import fully_shard

    from tessera.models import gpt

    with torch.device("meta"):
        model = gpt(preset, **overrides)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    _gpt2_init(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _deepspeed(preset: str, overrides: dict[str, Any]) -> Any:
    from tessera.bench.zero_anchors import _deepspeed as deepspeed_module
    from tessera.models import GPT, gpt

    deepspeed = deepspeed_module()
    world = torch.distributed.get_world_size()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "train_batch_size": world,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
    }
    reset = GPT.reset_parameters
    GPT.reset_parameters = lambda self: None  # type: ignore[method-assign]  # whole-tensor writes
    try:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = gpt(preset, **overrides)
    finally:
        GPT.reset_parameters = reset  # type: ignore[method-assign]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]


def init_body(side: str, layout: str, preset: str, overrides: dict[str, Any]) -> dict[str, float] | None:
    """On every rank of a fresh pool: baseline RSS, then peak RSS and seconds to build ``side``."""
    from tessera.bench.zero_ranks import trim_heap
    from tessera.memory.report import peak_rss_bytes, reset_peak_rss
    from tessera.testing import use_layout

    dims, config = LAYOUTS[layout]
    use_layout(**dims, config=config)
    kept = _build(side, layout, "tiny", MINIATURE)  # imports and one-time set-up, outside the measurement
    del kept
    trim_heap()
    if not reset_peak_rss():
        return None
    base = peak_rss_bytes()
    start = time.perf_counter()
    kept = _build(side, layout, preset, overrides)
    seconds = time.perf_counter() - start
    peak = peak_rss_bytes()
    del kept
    if base is None or peak is None:
        return None
    return {"base": float(base), "peak": float(peak), "seconds": seconds}


def measure(side: str, layout: str, preset: str, overrides: dict[str, Any], world: int = 4) -> dict[str, float] | None:
    """The largest rank's figures of one side, in a fresh pool."""
    from tessera.testing import RankPool

    pool = RankPool(world)
    try:
        got = pool.run(init_body, side, layout, preset, overrides, timeout=1800)
    finally:
        pool.close()
    if any(g is None for g in got):
        return None
    return {
        "base": max(g["base"] for g in got if g),
        "peak": max(g["peak"] for g in got if g),
        "growth": max(g["peak"] - g["base"] for g in got if g),
        "seconds": max(g["seconds"] for g in got if g),
    }


def run(preset: str = "gpt2-medium", overrides: dict[str, Any] | None = None, sides: Any = SIDES) -> list[Row]:
    overrides = dict(overrides or {"max_seq_len": 256})
    total, largest = parameter_sizes(preset, overrides)
    with_deepspeed = deepspeed_available()
    results: dict[tuple[str, str], dict[str, float]] = {}
    for side, layout in sides:
        if side.startswith("DeepSpeed") and not with_deepspeed:
            continue
        got = measure(side, layout, preset, overrides)
        if got is not None:
            results[(side, layout)] = got
            print(f"  {side} {layout}: peak {got['peak'] / 2**20:.0f} MiB, base {got['base'] / 2**20:.0f} MiB, "
                  f"{got['seconds']:.1f} s")  # fmt: skip
    rows: list[Row] = []
    for (side, layout), got in results.items():
        name = f"{layout} {preset} ({side})"
        bound = (got["base"] + total / 4 + largest) * 1.15
        rows.append(Row(name, "init_peak_rss_bytes", got["peak"], "bound (base + share + largest) x 1.15", bound))
        if side != "tessera":
            continue
        for (anchor, anchor_layout), theirs in results.items():
            if anchor_layout == layout and anchor != "tessera":
                rows.append(Row(f"{layout} {preset}", "init_rss_growth_bytes", got["growth"], anchor, theirs["growth"]))
                rows.append(Row(f"{layout} {preset}", "init_seconds", got["seconds"], anchor, theirs["seconds"]))
    return rows


def main(args: argparse.Namespace) -> int:
    rows = run()
    print_rows(rows)
    if not deepspeed_available():
        print("DeepSpeed is not installed: its rows are absent (pip install 'tessera[bench]' to add them)")
    if args.out:
        write_rows(rows, args.out)
    return 0


__all__ = ["LAYOUTS", "SIDES", "init_body", "main", "measure", "parameter_sizes", "run"]
