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

``load(path, engine)`` fills each rank's tensors from the pieces that overlap them
(``tessera.checkpoint.placing``), so a checkpoint written under one layout loads into any other.
"""

from __future__ import annotations

import json
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
    read_index,
    read_json,
    reading,
    write_json,
    write_pieces,
)
from tessera.checkpoint.placing import fill
from tessera.checkpoint.runstate import jsonable, layout_of, restore_float, restore_rng, rng_json, rng_tensors
from tessera.context import ParallelContext
from tessera.context.views import HeldTensor, View, whole_view
from tessera.parallel.strategy import state_dict_keys

# optimizer settings that choose a kernel, not the arithmetic: the loading optimizer keeps its own
_KERNEL_KEYS = ("fused", "foreach", "capturable", "differentiable")


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


def _optimizer_params(optimizer: Any) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _held_pieces(engine: Any) -> tuple[list[_Piece], dict[str, dict[str, Any]]]:
    """This rank's tensors for the checkpoint (model values, optimizer states, RNG) and the
    optimizer's non-tensor per-parameter state, by parameter key."""
    strategy, ctx = engine.strategy, engine.ctx
    held: list[HeldTensor] = strategy.checkpoint_tensors()
    pieces = [_Piece(f"model/{h.key}", h.tensor, h.view) for h in held]
    by_id = {id(h.tensor): h for h in held}
    optimizer = strategy.optimizer
    params = _optimizer_params(optimizer)
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


def _plan(described: list[list[dict[str, Any]]]) -> dict[tuple[str, str], int]:
    """Which rank writes each distinct piece ``(name, view)``: the holder with the fewest bytes
    assigned so far, largest pieces first (the same answer on every rank)."""
    holders: dict[tuple[str, str], list[int]] = {}
    sizes: dict[tuple[str, str], int] = {}
    for rank, pieces in enumerate(described):
        for p in pieces:
            key = (p["name"], json.dumps(p["view"], sort_keys=True))
            holders.setdefault(key, []).append(rank)
            sizes[key] = p["nbytes"]
    load = [0] * len(described)
    plan: dict[tuple[str, str], int] = {}
    for key in sorted(holders, key=lambda k: (-sizes[k], k)):
        writer = min(holders[key], key=lambda r: (load[r], r))
        plan[key] = writer
        load[writer] += sizes[key]
    return plan


# ---- saving ----------------------------------------------------------------------------------------


class SaveHandle:
    """A save in progress (``blocking=False``) or done: :meth:`wait` returns when this rank's
    part is written (and, on rank 0, the checkpoint is complete), raising what the writer raised."""

    def __init__(self, path: Path, thread: threading.Thread | None = None) -> None:
        self.path = path
        self._thread = thread
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Path:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise CheckpointError(f"saving {self.path} failed: {error}") from error
        return self.path


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
    described = _exchange([p.describe() for p in pieces], ctx)  # also: rank 0's folder exists now
    plan = _plan(described)
    mine: list[tuple[str, _Piece]] = []
    for n, p in enumerate(pieces):
        if plan[(p.name, json.dumps(p.view.to_json(), sort_keys=True))] == ctx.rank:
            mine.append((f"{p.name}@{ctx.rank}.{n}", p))
    report: dict[str, Any] = {"rank": ctx.rank, "rng": rng_json(), "optimizer_other": other}
    state = _run_state(engine, dataloader, extra, ctx) if ctx.rank == 0 else None
    if blocking:
        _write(partial, final, ctx, mine, report, state, described)
        comm.barrier(ctx.group("world"))  # complete when every rank returns
        return SaveHandle(final)
    # the pieces to host memory now; the writing later
    snapshot = [(key, _Piece(p.name, p.tensor.detach().to("cpu", copy=True), p.view)) for key, p in mine]
    handle = SaveHandle(final)

    def run() -> None:
        try:
            _write(partial, final, ctx, snapshot, report, state, described)
        except BaseException as exc:  # reported by wait()
            handle.error = exc

    thread = threading.Thread(target=run, name="tessera-checkpoint", daemon=True)
    handle._thread = thread
    thread.start()
    _pending.append(handle)
    return handle


