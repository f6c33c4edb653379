"""``tessera bench ckpt``: sharded checkpoints against ``torch.distributed.checkpoint`` (DCP).

One engine per layout, on 4 ranks for the blocking save and load (gloo, one intra-op thread
per rank): GPT "small" at ``max_seq_len=64`` (the model of ``tessera bench zero``) with
``torch.optim.AdamW`` after one training step, so that every parameter has its AdamW state
(step, exp_avg, exp_avg_sq). Layouts: ``ddp`` (data parallel over 4 ranks, every rank holds
everything) and ``zero3`` (ZeRO stage 3 over 4 ranks, every rank holds a quarter of the
parameters and their states, fp32).

Both sides save and load the same engine's tensors, the same bytes:

- tessera: ``tessera.checkpoint.save(path, engine)`` (blocking) and ``load(path, engine)``;
- DCP, ``ddp``: ``dcp.save({"model": module.state_dict(), "optim": optimizer.state_dict()})``
  built at each save, the tied ``lm_head.weight`` left out (it is ``tok_emb.weight``; tessera
  writes it once too). Every rank passes the same keys and DCP's planner lets one rank write
  each (balanced by size, as tessera's plan). Load: ``dcp.load`` into such a dict, then
  ``module.load_state_dict`` and ``optimizer.load_state_dict``, as DCP's documentation does;
- DCP, ``zero3``: DCP cannot take tessera's sharded optimizer as it is (every rank's pieces
  have the same parameter indices and other shapes), so it gets what tessera writes: each of
  the rank's pieces of a parameter and of its AdamW states under a key that names the piece
  (``model/<key>@<start>:<end>``, ``optim/<key>/<state>@<start>:<end>``; distinct across ranks),
  plain tensors, no DTensor. ``dcp.load`` fills those tensors in place, then the strategy's
  ``checkpoint_loaded()`` makes the parameters follow, which tessera's load also ends with.

Neither side keeps anything between calls: tessera plans its save anew each time, DCP with its
default planners (``dcp.save``/``dcp.load`` with a path, ``FileSystemWriter`` and
``FileSystemReader``, files fsynced). tessera also writes the RNG states (a few kB per rank)
and a CRC-32 per piece that its load checks.

Timing: for each layout, ``--reps`` rounds (default 6); in each round the two sides' saves, then
their loads, run in alternating order (tessera first in even rounds, DCP first in odd ones),
each timed between barriers with the slowest rank's time, into a fresh folder (the previous
ones are deleted outside the timed part). The rows give medians. One untimed round first.

Bytes per rank: the bytes of the files each rank wrote (tessera: its ``rankNNNNN.safetensors``
and ``rankNNNNN.json``, plus ``index.json`` on rank 0; DCP: its ``__<rank>_*.distcp`` files,
plus ``.metadata`` on rank 0), the largest rank's; also against the rank's share of the model
and optimizer state (their bytes over the world size).

Asynchronous save: the wall time of ``save(path, engine, blocking=False)`` (how long training
waits) against copying the same tensors (those this rank writes,
``tessera.checkpoint.sharded.written_share``) into host memory that holds them (allocated and
touched before the timing: what any snapshot must at least do), alternated the same way, one
asynchronous save after another (as in training; a load in between would make each the first
save after a resume, which lists the tensors anew); the background write finishes, untimed,
before the next measurement. These run on a pool of their own with one rank per core
(``Workload.stall_ranks``, default the smaller of ``--ranks`` and the machine's cores): the
stall is a call of a millisecond or more, and with more ranks than cores a rank is descheduled
in the middle of it for a time slice of the scheduler's, at a random point, which then times
the scheduler, not the call. Besides both layouts of the preset, the same GPT at other widths
(``Workload.widths``: at ``d_model`` 176 the share per rank of the blocking pool's GPT-small on
4 ranks, about 14 MB; at 768 and 1536, 256 MB and 1 GB per rank on 2 ranks).

The files go to a temporary folder on the local disk (``tempfile``, so ``TMPDIR`` chooses it),
removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tessera.bench.pools import rank_pool
from tessera.bench.report import Row, print_rows, write_rows
from tessera.bench.timing import time_block

if TYPE_CHECKING:
    from tessera.testing import PoolSet

LAYOUTS = ("ddp", "zero3")
ANCHOR = "torch.distributed.checkpoint"


@dataclass(frozen=True)
class Workload:
    """GPT ``preset`` at ``max_seq_len=seq_len``, AdamW after one step on a ``[micro_batch,
    seq_len]`` batch per rank; ``reps`` timed rounds. ``widths``: ``(layout, d_model)`` of the
    other widths whose asynchronous save is also measured. ``stall_ranks``: the ranks of the
    asynchronous saves (None: one per core, at most the blocking pool's)."""

    preset: str = "small"
    seq_len: int = 64
    micro_batch: int = 4
    reps: int = 6
    widths: tuple[tuple[str, int], ...] = (("ddp", 176), ("zero3", 176), ("ddp", 768), ("zero3", 768), ("zero3", 1536))
    stall_ranks: int | None = None


@dataclass(frozen=True)
class Case:
    """What one engine measures: ``layout`` ("ddp" or "zero3") of the workload's model, at width
    ``d_model`` (None: the preset's); ``dcp``: the blocking save and load against DCP and the
    bytes written (False: the asynchronous save against the copy)."""

    layout: str
    d_model: int | None = None
    dcp: bool = False

    def name(self, w: Workload, world: int) -> str:
        return f"{self.layout} dp{world} gpt-{w.preset}" + (f" d{self.d_model}" if self.d_model else "")


def cases_of(layouts: tuple[str, ...], w: Workload) -> tuple[list[Case], list[Case]]:
    """The blocking pool's cases (against DCP) and the asynchronous pool's."""
    widths = [Case(layout, width) for layout, width in w.widths if layout in layouts]
    return [Case(layout, dcp=True) for layout in layouts], [Case(layout) for layout in layouts] + widths


def _config(layout: str, world: int) -> dict[str, Any]:
    if layout == "zero3":
        return {"parallel": {"data": world}, "zero": {"stage": 3}}
    return {"parallel": {"data": world}}


def _engine(layout: str, w: Workload, d_model: int | None = None) -> Any:
    """The engine of ``layout`` with AdamW state (one step taken)."""
    import tessera
    from tessera.models import NextTokenLoss, gpt
    from tessera.testing import use_layout

    world = torch.distributed.get_world_size()
    ctx = use_layout(config=_config(layout, world))
    torch.manual_seed(0)
    model = gpt(w.preset, max_seq_len=w.seq_len, **({"d_model": d_model} if d_model else {}))
    engine, *_ = tessera.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), NextTokenLoss())
    g = torch.Generator().manual_seed(1000 + ctx.rank)
    tokens = torch.randint(0, 256, (w.micro_batch, w.seq_len + 1), generator=g)
    engine.train_batch(iter([(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())]))
    return engine


