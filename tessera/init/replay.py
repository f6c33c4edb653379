"""Running a :class:`~tessera.init.recording.Recording` on real memory for the tensors a rank keeps.

``replay(rec, targets)`` yields each target storage as soon as no later operation touches it,
then frees it; the caller takes what it needs (its block, its ZeRO piece) before asking for the
next. Only the operations a target's final value depends on run, plus every random draw (so
the stream advances exactly as in single-process construction): a draw whose values nobody
needs runs in chunks into a small scratch buffer (see :func:`chunks`). A storage lives
from the first operation that needs it to the last one, so the largest memory in use is about
one full tensor at a time for models initialised tensor by tensor (a layer's init, then the
model's own init), the GPT's and ViT's included.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_flatten, tree_map

from tessera.init.recording import Recording, Ref
from tessera.memory.report import trim_heap


def needed_ops(rec: Recording, targets: set[int]) -> tuple[list[bool], list[tuple[int, ...]]]:
    """For each op of ``rec``: whether it must run (it draws random numbers, or it makes or
    changes a storage whose value a target depends on), and the storages it writes whose values
    nobody needs afterwards (a draw into a weight that the model's init redraws later: freed
    right after the op). A backward liveness pass: an op that wholly overwrites or creates a
    storage ends the need for what the storage held before."""
    live = set(targets)
    needed = [False] * len(rec.ops)
    dead: list[tuple[int, ...]] = [()] * len(rec.ops)
    for i in range(len(rec.ops) - 1, -1, -1):
        op = rec.ops[i]
        written = {*op.creates, *op.writes}
        if op.rng or not live.isdisjoint(written):
            needed[i] = True
            dead[i] = tuple(written - live)
            live.difference_update(op.creates, op.overwrites)
            live.update(op.reads)
    return needed, dead


def _sids(op: Any) -> set[int]:
    return {*op.creates, *op.writes, *op.reads, *op.overwrites}


class Made(NamedTuple):
    """A target's final value: its whole ``storage``, or (windowed) only the elements
    ``[start, start + window.numel())`` of it as the 1-D tensor ``window``."""

    sid: int
    storage: Any
    window: torch.Tensor | None = None
    start: int = 0


def replay(
    rec: Recording,
    targets: set[int],
    device: torch.device | str = "cpu",
    stats: dict[str, int] | None = None,
    windows: dict[int, tuple[int, int]] | None = None,
    into: dict[int, torch.Tensor] | None = None,
    consume: bool = False,
) -> Iterator[Made]:
    """Yield each storage of ``targets`` (a :class:`Made`) once its value is final (valid until
    the next item is asked for). Draws from the default CPU generator starting at the state the
    recording began with; the caller restores the generator afterwards as it sees fit.

    ``windows``: for a target whose rank keeps only a range of its elements (a ZeRO piece),
    ``sid -> (start, end)``; where the target's value comes from whole-tensor draws and
    element-wise changes (a GPT weight: drawn, scaled, copied in), only that range is made,
    the draws running in chunks of :data:`CHUNK` elements over the whole stream (see
    :func:`chunks`); otherwise the whole storage is made. ``into``: where a windowed target's
    range goes (a CPU tensor of that many elements and the target's dtype, a ZeRO piece say):
    made there directly, with no window of its own. ``stats`` (if given) receives
    ``peak_bytes``: the most bytes of storages held at once. ``consume``: drop each operation
    of ``rec`` once it ran (and those never needed, at the start), so that the memory of the
    record is reused by what the replay makes; the recording cannot be replayed again."""
    if rec.consumed:
        raise ValueError("this recording was consumed by an earlier replay")
    device = torch.device(device)
    needed, dead = needed_ops(rec, targets)
    ops: list[Any] = rec.ops
    if consume:
        rec.consumed = True
        for i, flag in enumerate(needed):
            if not flag:
                ops[i] = None
    last: dict[int, int] = {}  # storage -> the last needed op that touches it
    for i, op in enumerate(ops):
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

    sliced, root = _windows(rec, needed, last, targets, windows or {})
    win: dict[int, torch.Tensor] = {}

    def window_of(sid: int, dtype: torch.dtype) -> torch.Tensor:
        """The memory of ``sid``'s range: the caller's tensor when it fits, else a new one."""
        start, end = sliced[sid]
        dest = (into or {}).get(root[sid])
        if dest is not None and dest.dtype == dtype and dest.device.type == "cpu" and dest.numel() == end - start:
            return dest.view(-1)
        return torch.empty(end - start, dtype=dtype, device=device)

    scratch = _Scratch(device)
    freed = 0  # bytes of storage dropped since the heap was last trimmed
    with torch.no_grad():
        for i, op in enumerate(ops):
            if not needed[i]:
                continue
            if freed >= _TRIM_AT:
                trim_heap()
                freed = 0
            touched = _sids(op)
            if op.rng and _draw_into_dead(rec, op, dead[i]):
                _draw_and_drop(rec, op, arg, scratch)  # only the stream advances; no full tensor is made
            elif touched & sliced.keys():
                _run_windowed(rec, op, sliced, win, arg, window_of, scratch)
            elif _moves(rec, op, last, targets, i):  # the source dies here: hand its storage over
                dst, src = op.args[0], op.args[1]
                real[dst.sid] = tensor(src).untyped_storage()
                real.pop(src.sid, None)
            else:
                real.update(_created(op, op.func(*tree_map(arg, op.args), **tree_map(arg, op.kwargs))))
            if stats is not None:
                held = sum(x.nbytes() for x in real.values()) + sum(w.numel() * w.element_size() for w in win.values())
                stats["peak_bytes"] = max(stats.get("peak_bytes", 0), held)
            for sid in dead[i]:  # drawn only to advance the stream
                win.pop(sid, None)
                freed += rec.nbytes[sid] if real.pop(sid, None) is not None else 0
            for sid in touched:
                if last.get(sid) != i:
                    continue
                if sid in sliced:
                    window = win.pop(sid, None)
                    if sid in targets and window is not None:
                        yield Made(sid, None, window, sliced[sid][0])
                    del window
                    continue
                storage = real.pop(sid, None)
                if storage is not None:
                    freed += storage.nbytes()
                if sid in targets and storage is not None:
                    yield Made(sid, storage)
                del storage
            if consume:
                ops[i] = None


# ---- making only a range of a tensor ---------------------------------------------------------

#: elements drawn per call when a draw runs in pieces (a multiple of 16: see :func:`chunks`)
CHUNK = 1 << 16

_DRAWS_IN_PLACE = {"normal_", "uniform_"}
_DRAWS_MADE = {"randn", "rand"}
_MADE = {"zeros", "ones", "full", "empty"}
_ELEMENTWISE = {
    "mul_", "add_", "sub_", "div_", "clamp_", "clamp_min_", "clamp_max_", "erfinv_", "fill_", "zero_",
    "neg_", "abs_", "sqrt_", "exp_", "log_", "pow_",
}  # fmt: skip


def chunks(n: int, size: int = CHUNK) -> list[tuple[int, int]]:
    """``[start, end)`` pieces of ``n`` elements: ``size`` each (a multiple of 16), the last
    one the remainder, or the previous piece with it when fewer than 16 are left. Drawing a
    tensor piece by piece this way gives bitwise the values (and leaves the generator where)
    one draw of the whole gives: the CPU generator fills normal values in groups of 16 and
    redraws the last 16 of a ragged tensor at the very end (a piece of under 16 would be drawn
    another way), and uniform values one by one (checked by a test for float32, float64 and
    bfloat16). A piece is thus at most ``size + 15`` elements."""
    starts = list(range(0, n, size)) or [0]
    if len(starts) > 1 and n - starts[-1] < 16:
        starts.pop()
    return [(a, starts[j + 1] if j + 1 < len(starts) else n) for j, a in enumerate(starts)]


def _name(op: Any) -> str:
    return str(getattr(op.func, "__name__", "")).split(".")[0]


def _tensor_args(op: Any) -> list[Any]:
    return [a for a in tree_flatten((op.args, op.kwargs))[0] if isinstance(a, Ref | torch.Tensor)]


def _kind(rec: Recording, op: Any, sid: int) -> str | None:
    """How ``op`` touches storage ``sid`` when it can be made in part: ``"made"`` (a whole new
    tensor of fixed values), ``"draw-made"`` (a new tensor of random values), ``"draw"`` (random
    values over the whole of it), ``"elementwise"`` (an element-wise change with constants);
    None for anything else."""
    name = _name(op)
    if sid in op.creates:
        if len(op.outputs) != 1 or not rec.whole(op.outputs[0]) or _tensor_args(op):
            return None
        return "made" if name in _MADE else "draw-made" if name in _DRAWS_MADE else None
    first = op.args[0] if op.args else None
    if not (isinstance(first, Ref) and first.sid == sid and rec.whole(first)) or len(_tensor_args(op)) != 1:
        return None
    return "draw" if name in _DRAWS_IN_PLACE else "elementwise" if name in _ELEMENTWISE else None


def _windows(
    rec: Recording,
    needed: list[bool],
    last: dict[int, int],
    targets: set[int],
    asked: dict[int, tuple[int, int]],
) -> tuple[dict[int, tuple[int, int]], dict[int, int]]:
    """The storages to make only in part: each asked target whose value depends on nothing but
    the ops :func:`_kind` accepts and moves from storages that do too (those with it); and for
    each, the target it ends in (at most one storage of a chain holds a value at a time: a
    move overwrites its destination whole)."""
    out: dict[int, tuple[int, int]] = {}
    roots: dict[int, int] = {}
    touching = _touching(rec, needed, last, targets, set(asked))
    for target, span in asked.items():
        chain: dict[int, tuple[int, int]] = {}
        todo, ok = [target], True
        while todo and ok:
            sid = todo.pop()
            chain[sid] = span
            for i in touching.get(sid, []):
                op = rec.ops[i]
                if _moves(rec, op, last, targets, i):
                    src = op.args[1].sid
                    if op.args[0].sid == sid and src not in chain and src not in out:
                        todo.append(src)
                        continue
                    ok = ok and src in chain  # the move out of a storage already in the chain
                elif _kind(rec, op, sid) is None:
                    ok = False
        if ok:
            out.update(chain)
            roots.update({sid: target for sid in chain})
    return out, roots


def _touching(
    rec: Recording, needed: list[bool], last: dict[int, int], targets: set[int], sids: set[int]
) -> dict[int, list[int]]:
    """The needed ops touching each of ``sids`` and of the storages moved into them (and into
    those), in order: only what :func:`_windows` walks, not every storage of the model."""
    out: dict[int, list[int]] = {}
    while sids:
        found: dict[int, list[int]] = {sid: [] for sid in sids}
        for i, op in enumerate(rec.ops):
            if needed[i]:
                for sid in _sids(op) & sids:
                    found[sid].append(i)
        out.update(found)
        sources = {rec.ops[i].args[1].sid for sid, ops in found.items() for i in ops
                   if _moves(rec, rec.ops[i], last, targets, i) and rec.ops[i].args[0].sid == sid}  # fmt: skip
        sids = sources - out.keys()
    return out


def _run_windowed(
    rec: Recording,
    op: Any,
    sliced: dict[int, tuple[int, int]],
    win: dict[int, torch.Tensor],
    arg: Any,
    window_of: Any,
    scratch: _Scratch,
) -> None:
    if _name(op) == "copy_" and len(op.args) >= 2 and isinstance(op.args[1], Ref) and op.args[1].sid in sliced:
        win[op.args[0].sid] = win.pop(op.args[1].sid)  # a move within the chain
        return
    sid = next(s for s in _sids(op) if s in sliced)
    start, end = sliced[sid]
    kind = _kind(rec, op, sid)
    rest = tree_map(arg, op.args[1:])
    kwargs = tree_map(arg, op.kwargs)
    if kind == "made":  # written in place: no second tensor of the window's size
        win[sid] = window_of(sid, op.outputs[0].dtype)
        _fill(win[sid], _name(op), rest)
        return
    if kind == "elementwise":
        op.func(win[sid], *rest, **kwargs)
        return
    ref = op.outputs[0] if kind == "draw-made" else op.args[0]
    if sid not in win:
        win[sid] = window_of(sid, ref.dtype)
    for a, b in chunks(ref.numel):
        piece = scratch.take(b - a, ref.dtype)
        _draw(op, kind, piece, rest, kwargs)
        lo, hi = max(a, start), min(b, end)
        if lo < hi:
            win[sid][lo - start : hi - start].copy_(piece[lo - a : hi - a])


def _fill(window: torch.Tensor, name: str, rest: Any) -> None:
    """What a factory op (``zeros``, ``ones``, ``full``, ``empty``) would have made, written
    into ``window``."""
    if name == "zeros":
        window.zero_()
    elif name == "ones":
        window.fill_(1)
    elif name == "full":
        window.fill_(rest[0])
    # empty: its values are whatever memory held; a later op overwrites them


def _draw(op: Any, kind: str | None, piece: torch.Tensor, rest: Any, kwargs: dict[str, Any]) -> None:
    """Draw ``op``'s values for ``piece.numel()`` elements into ``piece``. A made draw
    (``randn``, ``rand``) is ATen's empty tensor then ``normal_(0, 1)`` / ``uniform_(0, 1)``
    with the op's generator: the same values, in memory the caller reuses."""
    if kind == "draw-made":
        generator = kwargs.get("generator")
        if _name(op) == "randn":
            piece.normal_(0.0, 1.0, generator=generator)
        else:
            piece.uniform_(0.0, 1.0, generator=generator)
    else:
        op.func(piece, *rest, **kwargs)


class _Scratch:
    """One buffer reused for every piece of a chunked draw: a fresh tensor per piece would
    leave the heap fragmented (glibc does not always hand the same block back), and the
    resident size would grow by a few pieces over a model's replay."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.storage: Any = None

    def take(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = n * dtype.itemsize
        if self.storage is None or self.storage.nbytes() < nbytes:
            size = max(nbytes, (CHUNK + 15) * 8)  # the largest piece of chunks(), in float64
            self.storage = torch.UntypedStorage(size, device=self.device)
        return torch.empty(0, dtype=dtype, device=self.device).set_(self.storage, 0, (n,), (1,))


def _draw_into_dead(rec: Recording, op: Any, dead: tuple[int, ...]) -> bool:
    """Whether ``op`` draws random values over a whole storage that nobody reads afterwards."""
    written = {*op.creates, *op.writes}
    return len(written) == 1 and written.issubset(dead) and _kind(rec, op, next(iter(written))) in ("draw", "draw-made")


def _draw_and_drop(rec: Recording, op: Any, arg: Any, scratch: _Scratch) -> None:
    """Advance the stream as ``op`` would, in chunks, keeping none of the values."""
    sid = next(iter({*op.creates, *op.writes}))
    kind = "draw-made" if sid in op.creates else "draw"
    ref = op.outputs[0] if kind == "draw-made" else op.args[0]
    rest = tree_map(arg, op.args[1:])
    kwargs = tree_map(arg, op.kwargs)
    for a, b in chunks(ref.numel):
        _draw(op, kind, scratch.take(b - a, ref.dtype), rest, kwargs)


_TRIM_AT = 1 << 20  # bytes of storage freed before the heap is trimmed


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
    if _name(op) != "copy_" or len(op.args) < 2:
        return False
    dst, src = op.args[0], op.args[1]
    if not (isinstance(dst, Ref) and isinstance(src, Ref)) or dst.sid not in op.overwrites or dst.sid == src.sid:
        return False
    same = (src.dtype, src.size, src.stride, src.offset) == (dst.dtype, dst.size, dst.stride, dst.offset)
    return same and src.sid not in targets and last.get(src.sid) == i and rec.nbytes[src.sid] == rec.nbytes[dst.sid]