def _write(
    partial: Path,
    final: Path,
    ctx: ParallelContext,
    mine: list[tuple[str, _Piece]],
    report: dict[str, Any],
    state: dict[str, Any] | None,
    described: list[list[dict[str, Any]]],
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
            time.sleep(0.01)
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
    aliases = _aliases(engine.module)
    return {
        "format": FORMAT,
        "version": VERSION,
        "step": engine.global_step,
        "layout": layout_of(ctx),
        "strategy": engine.strategy.name,
        "options": jsonable(engine.options),
        "engine": jsonable(engine.state_dict()),
        "optimizer": {"param_groups": groups},
        "scheduler": jsonable(scheduler.state_dict()) if scheduler is not None else None,
        "dataloader": dataloader.state_dict() if dataloader is not None and hasattr(dataloader, "state_dict") else None,
        "extra": jsonable(extra) if extra is not None else None,
        "aliases": aliases,
    }


def _aliases(module: torch.nn.Module) -> dict[str, str]:
    """Second and later state-dict keys of tied parameters -> the key they are saved under."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for key, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            out[key] = first[id(param)]
        else:
            first[id(param)] = key
    return out


# ---- loading ---------------------------------------------------------------------------------------


def load(path: str | Path, engine: Any, *, dataloader: Any = None) -> int:
    """Load the checkpoint folder ``path`` into ``engine`` (any layout; collective) and, if
    given, ``dataloader``'s position; returns the step it was saved at."""
    wait_for_saves()
    folder = Path(path)
    index = read_index(folder)
    strategy, ctx = engine.strategy, engine.ctx
    held: list[HeldTensor] = strategy.checkpoint_tensors()
    tensors = index["tensors"]
    _check_model(engine.module, held, tensors, folder)
    with reading(folder) as reader:
        for h in held:
            fill(reader, f"model/{h.key}", tensors[f"model/{h.key}"], h.tensor, h.view)
        _load_optimizer(strategy.optimizer, held, index, reader)
        same_layout = index["layout"] == layout_of(ctx)
        if same_layout:
            prefix = f"rng/rank{ctx.rank}/"
            rng = {
                name[len(prefix) :]: reader.read(name, entry["pieces"][0])
                for name, entry in tensors.items()
                if name.startswith(prefix)
            }
            restore_rng(ctx, rng, index["ranks"][str(ctx.rank)]["rng"])
    strategy.checkpoint_loaded()
    engine.load_state_dict(index["engine"])
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is not None and index.get("scheduler") is not None:
        scheduler.load_state_dict(index["scheduler"])
    if dataloader is not None and index.get("dataloader") is not None:
        dataloader.load_state_dict(index["dataloader"])
    return int(index["step"])


def _check_model(module: torch.nn.Module, held: list[HeldTensor], tensors: dict[str, Any], folder: Path) -> None:
    """Fail, naming them, on keys the checkpoint lacks or has beyond the model, and on shapes."""
    expected = state_dict_keys(module) - set(_aliases(module))
    stored = {name[len("model/") :] for name in tensors if name.startswith("model/")}
    missing, unexpected = sorted(expected - stored), sorted(stored - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {folder} does not fit the model: missing {_listed(missing)}, unexpected {_listed(unexpected)}"
        )
    wrong = [
        f"{h.key}: checkpoint {tuple(tensors[f'model/{h.key}']['shape'])}, model {h.view.full_shape}"
        for h in held
        if tuple(tensors[f"model/{h.key}"]["shape"]) != h.view.full_shape
    ]
    if wrong:
        raise CheckpointError(f"checkpoint {folder} does not fit the model: shapes differ: {'; '.join(wrong)}")


def _listed(keys: list[str], at_most: int = 8) -> str:
    shown = ", ".join(keys[:at_most])
    return f"[{shown}{', ...' if len(keys) > at_most else ''}] ({len(keys)})" if keys else "none"


def _load_optimizer(optimizer: Any, held: list[HeldTensor], index: dict[str, Any], reader: Any) -> None:
    """Rebuild this rank's optimizer state (its pieces or blocks) and hyperparameters, and load
    it through the optimizer's own ``load_state_dict`` (which places the tensors)."""
    tensors = index["tensors"]
    saved_groups = index["optimizer"]["param_groups"]
    other = index["optimizer"].get("other", {})
    names_of: dict[str, list[str]] = {}
    for name in tensors:
        if name.startswith("optim/"):
            key, state = name[len("optim/") :].rsplit("/", 1)
            names_of.setdefault(key, []).append(state)
    by_id = {id(h.tensor): h for h in held}
    current = optimizer.state_dict()
    if len(current["param_groups"]) != len(saved_groups):
        raise CheckpointError(
            f"the optimizer has {len(current['param_groups'])} parameter groups, the checkpoint {len(saved_groups)}"
        )
    states: dict[int, dict[str, Any]] = {}
    for i, param in enumerate(_optimizer_params(optimizer)):
        h = by_id.get(id(param))
        if h is None or (h.key not in names_of and h.key not in other):
            continue
        entry: dict[str, Any] = {}
        for state_name in names_of.get(h.key, []):
            name = f"optim/{h.key}/{state_name}"
            stored = tensors[name]
            if stored["shape"] == []:
                entry[state_name] = reader.read(name, stored["pieces"][0]).clone()
            else:
                value = torch.empty(h.tensor.shape, dtype=dtype_of(stored["dtype"]))
                fill(reader, name, stored, value, h.view)
                entry[state_name] = value
        entry.update({k: restore_float(v) for k, v in other.get(h.key, {}).items()})
        states[i] = entry
    for group, saved in zip(current["param_groups"], saved_groups):
        group.update({k: _group_value(group.get(k), v) for k, v in saved.items() if k not in _KERNEL_KEYS})
    current["state"] = states
    optimizer.load_state_dict(current)


def _group_value(current: Any, saved: Any) -> Any:
    """A saved hyperparameter in the type the optimizer holds it (tuples stay tuples)."""
    if isinstance(current, tuple) and isinstance(saved, list):
        return tuple(saved)
    return restore_float(saved)


# ---- finding checkpoints ---------------------------------------------------------------------------


def is_complete(path: str | Path) -> bool:
    """Whether ``path`` is a finished checkpoint folder (it has its index)."""
    return (Path(path) / INDEX).is_file()


def step_folder(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}"


def complete_checkpoints(directory: str | Path) -> list[Path]:
    """The complete checkpoints under ``directory`` (``step-*`` folders with an index), oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: p.name)


def latest(directory: str | Path) -> Path | None:
    """The newest complete checkpoint under ``directory``, or None."""
    found = complete_checkpoints(directory)
    return found[-1] if found else None


def prune(directory: str | Path, keep_last: int, *, keep: Callable[[Path], bool] = lambda p: False) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints under ``directory``."""
    found = complete_checkpoints(directory)
    doomed = [p for p in found[: max(0, len(found) - keep_last)] if not keep(p)]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed
