"""Making a deferred model's tensors, only those this rank keeps, from a source of values.

``initialize`` builds the strategy over the deferred model (its tensors still on the meta
device: a strategy allocates what it keeps, ZeRO-3 only its chunk shards), then calls
:func:`materialise`, which fills what the strategy holds (``Strategy.checkpoint_tensors``: its
tensor-parallel blocks, ZeRO pieces, the stage's parameters) and the module's buffers from one
of the sources, one tensor at a time:

- ``"random"``: the recorded construction, replayed (``tessera.init.replay``): the values of a
  single-process build under the same seed;
- a checkpoint folder (``tessera.checkpoint.save``'s format) or a ``.safetensors`` file with the
  full state under single-process keys: read tensor by tensor, each rank only its slices (a
  file's tensor is read whole, one at a time);
- ``init_fn(name, shape, dtype) -> tensor``: the full value of each tensor, one at a time;
- a :class:`ValueSource`: an object that writes each tensor's values for the views asked
  (a Hugging Face folder read slice by slice: ``tessera.hf.weights``). A model whose
  recording names a source (``Recording.values``: a loader built it) is filled from that
  source when ``init`` is ``"random"``.

Buffers and tensors a model keeps as plain attributes (a causal mask) are made whole on every
rank; they are not in checkpoints when not persistent, so they always come from the replay (or
``init_fn``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from tessera.checkpoint.format import CheckpointError, dtype_of, index_entry, read_header
from tessera.checkpoint.placing import fill
from tessera.context.placement import placement_of
from tessera.context.views import View, whole_view
from tessera.init.recording import DeferredInitError, Recording, Ref, forget
from tessera.init.replay import replay
from tessera.memory.deferred import allocate_module, module_tensors
from tessera.memory.report import trim_heap
from tessera.parallel.strategy import view_of

InitFn = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]
UNRECORDED = -1  # the storage id of a deferred tensor the recording did not make


@runtime_checkable
class ValueSource(Protocol):
    """Values of a model's tensors read only where a rank needs them."""

    def holds(self, key: str) -> bool:
        """Whether the source has the tensor of state-dict key ``key`` (one it lacks is made by
        a deferred model's recorded construction; a model built normally keeps its value)."""
        ...

    def fill(self, key: str, targets: list[tuple[torch.Tensor, View]]) -> None:
        """Write the values of tensor ``key`` into each target: a tensor and its view in full
        coordinates (a tensor-parallel block, a ZeRO piece of one, or the whole)."""
        ...


Source = str | Path | InitFn | ValueSource


@dataclass(slots=True)
class Want:
    """One tensor of the deferred model: its key (state-dict key, or module path of a plain
    attribute), where it lives (``owner``'s parameter, buffer or attribute ``attr``), its
    recorded ref and its block's view in full coordinates (a tensor-parallel block's)."""

    key: str
    owner: nn.Module
    attr: str
    kind: str  # "parameter", "buffer" or "attribute"
    ref: Ref
    view: View
    targets: list[tuple[torch.Tensor, View]] = field(default_factory=list)

    def live(self) -> torch.Tensor:
        if self.kind == "parameter":
            return self.owner._parameters[self.attr]  # type: ignore[return-value]
        if self.kind == "buffer":
            return self.owner._buffers[self.attr]  # type: ignore[return-value]
        return getattr(self.owner, self.attr)  # type: ignore[no-any-return]


def _view(kind: str, t: torch.Tensor) -> View:
    return view_of(t) if kind == "parameter" else whole_view(t.shape)


def capture(module: nn.Module, rec: Recording) -> list[Want]:
    """Every deferred tensor of ``module`` (tied parameters once, under their first key), taken
    before a strategy replaces any of them."""
    wants = []
    for key, owner, attr, kind, t in module_tensors(module):
        ref = rec.ref_of(t)
        if ref is None and t.is_meta:  # made on the meta device after the construction (a base
            ref = Ref(UNRECORDED, t.dtype, tuple(t.shape), tuple(t.stride()), 0)  # quantized while loading)
        if ref is not None:
            wants.append(Want(key, owner, attr, kind, ref, _view(kind, t)))
    return wants


def loadable(module: nn.Module) -> list[Want]:
    """The parameters and persistent buffers of a model built normally, as wants (for loading
    a checkpoint or a file into it through :func:`materialise`)."""
    keys = _state_keys(module)
    return [
        Want(key, owner, attr, kind, Ref(-1, t.dtype, tuple(t.shape), tuple(t.stride()), 0), _view(kind, t))
        for key, owner, attr, kind, t in module_tensors(module)
        if key in keys
    ]