# ---- what DCP is given -----------------------------------------------------------------------


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` without the second and later keys of a tensor (tied weights once)."""
    seen: set[int] = set()
    out = {}
    for key, value in state.items():
        if value.data_ptr() not in seen:
            seen.add(value.data_ptr())
            out[key] = value
    return out


def _pieces_state(engine: Any) -> dict[str, torch.Tensor]:
    """ZeRO-3: this rank's pieces of the parameters and of their optimizer states, under keys
    that name the piece (the tensors tessera writes, less the RNG states)."""
    from tessera.checkpoint.sharded import held_tensors

    out = {}
    for name, tensor, view in held_tensors(engine):
        if name.startswith("rng/"):
            continue
        span = view.flat if view.flat is not None else (0, tensor.numel())
        out[f"{name}@{span[0]}:{span[1]}"] = tensor
    return out


def _dcp_save(engine: Any, layout: str, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    if layout == "zero3":
        state: dict[str, Any] = _pieces_state(engine)
    else:
        state = {"model": _untied(engine.module.state_dict()), "optim": engine.optimizer.state_dict()}
    dcp.save(state, checkpoint_id=str(path))


def _dcp_load(engine: Any, layout: str, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    if layout == "zero3":
        dcp.load(_pieces_state(engine), checkpoint_id=str(path))
        engine.strategy.checkpoint_loaded()
        return
    state = {"model": _untied(engine.module.state_dict()), "optim": engine.optimizer.state_dict()}
    dcp.load(state, checkpoint_id=str(path))
    engine.module.load_state_dict(state["model"], strict=False)  # strict=False: the tied alias
    engine.optimizer.load_state_dict(state["optim"])


# ---- measuring on every rank -----------------------------------------------------------------


def _written_bytes(side: str, folder: Path, rank: int) -> int:
    """Bytes of the files ``rank`` wrote into the checkpoint ``folder``."""
    if side == "tessera":
        names = [f"rank{rank:05d}.safetensors", f"rank{rank:05d}.json"] + (["index.json"] if rank == 0 else [])
        files = [folder / n for n in names]
    else:
        files = list(folder.glob(f"__{rank}_*.distcp")) + ([folder / ".metadata"] if rank == 0 else [])
    return sum(f.stat().st_size for f in files if f.exists())


class _Folders:
    """A fresh folder per save under ``root``; :meth:`clear` deletes the older ones (rank 0,
    between barriers, outside the timed part)."""

    def __init__(self, root: Path, rank: int, group: Any) -> None:
        self.root, self.rank, self.group = root, rank, group
        self.count = 0
        self.latest: dict[str, Path] = {}

    def next(self, side: str) -> Path:
        self.count += 1
        self.latest[side] = self.root / f"{side}-{self.count:03d}"
        return self.latest[side]

    def clear(self) -> None:
        from tessera import comm

        comm.barrier(self.group)
        if self.rank == 0:
            keep = set(self.latest.values())
            for path in self.root.iterdir():
                if path not in keep:
                    shutil.rmtree(path, ignore_errors=True)
        comm.barrier(self.group)


def _alternating(
    sides: dict[str, Callable[[], None]], rnd: int, group: Any, after: Callable[[], None]
) -> dict[str, float]:
    """One round: each side once (order reversed in odd rounds), timed, ``after()`` between."""
    times = {}
    for name in list(sides) if rnd % 2 == 0 else list(sides)[::-1]:
        times[name] = time_block(sides[name], group, 1)
        after()
    return times


def _progress(group: Any, text: str) -> None:
    if group.rank == 0:
        print(f"  {text}", file=sys.stderr, flush=True)


def rank_body(cases: list[Case], w: Workload, root: str) -> list[dict[str, Any]]:
    """Every measurement of every case on this rank (rank 0's answer is the run's)."""
    return [_measure(case, w, Path(root) / f"case{n}") for n, case in enumerate(cases)]


def _measure(case: Case, w: Workload, root: Path) -> dict[str, Any]:
    """Save, load and asynchronous-save times, and bytes written, of one case."""
    from tessera import comm
    from tessera.checkpoint import load, save
    from tessera.checkpoint.sharded import written_share
    from tessera.checkpoint.tools import inspect

    layout = case.layout
    engine = _engine(layout, w, case.d_model)
    group = engine.ctx.group("world")
    rank = engine.ctx.rank
    folders = _Folders(root, rank, group)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
    comm.barrier(group)
    share = written_share(engine)
    pending: list[Any] = []

    def stall() -> None:
        pending.append(save(folders.next("async"), engine, blocking=False))

    # The copy the snapshot cannot avoid: the share into host memory that keeps it (allocated and
    # touched once, outside the timing). Copies dropped at once (``t.to("cpu", copy=True)`` in a
    # loop) would reuse one freed, cache-warm block and time less than a snapshot must move.
    held = [torch.zeros_like(t, device="cpu") for t in share]

    def copy() -> None:
        with torch.no_grad():
            torch._foreach_copy_(held, share)

    def finish() -> None:  # the background write, untimed
        while pending:
            pending.pop().wait()
        folders.clear()

    rounds: dict[str, dict[str, Callable[[], Any]]] = {}
    if case.dcp:
        rounds["save"] = {
            "tessera": lambda: save(folders.next("tessera"), engine),
            "dcp": lambda: _dcp_save(engine, layout, folders.next("dcp")),
        }
        rounds["load"] = {
            "tessera": lambda: load(folders.latest["tessera"], engine),
            "dcp": lambda: _dcp_load(engine, layout, folders.latest["dcp"]),
        }
    times: dict[str, dict[str, list[float]]] = {}
    # saves and loads alternate; the asynchronous saves come after, one after another as in
    # training (a load in between would give every one of them a run's first save after resuming)
    phases = ([rounds] if rounds else []) + ([] if case.dcp else [{"async": {"tessera": stall, "copy": copy}}])
    for phase in phases:
        for what, sides in phase.items():
            times[what] = {side: [] for side in sides}
        for rnd in range(w.reps + 1):  # round 0 warms up, untimed
            for what, sides in phase.items():
                got = _alternating(sides, rnd, group, finish)
                for name, t in got.items():
                    if rnd:
                        times[what][name].append(t)
            if rnd:
                _progress(group, f"{case.name(w, group.size)} round {rnd}/{w.reps}: " + "; ".join(
                    f"{what} " + ", ".join(f"{n} {v[-1]:.4f} s" for n, v in times[what].items())
                    for what in phase
                ))  # fmt: skip
    out: dict[str, Any] = {"name": case.name(w, group.size), "times": times, "world": group.size}
    out["share_bytes"] = sum(t.numel() * t.element_size() for t in share)
    if case.dcp:
        both = ("tessera", "dcp")
        written = torch.tensor([_written_bytes(s, folders.latest[s], rank) for s in both], dtype=torch.int64)
        per_rank = comm.all_gather(written.unsqueeze(0), group).view(group.size, 2).tolist()
        out["bytes"] = {"tessera": [b[0] for b in per_rank], "dcp": [b[1] for b in per_rank]}
        info = inspect(folders.latest["tessera"]) if rank == 0 else None
        out["state_bytes"] = (
            0 if info is None else info["groups"]["model"]["bytes"] + info["groups"]["optimizer"]["bytes"]
        )
    comm.barrier(group)
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return out


# ---- rows --------------------------------------------------------------------------------------


def rows_of(results: list[dict[str, Any]]) -> list[Row]:
    rows: list[Row] = []
    for r in results:
        world, name = r["world"], r["name"]
        med = {what: {side: statistics.median(v) for side, v in sides.items()} for what, sides in r["times"].items()}
        if "save" in med:
            rows.append(Row(name, "save_time_s", med["save"]["tessera"], ANCHOR, med["save"]["dcp"]))
            rows.append(Row(name, "load_time_s", med["load"]["tessera"], ANCHOR, med["load"]["dcp"]))
        if "bytes" in r:
            ours, theirs = r["bytes"]["tessera"], r["bytes"]["dcp"]
            share = f"state share (1/{world})"
            rows.append(Row(name, "bytes_per_rank", float(max(ours)), ANCHOR, float(max(theirs))))
            rows.append(Row(name, "bytes_per_rank", float(max(ours)), share, r["state_bytes"] / world))
            rows.append(Row(name, "bytes_total", float(sum(ours)), ANCHOR, float(sum(theirs))))
        if "async" in med:
            rows.append(Row(name, "async_stall_s", med["async"]["tessera"], "copy to host", med["async"]["copy"]))
    return rows


def run(
    ranks: int = 4,
    layouts: tuple[str, ...] = LAYOUTS,
    w: Workload | None = None,
    root: str | None = None,
    pools: PoolSet | None = None,
) -> list[Row]:
    """Rows for every layout in ``layouts``: blocking save and load against DCP on ``ranks``
    ranks, the asynchronous save (also at the workload's other widths) on ``w.stall_ranks``;
    the checkpoints go under a new temporary folder in ``root`` (default: the system's
    temporary folder), removed at the end. Each on a fresh pool, or on ``pools``'
    (:func:`~tessera.bench.pools.rank_pool`)."""
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown:
        raise ValueError(f"unknown layout(s) {', '.join(unknown)}; layouts: {', '.join(LAYOUTS)}")
    w = w or Workload()
    stall_ranks = w.stall_ranks or min(ranks, os.cpu_count() or ranks)
    folder = tempfile.mkdtemp(prefix="tessera-bench-ckpt-", dir=root)
    results: list[dict[str, Any]] = []
    try:
        for world, cases in zip((ranks, stall_ranks), cases_of(layouts, w)):
            with rank_pool(world, pools) as pool:
                results += pool.run(rank_body, cases, w, folder, timeout=1800)[0]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    for r in results:
        text = f"  {r['name']}: this rank's share of a save {r['share_bytes']:,} bytes (rank 0)"
        if "bytes" in r:
            text += (f"; bytes written per rank, tessera {r['bytes']['tessera']}, DCP {r['bytes']['dcp']}; "
                     f"model + optimizer state {r['state_bytes']:,} bytes")  # fmt: skip
        print(text, file=sys.stderr)
    return rows_of(results)


def main(args: argparse.Namespace) -> int:
    ranks = getattr(args, "ranks", None)
    rows = run(**({"ranks": ranks} if ranks else {}))
    print_rows(rows)
    if args.out:
        write_rows(rows, args.out)
    return 0
