"""Sharded checkpoints: every rank writes what it holds, any layout loads them.

``save(path, engine)`` is collective. Each rank lists what it holds
(``tessera.checkpoint.holding``: parameters as tensor-parallel blocks, ZeRO pieces or whole,
with the optimizer states that share their views, and its random states), the ranks agree on
who writes each piece (``tessera.checkpoint.planning``: each distinct piece once, replicas
sharing the writing; the plan is kept while the same tensors are saved again). The pieces go
into a hidden folder ``.<name>.partial``; rank 0 writes the index when every rank has reported,
then renames the folder into place. A checkpoint folder with an ``index.json`` is complete;
anything else is not a checkpoint (``latest`` never picks it).

With ``blocking=False`` the call copies the rank's pieces into host memory (a buffer kept
between saves) and records the counters, scheduler and data position, and returns: that is all
training waits for. The writer thread (``tessera.checkpoint.background``) then agrees on the
plan with the other ranks' writers, over a process group of their own, and writes the files;
``wait()`` on the returned handle, or the next ``save``, waits for it. Every rank must pass the
same ``blocking``.

Loading is ``tessera.checkpoint.loading``; finding and pruning checkpoint folders is
``tessera.checkpoint.folders``.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch

from tessera import comm
from tessera.checkpoint import planning
from tessera.checkpoint.background import SaveHandle, Staging, submit, wait_for_saves
from tessera.checkpoint.format import (
    FORMAT,
    INDEX,
    VERSION,
    CheckpointError,
    dtype_name,
    dtype_of,
    fsync_folder,
    index_entry,
    rank_file,
    rank_report,
    read_json,
    write_json,
    write_pieces,
)
from tessera.checkpoint.holding import Holding, Piece, forget_listings, holding, kinds
from tessera.checkpoint.protocols import TrainingState
from tessera.checkpoint.runstate import jsonable, layout_of, rng_json, rng_states
from tessera.context import ParallelContext
from tessera.context.views import View

__all__ = ["SaveHandle", "held_tensors", "partial_folder", "save", "wait_for_saves", "written_share"]


def held_tensors(engine: TrainingState) -> list[tuple[str, torch.Tensor, View]]:
    """Every tensor this rank holds for a checkpoint, under its index name (``model/<key>``,
    ``optim/<key>/<state>``, ``rng/rank<r>/<name>``) with its view in full coordinates."""
    with engine.strategy.checkpoint_session():
        return [(p.name, p.tensor, p.view) for p in holding(engine).pieces]


def written_share(engine: TrainingState) -> list[torch.Tensor]:
    """The tensors this rank writes when ``engine`` is saved (replicas share the writing): what
    ``save(..., blocking=False)`` copies to host memory. Collective."""
    wait_for_saves()
    with engine.strategy.checkpoint_session():
        held = holding(engine)
        share = planning.share(held.signature, engine.ctx)
        return [held.pieces[n].tensor for _, n in share.keys]


def partial_folder(path: Path) -> Path:
    return path.parent / f".{path.name}.partial"


def _fresh_partial(final: Path) -> Path:
    """The empty hidden folder a save of ``final`` writes into (rank 0; what a killed save left
    there is removed)."""
    partial = partial_folder(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir()
    return partial


def save(
    path: str | Path,
    engine: TrainingState,
    *,
    dataloader: Any = None,
    extra: dict[str, Any] | None = None,
    blocking: bool = True,
) -> SaveHandle:
    """Save everything ``engine``'s run needs to continue into the folder ``path`` (collective:
    every rank calls it, with the same ``blocking``). Returns a handle; with ``blocking=False``
    the files are written in the background and ``handle.wait()`` (or the next save) waits for
    them."""
    wait_for_saves()
    ctx: ParallelContext = engine.ctx
    final = Path(path)
    if blocking:
        with engine.strategy.checkpoint_session():
            return _save_now(final, engine, dataloader, extra)
    # collective the first time: every rank is in this call
    group = ctx.side_group("checkpoint") if ctx.world_size > 1 else None
    partial = partial_folder(final)
    with engine.strategy.checkpoint_session():
        held = holding(engine, check_layout=False)  # _snapshot checks what it copies
        snapshot = _snapshot(held, ctx)
        if snapshot is None:  # a tensor changed dtype or shape in place: list anew
            forget_listings()
            held = holding(engine)
            snapshot = _snapshot(held, ctx)
            assert snapshot is not None
        kept, copied, staging, tensors = snapshot
        # the rest first, the copy last: what runs after it finds the CPU's caches cold
        counters = _counters(engine, dataloader, extra, held) if ctx.rank == 0 else None
        python_rng = rng_states()
        other = jsonable(held.other)
        views = staging.copy(tensors)

    def job() -> None:
        failed = None
        if ctx.rank == 0:  # before the agreement: the other ranks write once it is reached
            try:
                _fresh_partial(final)
            except Exception as exc:  # the others hear of it in the agreement rather than wait
                failed = f"rank 0 could not make {partial}: {exc}"
        try:
            keys = planning.settle(held.signature, ctx, kept, copied, group, failed)
        except BaseException:
            planning.forget()
            raise
        copies = dict(zip(copied, views))
        mine = [(key, Piece(held.pieces[n].name, copies[n], held.pieces[n].view)) for key, n in keys]
        report = {"rank": ctx.rank, "rng": rng_json(python_rng), "optimizer_other": other}
        _write(partial, final, ctx, mine, report, _run_state(engine, counters) if counters is not None else None)
        _prepare_staging(ctx, held)

    return submit(final, job)


def _snapshot(
    held: Holding, ctx: ParallelContext
) -> tuple[planning.Share | None, list[int], Staging, list[torch.Tensor]] | None:
    """What this rank copies into host memory for an asynchronous save: its kept share if it has
    one, else everything it holds. The kept share (or None), the indices to copy, the host
    buffer they go into and the tensors; None if one of those tensors no longer has the dtype
    and shape the kept listing gave it (the buffer is laid out for those).

    Only the tensors this rank copies are checked: every piece of a save is copied, so checked,
    by the rank that writes it; a rank that finds one changed lists anew, and then every rank
    plans anew (:func:`planning.settle`), so a change seen by one writer reaches the plan; a
    rank whose share later takes such a piece checks it then."""
    kept = planning.kept_share(held.signature, ctx)
    if kept is not None:
        copied = kept.indices
        if kept.staging is None:
            kept.staging = Staging(kinds(held.signature, copied), pin=ctx.device.type == "cuda")
        staging = kept.staging
    else:  # this rank's tensors changed (or its first save)
        copied = list(range(len(held.pieces)))
        staging = Staging(kinds(held.signature, copied), pin=ctx.device.type == "cuda")
    pieces = held.pieces
    tensors = [pieces[n].tensor for n in copied]
    if held.kept and not staging.holds(tensors):
        return None
    return kept, copied, staging, tensors


def _save_now(final: Path, engine: TrainingState, dataloader: Any, extra: dict[str, Any] | None) -> SaveHandle:
    ctx: ParallelContext = engine.ctx
    partial = _fresh_partial(final) if ctx.rank == 0 else partial_folder(final)
    held = holding(engine)
    started = planning.start_agreeing(held.signature, ctx)  # collective; rank 0's folder exists after it
    try:
        share = planning.share(held.signature, ctx, started)
    except BaseException:
        planning.forget()  # the next save plans anew on every rank
        raise
    report = {"rank": ctx.rank, "rng": rng_json(), "optimizer_other": jsonable(held.other)}
    counters = _counters(engine, dataloader, extra, held) if ctx.rank == 0 else None
    mine = [(key, held.pieces[n]) for key, n in share.keys]
    _write(partial, final, ctx, mine, report, _run_state(engine, counters) if counters is not None else None)
    comm.barrier(ctx.group("world"))  # complete when every rank returns
    return SaveHandle(final)


def _prepare_staging(ctx: ParallelContext, held: Holding) -> None:
    """After an asynchronous save planned anew: the host buffer for the next save's share,
    allocated and touched now, in the background, rather than during the next save."""
    share = planning.kept_share(held.signature, ctx)
    if share is not None and share.staging is None:
        indices = share.indices
        share.staging = Staging(kinds(held.signature, indices), pin=ctx.device.type == "cuda", touch=True)


def _write(
    partial: Path,
    final: Path,
    ctx: ParallelContext,
    mine: list[tuple[str, Piece]],
    report: dict[str, Any],
    state: dict[str, Any] | None,
) -> None:
    """Write this rank's file and report; rank 0 then waits for every report, writes the index
    and renames the folder into place."""
    crcs = write_pieces(partial / rank_file(ctx.rank), [(key, p.tensor) for key, p in mine]) if mine else {}
    report["pieces"] = [
        {"key": key, "name": p.name, "view": p.view.to_json(), "crc32": crcs[key], "shape": list(p.view.full_shape),
         "dtype": dtype_name(p.tensor.dtype)}
        for key, p in mine
    ]  # fmt: skip
    report["file"] = rank_file(ctx.rank) if mine else None
    write_json(partial / rank_report(ctx.rank), report)
    if ctx.rank != 0:
        return
    assert state is not None
    reports = _await_reports(partial, ctx.world_size)
    tensors: dict[str, dict[str, Any]] = {}
    for r in reports:
        for p in r["pieces"]:
            entry = tensors.setdefault(p["name"], index_entry(p["shape"], dtype_of(p["dtype"])))
            entry["pieces"].append({"file": r["file"], "key": p["key"], "crc32": p["crc32"], **p["view"]})
    state["optimizer"]["other"] = {k: v for r in reports for k, v in r["optimizer_other"].items()}
    state["ranks"] = {str(r["rank"]): {"rng": r["rng"]} for r in reports}
    state["tensors"] = tensors
    write_json(partial / INDEX, state)
    fsync_folder(partial)
    _swap_into_place(partial, final)


def _await_reports(partial: Path, world: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + comm.get_timeout()
    reports: list[dict[str, Any]] = []
    for rank in range(world):
        report = partial / rank_report(rank)
        while not report.exists():
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"rank {rank} did not finish writing its part of {partial} within {comm.get_timeout():g}s"
                )
            time.sleep(0.002)
        reports.append(read_json(report, "rank report"))
    return reports


def _swap_into_place(partial: Path, final: Path) -> None:
    """Rename the finished folder to ``final``; an older checkpoint there goes only after."""
    old = final.parent / f".{final.name}.old"
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        final.rename(old)
    partial.rename(final)
    fsync_folder(final.parent)
    if old.exists():
        shutil.rmtree(old)


def _counters(engine: TrainingState, dataloader: Any, extra: dict[str, Any] | None, held: Holding) -> dict[str, Any]:
    """What changes as training goes on, besides tensors, as JSON now (rank 0): the engine's
    counters and loss scaler, the optimizer's hyperparameters, the scheduler, the data position,
    ``extra``."""
    optimizer = engine.strategy.optimizer
    scheduler = engine.lr_scheduler
    return {
        "step": engine.global_step,
        "engine": jsonable(engine.state_dict()),
        "param_groups": [{k: _frozen(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "scheduler": jsonable(scheduler.state_dict()) if scheduler is not None else None,
        "dataloader": dataloader.state_dict() if dataloader is not None and hasattr(dataloader, "state_dict") else None,
        "extra": jsonable(extra) if extra is not None else None,
        "aliases": held.aliases,
    }


def _frozen(value: Any) -> Any:
    """``value`` as it is now: a number, string or None as it is (JSON later, in the
    background), anything else (a tensor, a list: they may change in place) as JSON now."""
    return value if value is None or type(value) in (int, float, bool, str) else jsonable(value)


def _run_state(engine: TrainingState, counters: dict[str, Any]) -> dict[str, Any]:
    """The JSON part of the index (rank 0's view of the run): ``counters`` (:func:`_counters`)
    and what stays as it was when the run started (layout, options, config)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "step": counters["step"],
        "layout": layout_of(engine.ctx),
        "strategy": engine.strategy.name,
        "options": jsonable(engine.options),
        "config": jsonable(engine.run_config),
        "engine": counters["engine"],
        "optimizer": {"param_groups": jsonable(counters["param_groups"])},
        "scheduler": counters["scheduler"],
        "dataloader": counters["dataloader"],
        "extra": counters["extra"],
        "aliases": counters["aliases"],
    }