def check_recording(rec: Recording, model: nn.Module, source: Source) -> None:
    """Refuse a recording that cannot be replayed (unless ``init_fn`` makes every value)."""
    if rec.problems and not callable(source):
        where = "; ".join(rec.problems[:3]) + (f" (and {len(rec.problems) - 3} more)" if len(rec.problems) > 3 else "")
        raise DeferredInitError(
            f"{type(model).__name__} cannot be initialised from its deferred construction: it reads tensor values "
            f"while it is built ({where}), and on the meta device those values do not exist. Build it outside "
            "tessera.deferred_init(), or pass init=fn to initialize, where fn(name, shape, dtype) returns the full "
            "initial value of each parameter and buffer (or init='path' to load them from a checkpoint)"
        )


def materialise(strategy: Any, wants: list[Want], rec: Recording | None, source: Source, device: torch.device) -> None:
    """Fill what ``strategy`` holds of the model, and the module's deferred buffers, from
    ``source`` (see the module docstring); then let the strategy's derived copies follow."""
    allocate_module(strategy.module, device, strategy.holds)
    if rec is not None and rec.values is not None and isinstance(source, str) and source == "random":
        source = rec.values  # a loader built the model and named its values
    if rec is not None:
        rec.drop_lookup()  # the strategy is built: its memory goes to the replay's bookkeeping
    by_key = {w.key: w for w in wants}
    groups = strategy.checkpoint_groups()  # one, unless the strategy holds more than fits at once
    for number, group in enumerate(groups):
        last = number == len(groups) - 1
        with group as held_tensors:
            for want in wants:
                want.targets.clear()
            for held in held_tensors:
                found = by_key.get(held.key)
                if found is not None:
                    found.targets.append((held.tensor, held.view))
            if number == 0:
                for want in wants:  # non-persistent buffers, attributes (not those a chunk store shards: its pieces)
                    if want.kind != "parameter" and not want.targets and placement_of(want.live()).storage is None:
                        want.targets.append((want.live(), want.view))
            _fill(strategy, [w for w in wants if w.targets], rec, source, consume=last)
    strategy.checkpoint_loaded()
    if rec is not None:
        forget(rec)


def _fill(strategy: Any, wants: list[Want], rec: Recording | None, source: Source, consume: bool) -> None:
    """Fill the targets of ``wants`` from ``source`` (``consume``: the replay may use up the
    recording: no group follows)."""
    holds = source.holds if isinstance(source, ValueSource) else (lambda key: False)
    unmade = [w.key for w in wants if w.ref.sid == UNRECORDED and not callable(source) and not holds(w.key)]
    if unmade and (isinstance(source, ValueSource) or source == "random"):  # a file is checked as it is read
        raise DeferredInitError(
            f"{', '.join(unmade[:4])}{' ...' if len(unmade) > 4 else ''}: made on the meta device after the deferred "
            "construction (a base quantized before it was made), and nothing gives their values: quantize a "
            "deferred base whose values come from a folder (tessera.hf.from_pretrained), or build the model whole"
        )
    if isinstance(source, ValueSource):
        lacking = [w for w in wants if not source.holds(w.key)]  # made by the construction, or kept
        for want in wants:
            if source.holds(want.key):
                source.fill(want.key, want.targets)
        if lacking and rec is not None:
            _fill_from_replay(lacking, rec, consume)
    elif callable(source):
        _fill_from_fn(wants, source)
    elif source == "random":
        assert rec is not None
        _fill_from_replay(wants, rec, consume)
    else:
        saved = _state_keys(strategy.module)
        resident = [w for w in wants if w.kind != "parameter" and w.key not in saved]
        _fill_from_file(Path(source), [w for w in wants if w not in resident])
        if resident and rec is not None:
            _fill_from_replay(resident, rec, consume)


def _state_keys(module: nn.Module) -> set[str]:
    return set(module.state_dict(keep_vars=True).keys())


