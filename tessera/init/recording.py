"""Building a model without allocating it: ``tessera.deferred_init()`` records construction.

Inside the block every tensor is made on the meta device (shapes and dtypes, no memory) and
every operation on those tensors is written down in order: the ``empty`` a layer makes its
weight with, the ``uniform_`` its initialiser draws, the slicing a tensor-parallel layer keeps
its block with, the ``normal_`` a model's own init function redraws it with. The record is a
:class:`Recording`; ``tessera.init.replay`` runs the part of it that a rank needs, on real
memory, one tensor at a time, drawing from the random stream in the very order a
single-process build would have (so the values are the single-process ones).

What cannot be replayed is noted rather than failed on the spot: a model that reads a tensor's
value while it is built (``.item()``, ``if w.abs().max() > 1``) gets a made-up value (zero)
during the record, and ``initialize`` refuses the recording, saying where the read happened.
"""

from __future__ import annotations

import contextlib
import itertools
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from tessera._lazy_dynamo import EagerDispatchMode
from tessera.errors import TesseraError

__all__ = ["DeferredInitError", "Op", "Recording", "Ref", "continue_recording", "deferred_init", "recording_of"]


class DeferredInitError(TesseraError, RuntimeError):
    """A deferred model cannot be materialised as recorded (the message says what to do)."""


@dataclass(frozen=True, slots=True)
class Ref:
    """A tensor of the recording: storage ``sid`` seen as ``dtype`` with this size, stride and
    offset (in elements)."""

    sid: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.size:
            n *= s
        return n


# In-place ops that write every element of their first argument whatever it held before: after
# one of them (over a whole storage) the storage's earlier values are never needed.
_OVERWRITING = {
    "uniform_", "normal_", "random_", "bernoulli_", "exponential_", "geometric_", "cauchy_",
    "log_normal_", "fill_", "zero_", "copy_",
}  # fmt: skip


@dataclass(slots=True)
class Op:
    """One recorded operation: ``func(*args, **kwargs)`` with :class:`Ref` in place of the
    recorded tensors, its output refs, and which storages it creates, writes (in place), wholly
    overwrites and reads; ``rng``: whether it draws from a random generator."""

    func: Any
    args: Any
    kwargs: Any
    outputs: tuple[Ref, ...]
    creates: tuple[int, ...]
    writes: tuple[int, ...]
    overwrites: tuple[int, ...]
    reads: tuple[int, ...]
    rng: bool


def _ids(sids: set[int]) -> tuple[int, ...]:
    """``sids`` as a tuple (a model's recording holds thousands of these, most of them empty or
    of one storage: a tuple is a quarter of a set's size; the empty one is shared)."""
    return tuple(sids) if sids else ()


_PLAIN = {bool, int, float, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format}


class Recording:
    """The operations that built a deferred model, in order, with the random states they start
    from (the default CPU generator's at the start of the block; an explicit generator's when
    first used)."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.consumed = False  # replayed with consume=True: its ops are gone
        self.rng_state = torch.get_rng_state()
        self.exit_state = self.rng_state  # the default generator's state when the block ended
        self.generators: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        self.problems: list[str] = []
        self.values: Any = None  # where initialize takes the values from when given init="random"
        self.nbytes: dict[int, int] = {}  # sid -> bytes of its storage
        self._sids: dict[int, int] = {}  # storage address -> sid
        self._storages: list[Any] = []  # kept alive, so that no address is reused while recording
        self._refs: dict[tuple[Any, ...], Ref] = {}
        self._kwargs: dict[tuple[Any, ...], dict[str, Any]] = {}

    # ---- what the recorder calls -----------------------------------------------------------
    def ref(self, t: torch.Tensor) -> tuple[Ref, bool]:
        """The ref of meta tensor ``t`` and whether its storage is new to the recording."""
        storage = t.untyped_storage()
        address = storage._cdata
        new = address not in self._sids
        if new:
            self._sids[address] = len(self.nbytes)  # a new id even after settle() forgot some
            self._storages.append(storage)
            self.nbytes[self._sids[address]] = storage.nbytes()
        key = (self._sids[address], t.dtype, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))
        ref = self._refs.get(key)
        if ref is None:  # one object per distinct view: most ops name the same few tensors
            ref = self._refs[key] = Ref(*key)
        return ref, new

    def interned(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """One dict for every op called with the same keyword arguments (a factory's dtype,
        device and layout: most ops of a model share a handful)."""
        if not all(type(v) in _PLAIN for v in kwargs.values()):
            return kwargs  # tensors, lists, generators: kept as they are
        return self._kwargs.setdefault(tuple(kwargs.items()), kwargs)

    def settle(self) -> None:
        """At the end of the block: forget the storages no tensor uses any more (temporaries of
        construction). Their addresses were held only so that none was reused while recording;
        their ids, sizes and ops stay."""
        alive = []
        for storage in self._storages:
            if torch._C._storage_Use_Count(storage._cdata) > 1:  # a tensor besides this list
                alive.append(storage)
            else:
                del self._sids[storage._cdata]
        self._storages = alive
        self._refs.clear()  # only for sharing refs while recording
        self._kwargs.clear()

    def drop_lookup(self) -> None:
        """Once the model's tensors are captured as refs (``initialize``, before the replay):
        the map from live storages to ids is no longer needed; the recording then no longer
        answers ``recording_of`` / ``sid_of``."""
        self._sids.clear()
        self._storages.clear()

    def whole(self, ref: Any) -> bool:
        """Whether ``ref`` is all of its storage, contiguous (so an op that writes every element
        of it leaves nothing of what the storage held)."""
        if not isinstance(ref, Ref) or ref.offset != 0 or ref.numel * ref.dtype.itemsize != self.nbytes[ref.sid]:
            return False
        stride = 1
        for size, got in zip(reversed(ref.size), reversed(ref.stride)):
            if got != stride and size != 1:
                return False
            stride *= size
        return True

    def sid_of(self, t: torch.Tensor) -> int | None:
        """The storage id of meta tensor ``t`` (None when the recording never saw it)."""
        if not isinstance(t, torch.Tensor) or not t.is_meta:
            return None
        return self._sids.get(t.untyped_storage()._cdata)

    def ref_of(self, t: torch.Tensor) -> Ref | None:
        sid = self.sid_of(t)
        if sid is None:
            return None
        return Ref(sid, t.dtype, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))

    def note_generator(self, value: Any) -> None:
        if isinstance(value, torch.Generator) and id(value) not in self.generators:
            self.generators[id(value)] = (value, value.get_state())


_recordings: list[Recording] = []  # recordings whose model has not been materialised yet


def recording_of(tensors: Any) -> Recording | None:
    """The recording that made the first meta tensor among ``tensors`` (None if none is meta)."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_meta:
            for rec in reversed(_recordings):
                if rec.sid_of(t) is not None:
                    return rec
            raise DeferredInitError(
                "the model has tensors on the meta device that tessera.deferred_init() did not record; "
                "build it inside `with tessera.deferred_init():` (or with real tensors)"
            )
    return None


def forget(rec: Recording) -> None:
    """Drop a recording once its model is materialised."""
    if rec in _recordings:
        _recordings.remove(rec)


def _user_frame() -> str:
    """Where in the user's code the current operation comes from (file:line and the line)."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        path = frame.filename.replace("\\", "/")
        if (
            "/torch/" in path
            or "/tessera/init/" in path
            or path.endswith("/tessera/graph_breaks.py")
            or path.startswith("<")
        ):
            continue
        return f"{frame.filename}:{frame.lineno} ({(frame.line or '').strip()})"
    return "an unknown place"


# torch.nn.init functions that do nothing on the meta device (they draw a data-dependent number
# of values, or read them): recorded as one call each and run as called when replayed.
_OPAQUE_INIT = ("trunc_normal_", "orthogonal_", "dirac_", "sparse_")


def _opaque(rec: Recording, original: Any) -> Any:
    def init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not (isinstance(tensor, torch.Tensor) and tensor.is_meta):
            return original(tensor, *args, **kwargs)
        ref, _ = rec.ref(tensor)
        for value in (*args, *kwargs.values()):
            rec.note_generator(value)
        mine = (ref.sid,)
        whole = rec.whole(ref)
        rec.ops.append(Op(original, (ref, *args), kwargs, (), (), mine, mine if whole else (), () if whole else mine,
                          True))  # fmt: skip
        return tensor

    return init


def _seeding(rec: Recording, original: Any) -> Any:
    """``torch.manual_seed`` and ``torch.set_rng_state`` inside the block: done now (draws after
    the block see them) and recorded, so that the replay's draws start where they did."""

    def seed(*args: Any, **kwargs: Any) -> Any:
        rec.ops.append(Op(original, args, kwargs, (), (), (), (), (), True))
        return original(*args, **kwargs)

    return seed


_SEEDING = (
    (torch, "manual_seed"),
    (torch.random, "manual_seed"),
    (torch, "set_rng_state"),
    (torch.random, "set_rng_state"),
)


def _draws_in_place(func: Any) -> bool:
    """``func`` fills its first argument in place with random draws (``normal_``, ``uniform_``...)."""
    schema = func._schema
    if torch.Tag.nondeterministic_seeded not in func.tags or not schema.arguments or len(schema.returns) != 1:
        return False
    first, out = schema.arguments[0].alias_info, schema.returns[0].alias_info
    return first is not None and first.is_write and out is not None and out.before_set == first.before_set


