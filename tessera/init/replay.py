"""Running a :class:`~tessera.init.recording.Recording` on real memory for the tensors a rank keeps.

``replay(rec, targets)`` yields each target storage as soon as no later operation touches it,
then frees it; the caller takes what it needs (its block, its ZeRO piece) before asking for the
next. Only the operations a target's final value depends on run, plus every random draw (so
the stream advances exactly as in single-process construction): a draw whose values nobody
needs runs into a scratch buffer of its tensor's size that is freed at once. A storage lives
from the first operation that needs it to the last one, so the largest memory in use is about
one full tensor at a time for models initialised tensor by tensor (a layer's init, then the
model's own init), the GPT's and ViT's included.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from tessera.init.recording import Recording, Ref


def needed_ops(rec: Recording, targets: set[int]) -> tuple[list[bool], list[frozenset[int]]]:
    """For each op of ``rec``: whether it must run (it draws random numbers, or it makes or
    changes a storage whose value a target depends on), and the storages it writes whose values
    nobody needs afterwards (a draw into a weight that the model's init redraws later: freed
    right after the op). A backward liveness pass: an op that wholly overwrites or creates a
    storage ends the need for what the storage held before."""
    live = set(targets)
    needed = [False] * len(rec.ops)
    dead: list[frozenset[int]] = [frozenset()] * len(rec.ops)
    for i in range(len(rec.ops) - 1, -1, -1):
        op = rec.ops[i]
        if op.rng or (op.creates | op.writes) & live:
            needed[i] = True
            dead[i] = (op.creates | op.writes) - live
            live -= op.creates | op.overwrites
            live |= op.reads
    return needed, dead


def _sids(op: Any) -> set[int]:
    return set(op.creates | op.writes | op.reads | op.overwrites)


def replay(
    rec: Recording, targets: set[int], device: torch.device | str = "cpu", stats: dict[str, int] | None = None
) -> Iterator[tuple[int, Any]]:
    """Yield ``(sid, storage)`` for each storage in ``targets`` once its value is final (valid
    until the next item is asked for). Draws from the default CPU generator starting at the
    state the recording began with; the caller restores the generator afterwards as it sees fit.
    ``stats`` (if given) receives ``peak_bytes``: the most bytes of storages held at once."""
    device = torch.device(device)
    needed, dead = needed_ops(rec, targets)
    last: dict[int, int] = {}
    for i, op in enumerate(rec.ops):
        if needed[i]:
            for sid in _sids(op):
                last[sid] = i
    torch.set_rng_state(rec.rng_state)
    for generator, state in rec.generators.values():
        generator.set_state(state)
    real: dict[int, Any] = {}

    def tensor(ref: Ref) -> torch.Tensor:
        storage = real.get(ref.sid)
        if storage is None:  # first touched by an op that overwrites it (or draws into it)
            storage = real[ref.sid] = torch.UntypedStorage(rec.nbytes[ref.sid], device=device)
        return torch.empty(0, dtype=ref.dtype, device=device).set_(storage, ref.offset, ref.size, ref.stride)

    def arg(value: Any) -> Any:
        if isinstance(value, Ref):
            return tensor(value)
        if isinstance(value, torch.device) and value.type == "meta":
            return device
        return value

    freed = 0  # bytes of storage dropped since the heap was last trimmed
    with torch.no_grad():
        for i, op in enumerate(rec.ops):
            if not needed[i]:
                continue
            if freed >= _TRIM_AT:
                _trim_heap()
                freed = 0
            if _moves(rec, op, last, targets, i):  # the source dies here: hand its storage over
                dst, src = op.args[0], op.args[1]
                real[dst.sid] = tensor(src).untyped_storage()
                real.pop(src.sid, None)
            else:
                real.update(_created(op, op.func(*tree_map(arg, op.args), **tree_map(arg, op.kwargs))))
            if stats is not None:
                held = sum(s.nbytes() for s in real.values())
                stats["peak_bytes"] = max(stats.get("peak_bytes", 0), held)
            for sid in dead[i]:
                freed += rec.nbytes[sid] if real.pop(sid, None) is not None else 0  # drawn only to advance the stream
            for sid in _sids(op):
                if last.get(sid) == i:
                    storage = real.pop(sid, None)
                    if storage is not None:
                        freed += storage.nbytes()
                    if sid in targets and storage is not None:
                        yield sid, storage
                    del storage


_TRIM_AT = 1 << 20


def _trim_heap() -> None:
    """Hand freed heap memory back to the system (glibc's ``malloc_trim``; nothing elsewhere).
    glibc keeps freed blocks of a few MB in its heap and does not always reuse them for the
    next block of the same size (alignment), so without this each full tensor drawn and freed
    would stay resident and the replay's footprint would grow to several full tensors."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None


def _created(op: Any, out: Any) -> dict[int, Any]:
    """The storages ``op`` made (by storage id), from its output ``out`` (nothing else of the
    output is kept: a draw into scratch memory must be freed as soon as it is dropped)."""
    flat = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    return {ref.sid: value.untyped_storage() for ref, value in zip(op.outputs, flat) if ref.sid in op.creates}


def _moves(rec: Recording, op: Any, last: dict[int, int], targets: set[int], i: int) -> bool:
    """Whether ``op`` is a ``copy_`` that wholly overwrites its destination from a source of the
    very same layout whose value is not needed afterwards (a model's init drawing a full tensor
    and copying it into a parameter): the source's storage can become the destination's, which
    keeps one full tensor in memory instead of two."""
    if getattr(op.func, "__name__", "").split(".")[0] != "copy_" or len(op.args) < 2:
        return False
    dst, src = op.args[0], op.args[1]
    if not (isinstance(dst, Ref) and isinstance(src, Ref)) or dst.sid not in op.overwrites or dst.sid == src.sid:
        return False
    same = (src.dtype, src.size, src.stride, src.offset) == (dst.dtype, dst.size, dst.stride, dst.offset)
    return same and src.sid not in targets and last.get(src.sid) == i and rec.nbytes[src.sid] == rec.nbytes[dst.sid]