class _Values:
    """A reader over values at hand, for ``tessera.checkpoint.placing.fill``."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def read(self, name: str, piece: dict[str, Any]) -> torch.Tensor:
        return self.value


def _put(want: Want, value: torch.Tensor, view: View) -> None:
    """Write ``value`` (the tensor's values over ``view``: its block, or the whole) into every
    target of ``want``."""
    entry = index_entry(view.full_shape, value.dtype)
    entry["pieces"].append({"file": "", "key": want.key, **view.to_json()})
    reader = _Values(value)
    for tensor, target_view in want.targets:
        fill(reader, want.key, entry, tensor, target_view)  # type: ignore[arg-type]


def _fill_from_replay(wants: list[Want], rec: Recording, consume: bool = True) -> None:
    state = torch.get_rng_state()
    untouched = torch.equal(state, rec.exit_state)  # nothing drew between construction and now
    pending: dict[int, list[Want]] = {}
    for want in wants:
        if want.targets:
            pending.setdefault(want.ref.sid, []).append(want)
    pieces = _pieces(pending)
    into = {sid: pending[sid][0].targets[0][0] for sid in pieces}
    for made in replay(rec, set(pending), windows=pieces, into=into, consume=consume):
        for want in pending.pop(made.sid):
            if made.window is not None:  # only this rank's piece was made (in place, when it could)
                for tensor, _ in want.targets:
                    if made.window.data_ptr() != tensor.data_ptr():
                        tensor.copy_(made.window.view(tensor.shape))
                continue
            ref = want.ref
            value = torch.empty(0, dtype=ref.dtype).set_(made.storage, ref.offset, ref.size, ref.stride)
            _put(want, value, want.view)
    trim_heap()  # what the replay freed (its last storages, its bookkeeping) is not kept resident
    if not untouched:
        torch.set_rng_state(state)  # draws made since construction keep their place
    if pending:
        keys = [w.key for ws in pending.values() for w in ws]
        raise DeferredInitError(f"the recorded construction never made {', '.join(keys[:5])}")


def _pieces(pending: dict[int, list[Want]]) -> dict[int, tuple[int, int]]:
    """Storages of which this rank keeps one flat range (a ZeRO piece): storage id -> range."""
    out = {}
    for sid, wants in pending.items():
        if len(wants) != 1:
            continue
        want = wants[0]
        flats = {view.flat for _, view in want.targets}
        if len(flats) == 1 and None not in flats and all(view.block == want.view for _, view in want.targets):
            (span,) = flats
            assert span is not None
            out[sid] = span
    return out


def _fill_from_fn(wants: list[Want], init_fn: InitFn) -> None:
    for want in wants:
        if not want.targets:
            continue
        shape = want.view.full_shape
        value = init_fn(want.key, shape, want.ref.dtype)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise DeferredInitError(
                f"init_fn({want.key!r}, {shape}, {want.ref.dtype}) returned {got}, not a tensor of {shape}"
            )
        _put(want, value.detach().cpu(), whole_view(shape))


def _fill_from_file(path: Path, wants: list[Want]) -> None:
    if path.is_dir():
        from tessera.checkpoint.format import read_index, reading

        index = read_index(path)
        tensors = index["tensors"]
        missing = [w.key for w in wants if f"model/{w.key}" not in tensors]
        if missing:
            raise DeferredInitError(f"{path} has no values for {', '.join(missing[:8])}")
        with reading(path) as reader:
            for want in wants:
                for tensor, view in want.targets:
                    fill(reader, f"model/{want.key}", tensors[f"model/{want.key}"], tensor, view)
        return
    if not path.is_file():
        raise DeferredInitError(f"init={str(path)!r}: no such checkpoint folder or safetensors file")
    try:
        header, size = read_header(path)
    except ValueError as exc:
        raise DeferredInitError(f"{path} is not a safetensors file: {exc}") from exc
    header.pop("__metadata__", None)
    missing = [w.key for w in wants if w.targets and w.key not in header]
    if missing:
        raise DeferredInitError(f"{path} has no values for {', '.join(missing[:8])}")
    data = size - max((int(e["data_offsets"][1]) for e in header.values()), default=0)  # where the data starts
    with open(path, "rb") as handle:
        for want in wants:
            if want.targets:
                value = _read_tensor(handle, header[want.key], data, want.key, path)
                if tuple(value.shape) != want.view.full_shape:
                    raise DeferredInitError(
                        f"{path}: {want.key} has shape {tuple(value.shape)}, the model {want.view.full_shape}"
                    )
                _put(want, value, whole_view(want.view.full_shape))
                del value  # one full tensor at a time


def _read_tensor(handle: Any, entry: dict[str, Any], data: int, key: str, path: Path) -> torch.Tensor:
    """One tensor of a safetensors file whose data starts at byte ``data``, read with plain file
    reads, not a memory map: pages of a mapped file count in the resident size for as long as
    the file is mapped, so a mapped read of every tensor would make the whole file resident."""
    try:
        dtype = dtype_of(entry["dtype"])
    except CheckpointError:
        raise DeferredInitError(f"{path}: {key} has dtype {entry['dtype']}, which tessera does not read") from None
    start, end = entry["data_offsets"]
    out = torch.empty(entry["shape"], dtype=dtype)
    buffer = out.view(-1).view(torch.uint8).numpy() if out.numel() else bytearray()
    handle.seek(data + start)
    if end - start != len(buffer) or handle.readinto(buffer) != end - start:
        raise DeferredInitError(f"{path}: {key} is truncated or its offsets are wrong")
    return out
