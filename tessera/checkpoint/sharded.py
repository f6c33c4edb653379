"""Sharded checkpoints: every rank writes what it holds, any layout loads them.

``save(path, engine)`` is collective. Each rank lists what it holds through its strategy
(``Strategy.checkpoint_tensors``: parameters as tensor-parallel blocks, ZeRO pieces or whole,
with the optimizer states that share their views), the ranks exchange these lists (a few
hundred bytes per tensor, as JSON), and every rank works out the same plan: each distinct piece
is written once, by the holder that has written the fewest bytes so far, so replicas share the
writing. The pieces go into a hidden folder ``.<name>.partial``; rank 0 writes the index when
every rank has reported, then renames the folder into place. A checkpoint folder with an
``index.json`` is complete; anything else is not a checkpoint (``latest`` never picks it).

With ``blocking=False`` the pieces are first copied into host memory (the only time training
waits), then written by a background thread; ``wait()`` on the returned handle, or the next
``save``, waits for it.

Saving the same tensors again (the usual case: one engine saved every so many steps) costs no
new plan: each rank keeps its share of the last save (which pieces it writes, and for
asynchronous saves the host buffer they are copied into, the size of those pieces), checks that
it holds the same pieces (names, views, dtypes, sizes) and the ranks agree on that in one
all-reduce of one integer; if any rank's pieces changed, every rank plans anew. The kept host
buffer spares an asynchronous save the allocation (page faults, or pinning on a GPU host) of its
copy; it stays allocated between saves.

Loading is ``tessera.checkpoint.loading``; finding and pruning checkpoint folders is
``tessera.checkpoint.folders``.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessera import comm
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
from tessera.checkpoint.runstate import jsonable, layout_of, rng_json, rng_tensors
from tessera.context import ParallelContext
from tessera.context.views import HeldTensor, View, whole_view


@dataclass
class _Piece:
    name: str
    tensor: torch.Tensor
    view: View

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.view.full_shape),
            "dtype": dtype_name(self.tensor.dtype),
            "view": self.view.to_json(),
            "nbytes": self.tensor.numel() * self.tensor.element_size(),
        }


# ---- what a rank holds ---------------------------------------------------------------------------


def optimizer_params(optimizer: Any) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _held_pieces(engine: Any) -> tuple[list[_Piece], dict[str, dict[str, Any]]]:
    """This rank's tensors for the checkpoint (model values, optimizer states, RNG) and the
    optimizer's non-tensor per-parameter state, by parameter key."""
    strategy, ctx = engine.strategy, engine.ctx
    held: list[HeldTensor] = strategy.checkpoint_tensors()
    pieces = [_Piece(f"model/{h.key}", h.tensor, h.view) for h in held]
    by_id = {id(h.tensor): h for h in held}
    optimizer = strategy.optimizer
    params = optimizer_params(optimizer)
    other: dict[str, dict[str, Any]] = {}
    for index, state in optimizer.state_dict()["state"].items():
        h = by_id.get(id(params[index]))
        if h is None:
            continue  # a parameter this rank does not train (another stage's)
        for key, value in state.items():
            name = f"optim/{h.key}/{key}"
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                if value.numel() != h.tensor.numel():
                    raise CheckpointError(
                        f"optimizer state {key!r} of {h.key} has {value.numel()} elements, its parameter "
                        f"{h.tensor.numel()}: only states shaped like their parameter can be resharded"
                    )
                pieces.append(_Piece(name, value, h.view))
            elif isinstance(value, torch.Tensor):
                pieces.append(_Piece(name, value, whole_view(())))
            else:
                other.setdefault(h.key, {})[key] = jsonable(value)
    for key, value in rng_tensors(ctx).items():
        pieces.append(_Piece(f"rng/rank{ctx.rank}/{key}", value, whole_view(value.shape)))
    return pieces, other


def _exchange(data: Any, ctx: ParallelContext) -> list[Any]:
    """Every rank's ``data`` (JSON), in rank order (collective over the world; no pickling)."""
    group = ctx.group("world")
    payload = json.dumps(data, separators=(",", ":")).encode()
    if group.size == 1:
        return [data]
    length = torch.tensor([len(payload)], dtype=torch.int64, device=ctx.device)
    lengths = comm.all_gather(length, group).tolist()
    buffer = torch.zeros(max(lengths), dtype=torch.uint8)
    buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    gathered = comm.all_gather(buffer.to(ctx.device), group).cpu().view(group.size, -1)
    return [json.loads(bytes(gathered[r, :n].numpy())) for r, n in enumerate(lengths)]


def _plan_key(name: str, view: dict[str, Any]) -> tuple[Any, ...]:
    """A distinct piece: its name and (the JSON of) its view, hashable."""
    flat = view["flat"]
    return (name, tuple(view["local_shape"]), repr(view["segments"]), tuple(flat) if flat is not None else None)


def _plan(described: list[list[dict[str, Any]]]) -> dict[tuple[Any, ...], int]:
    """Which rank writes each distinct piece ``(name, view)``: the holder with the fewest bytes
    assigned so far, largest pieces first (the same answer on every rank)."""
    holders: dict[tuple[Any, ...], list[int]] = {}
    sizes: dict[tuple[Any, ...], int] = {}
    for rank, pieces in enumerate(described):
        for p in pieces:
            key = _plan_key(p["name"], p["view"])
            holders.setdefault(key, []).append(rank)
            sizes[key] = p["nbytes"]
    load = [0] * len(described)
    plan: dict[tuple[Any, ...], int] = {}
    for key in sorted(holders, key=lambda k: (-sizes[k], repr(k))):
        writer = min(holders[key], key=lambda r: (load[r], r))
        plan[key] = writer
        load[writer] += sizes[key]
    return plan


@dataclass
class _Share:
    """A rank's share of a save, kept for the next save while what every rank holds is the same:
    ``signature`` of this rank's pieces (names, views, dtypes, sizes: all the plan depends on),
    ``keys`` (key in this rank's file, index of the piece) of the pieces it writes, and the
    host buffer asynchronous saves copy them into."""

    ctx: ParallelContext
    signature: list[tuple[str, View, torch.dtype, int]]
    keys: list[tuple[str, int]]
    staging: _Staging | None = None


_kept: list[_Share] = []  # the last share (one engine saving repeatedly is the common case)


def _signature(pieces: list[_Piece]) -> list[tuple[str, View, torch.dtype, int]]:
    return [(p.name, p.view, p.tensor.dtype, p.tensor.numel()) for p in pieces]


def _kept_share(pieces: list[_Piece], ctx: ParallelContext) -> _Share | None:
    """The kept share if this rank holds what it held then (not yet agreed with the others)."""
    if _kept and _kept[0].ctx is ctx and _kept[0].signature == _signature(pieces):
        return _kept[0]
    return None


def _agreed(kept: _Share | None, ctx: ParallelContext) -> Any:
    """Start asking every rank whether its kept share still holds (collective: one integer);
    the returned future is true when every rank's does."""
    changed = torch.tensor([0 if kept is not None else 1], dtype=torch.int64, device=ctx.device)
    return comm.all_reduce_async(changed, ctx.group("world")).then(lambda f: int(f.value()[0]) == 0)


def _share(pieces: list[_Piece], ctx: ParallelContext, kept: _Share | None = None, agreed: Any = None) -> _Share:
    """The pieces this rank writes (collective). ``kept`` and ``agreed`` (:func:`_agreed`) may
    be given if already asked; when every rank's kept share holds, no plan is made anew."""
    if agreed is None:
        kept = _kept_share(pieces, ctx)
        agreed = _agreed(kept, ctx)
    if agreed.wait() and kept is not None:
        return kept
    _kept.clear()
    described = _exchange([p.describe() for p in pieces], ctx)
    plan = _plan(described)
    keys: list[tuple[str, int]] = []
    for n, p in enumerate(pieces):
        if plan[_plan_key(p.name, p.view.to_json())] == ctx.rank:
            keys.append((f"{p.name}@{ctx.rank}.{n}", n))
    share = _Share(ctx, _signature(pieces), keys)
    _kept.append(share)
    return share


def _mine(share: _Share, pieces: list[_Piece]) -> list[tuple[str, _Piece]]:
    return [(key, pieces[n]) for key, n in share.keys]


class _Staging:
    """Host memory for an asynchronous save's snapshot of this rank's share: one buffer, kept
    between saves of the same share (no allocation, no page faults), filled in one call."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        offsets, total = [], 0
        for t in tensors:
            total = -(-total // 64) * 64  # every piece 64-byte aligned
            offsets.append(total)
            total += t.numel() * t.element_size()
        pin = any(t.device.type == "cuda" for t in tensors) and torch.cuda.is_available()
        self.buffer = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
        self.views = [
            self.buffer[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for o, t in zip(offsets, tensors)
        ]
        self.layout = [(t.dtype, t.shape) for t in tensors]

    def fits(self, tensors: list[torch.Tensor]) -> bool:
        return self.layout == [(t.dtype, t.shape) for t in tensors]

    def copy(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The values of ``tensors`` now, in host memory (valid until the next copy)."""
        sources = [t.detach() for t in tensors]
        if all(t.device.type == "cpu" for t in sources):
            if sources:
                torch._foreach_copy_(self.views, sources)
        else:
            for view, t in zip(self.views, sources):
                view.copy_(t, non_blocking=True)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        return self.views


def _snapshot(share: _Share, pieces: list[_Piece]) -> list[tuple[str, _Piece]]:
    """This rank's pieces copied to host memory (the share's staging buffer)."""
    mine = _mine(share, pieces)
    tensors = [p.tensor for _, p in mine]
    if share.staging is None or not share.staging.fits(tensors):
        share.staging = _Staging(tensors)
    copies = share.staging.copy(tensors)
    return [(key, _Piece(p.name, c, p.view)) for (key, p), c in zip(mine, copies)]


def held_tensors(engine: Any) -> list[tuple[str, torch.Tensor, View]]:
    """Every tensor this rank holds for a checkpoint, under its index name (``model/<key>``,
    ``optim/<key>/<state>``, ``rng/rank<r>/<name>``) with its view in full coordinates."""
    return [(p.name, p.tensor, p.view) for p in _held_pieces(engine)[0]]


def written_share(engine: Any) -> list[torch.Tensor]:
    """The tensors this rank writes when ``engine`` is saved (replicas share the writing): what
    ``save(..., blocking=False)`` copies to host memory. Collective."""
    pieces = _held_pieces(engine)[0]
    return [p.tensor for _, p in _mine(_share(pieces, engine.ctx), pieces)]


# ---- saving ----------------------------------------------------------------------------------------


class SaveHandle:
    """A save in progress (``blocking=False``) or done: :meth:`wait` returns when this rank's
    part is written (and, on rank 0, the checkpoint is complete), raising what the writer raised."""

    def __init__(self, path: Path, finished: threading.Event | None = None) -> None:
        self.path = path
        self._finished = finished
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self._finished is None or self._finished.is_set()

    def wait(self) -> Path:
        if self._finished is not None:
            self._finished.wait()
            self._finished = None
        if self.error is not None:
            error, self.error = self.error, None
            raise CheckpointError(f"saving {self.path} failed: {error}") from error
        return self.path


class _Writer:
    """The thread that writes asynchronous saves, one after another; started once per process
    and kept (starting a thread per save would add its start-up to the time training waits)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="tessera-checkpoint", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def _run(self) -> None:
        _lower_thread_priority()
        while True:
            self._jobs.get()()


def _lower_thread_priority(niceness: int = 10) -> None:
    """Run the calling thread at a lower CPU priority (Linux: per thread), so that writing a
    checkpoint in the background yields the cores to training, including to other ranks still
    taking their snapshot. Elsewhere, or if refused, nothing changes."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except (AttributeError, OSError):
        pass


_writer = _Writer()
_pending: list[SaveHandle] = []


def wait_for_saves() -> None:
    """Wait for this process's asynchronous saves to finish."""
    while _pending:
        _pending.pop(0).wait()


def partial_folder(path: Path) -> Path:
    return path.parent / f".{path.name}.partial"


def save(
    path: str | Path,
    engine: Any,
    *,
    dataloader: Any = None,
    extra: dict[str, Any] | None = None,
    blocking: bool = True,
) -> SaveHandle:
    """Save everything ``engine``'s run needs to continue into the folder ``path`` (collective:
    every rank calls it). Returns a handle; with ``blocking=False`` the files are written in the
    background and ``handle.wait()`` (or the next save) waits for them."""
    wait_for_saves()
    ctx: ParallelContext = engine.ctx
    final = Path(path)
    partial = partial_folder(final)
    if ctx.rank == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        if partial.exists():
            shutil.rmtree(partial)  # left by a save that was killed
        partial.mkdir()
    pieces, other = _held_pieces(engine)
    kept = _kept_share(pieces, ctx)
    agreed = _agreed(kept, ctx)  # collective; also: rank 0's folder exists once it completes
    try:
        # asynchronous, and this rank's share is as before: copy it while the ranks agree
        early = _snapshot(kept, pieces) if kept is not None and not blocking else None
        share = _share(pieces, ctx, kept, agreed)
    except BaseException:
        _kept.clear()  # the next save plans anew on every rank
        raise
    report: dict[str, Any] = {"rank": ctx.rank, "rng": rng_json(), "optimizer_other": other}
    state = _run_state(engine, dataloader, extra, ctx) if ctx.rank == 0 else None
    if blocking:
        _write(partial, final, ctx, _mine(share, pieces), report, state)
        comm.barrier(ctx.group("world"))  # complete when every rank returns
        return SaveHandle(final)
    # the pieces to host memory now; the writing later
    snapshot = early if early is not None and share is kept else _snapshot(share, pieces)
    finished = threading.Event()
    handle = SaveHandle(final, finished)

    def run() -> None:
        try:
            _write(partial, final, ctx, snapshot, report, state)
        except BaseException as exc:  # reported by wait()
            handle.error = exc
        finally:
            finished.set()

    _writer.submit(run)
    _pending.append(handle)
    return handle


def _write(
    partial: Path,
    final: Path,
    ctx: ParallelContext,
    mine: list[tuple[str, _Piece]],
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


def _run_state(engine: Any, dataloader: Any, extra: dict[str, Any] | None, ctx: ParallelContext) -> dict[str, Any]:
    """The JSON part of the index (rank 0's view of the run)."""
    optimizer = engine.strategy.optimizer
    groups = [{k: jsonable(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    scheduler = getattr(engine, "lr_scheduler", None)
    return {
        "format": FORMAT,
        "version": VERSION,
        "step": engine.global_step,
        "layout": layout_of(ctx),
        "strategy": engine.strategy.name,
        "options": jsonable(engine.options),
        "config": jsonable(getattr(engine, "run_config", None)),
        "engine": jsonable(engine.state_dict()),
        "optimizer": {"param_groups": groups},
        "scheduler": jsonable(scheduler.state_dict()) if scheduler is not None else None,
        "dataloader": dataloader.state_dict() if dataloader is not None and hasattr(dataloader, "state_dict") else None,
        "extra": jsonable(extra) if extra is not None else None,
        "aliases": aliases(engine.module),
    }


def aliases(module: torch.nn.Module) -> dict[str, str]:
    """Second and later state-dict keys of tied parameters -> the key they are saved under."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for key, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            out[key] = first[id(param)]
        else:
            first[id(param)] = key
    return out