_FAKE_SCALARS = {"_local_scalar_dense", "equal", "is_nonzero"}


class _Recorder(EagerDispatchMode):
    def __init__(self, rec: Recording) -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        flat_in, _ = tree_flatten((args, kwargs))
        if not any(isinstance(t, torch.Tensor) and t.is_meta for t in flat_in):
            out = func(*args, **kwargs)
            flat_out, _ = tree_flatten(out)
            if not any(isinstance(t, torch.Tensor) and t.is_meta for t in flat_out):
                return out  # nothing of the deferred model
        elif func.__name__.split(".")[0] in _FAKE_SCALARS:
            self.rec.problems.append(f"{_user_frame()} reads a tensor's value ({func.__name__})")
            return False if func.__name__.startswith(("equal", "is_nonzero")) else 0
        elif _draws_in_place(func) and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            # a meta tensor filled at random is still the same meta tensor: recorded, not run
            # (torch's meta kernels of the random fills import torch._dynamo, a second a process)
            out = args[0]
        else:
            out = func(*args, **kwargs)
        return self._record(func, args, kwargs, out)

    def _record(self, func: Any, args: Any, kwargs: Any, out: Any) -> Any:
        rec = self.rec
        reads: set[int] = set()
        writes: set[int] = set()
        overwrites: set[int] = set()
        for i, arg in enumerate(func._schema.arguments):  # the arguments the op writes in place
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if isinstance(value, torch.Tensor) and value.is_meta and arg.alias_info and arg.alias_info.is_write:
                writes.add(rec.ref(value)[0].sid)

        def to_ref(value: Any) -> Any:
            rec.note_generator(value)
            if isinstance(value, torch.Tensor) and value.is_meta:
                ref, _ = rec.ref(value)
                reads.add(ref.sid)
                return ref
            return value  # constants, and real tensors made outside the block (kept as they are)

        rec_args = tree_map(to_ref, args)
        rec_kwargs = tree_map(to_ref, kwargs)
        name = func.__name__.split(".")[0]
        if name in _OVERWRITING and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            target = rec.ref(args[0])[0]
            if rec.whole(target):
                overwrites.add(target.sid)
        outputs: list[Ref] = []
        creates: set[int] = set()
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and value.is_meta:
                ref, new = rec.ref(value)
                outputs.append(ref)
                if new:
                    creates.add(ref.sid)
        rng = torch.Tag.nondeterministic_seeded in func.tags
        rec.ops.append(
            Op(func, rec_args, rec.interned(rec_kwargs), tuple(outputs), _ids(creates), _ids(writes),
               _ids(overwrites), _ids(reads - overwrites), rng)
        )  # fmt: skip
        return out


@contextlib.contextmanager
def deferred_init() -> Iterator[Recording]:
    """Build models without allocating them::

        with tessera.deferred_init():
            model = MyModel(...)
        engine, *_ = tessera.initialize(model, optimizer, ...)

    Inside the block tensors are made on the meta device and every operation on them is
    recorded; ``initialize`` then makes only what this rank keeps (its tensor-parallel blocks,
    its pipeline stages' layers, its ZeRO-3 pieces), with the values single-process
    construction would have given under the same seed. Yields the :class:`Recording`."""
    rec = Recording()
    _recordings.append(rec)
    try:
        with _recording_into(rec):
            yield rec
    finally:
        rec.exit_state = torch.get_rng_state()


@contextlib.contextmanager
def continue_recording(model: torch.nn.Module) -> Iterator[Recording | None]:
    """Record what is done to the deferred ``model`` after its construction (a tensor-parallel
    policy cutting its weights into blocks, say) into the recording that built it, so that the
    new tensors are made like the others when the model is materialised. Yields that recording;
    for a model with no meta tensor nothing is recorded and it yields None."""
    rec = recording_of(itertools.chain(model.parameters(), model.buffers()))
    if rec is None:
        yield None
        return
    with _recording_into(rec):
        yield rec


@contextlib.contextmanager
def _recording_into(rec: Recording) -> Iterator[Recording]:
    """Tensors made on the meta device and every operation on them recorded into ``rec``."""
    patched = [(torch.nn.init, name, _opaque) for name in _OPAQUE_INIT]
    patched += [(module, name, _seeding) for module, name in _SEEDING]
    originals = [(module, name, getattr(module, name)) for module, name, _ in patched]
    try:
        for (module, name, wrap), (_, _, original) in zip(patched, originals):
            setattr(module, name, wrap(rec, original))
        with torch.device("meta"), _Recorder(rec):
            yield rec
    finally:
        for module, name, original in originals:
            setattr(module, name, original)
        rec.settle()
