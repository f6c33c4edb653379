"""Activation checkpointing: blocks whose activations are recomputed in the backward pass
instead of kept from the forward.

``full``: a block keeps only its inputs; its whole forward runs again when the backward reaches
it. ``selective``: a block keeps the outputs of its matrix multiplies (the Linear layers' ``mm``
and ``addmm``) and recomputes the rest: attention scores and probabilities, and the elementwise
ops (LayerNorm, GELU, dropout, residual adds), which are cheap to redo and hold most of the
bytes. Both are built on ``torch.utils.checkpoint`` (non-reentrant); for ``selective`` a
dispatch mode keeps the matmul outputs in the forward and hands them back in the recompute
(any number of recomputes: zero-bubble's split backward runs one per half).

The recompute draws the same random numbers as the forward: torch's default generators are
restored by ``torch.utils.checkpoint`` and tessera's per-axis streams (tensor-parallel dropout)
by :class:`_SameStreams`, so dropout masks replay exactly and the gradients are bitwise those of
training without checkpointing.

Which modules are blocks: ``checkpoint_blocks(model, predicate)``, or by default every module
marked with :func:`mark_block` (tessera's transformer blocks are).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from tessera._lazy_dynamo import EagerDispatchMode
from tessera.context import ParallelContext
from tessera.context.rng import RNGStreams
from tessera.nn.layers import resolve_context

MODES = ("none", "full", "selective")
_BLOCK = "_tessera_block"
_SAVED_OPS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default})


def mark_block(cls: type[nn.Module]) -> type[nn.Module]:
    """Mark a module class as a block that :func:`checkpoint_blocks` recomputes by default."""
    setattr(cls, _BLOCK, True)
    return cls


def is_block(name: str, module: nn.Module) -> bool:
    return bool(getattr(type(module), _BLOCK, False))


_COUNTERS: list[list[int]] = []


@contextlib.contextmanager
def kept_matmul_bytes() -> Iterator[list[int]]:
    """Count the bytes of the matmul outputs selective checkpointing keeps in the ``with``
    block (``counter[0]``): they live in the checkpoint, where saved-tensor hooks do not see
    them."""
    counter = [0]
    _COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _COUNTERS.remove(counter)


class _KeepMatmuls(EagerDispatchMode):
    """The original forward of a selectively checkpointed block: the outputs of its matrix
    multiplies are kept (and counted)."""

    def __init__(self, kept: list[tuple[torch.Tensor, int]]) -> None:
        super().__init__()
        self.kept = kept

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _SAVED_OPS:
            self.kept.append((out, out._version))
            for counter in _COUNTERS:
                counter[0] += out.numel() * out.element_size()
        return out


class _ReuseMatmuls(EagerDispatchMode):
    """A recompute of a selectively checkpointed block: its matrix multiplies give the kept
    outputs, in order, instead of running; everything else runs again. Every recompute starts
    from the first (a split backward, zero-bubble's, recomputes a block twice)."""

    def __init__(self, kept: list[tuple[torch.Tensor, int]]) -> None:
        super().__init__()
        self.kept = kept
        self.next = 0

    def __enter__(self) -> _ReuseMatmuls:
        self.next = 0
        return super().__enter__()  # type: ignore[no-any-return]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func not in _SAVED_OPS:
            return func(*args, **(kwargs or {}))
        out, version = self.kept[self.next]
        self.next += 1
        if out._version != version:
            raise RuntimeError(
                "selective activation checkpointing: a kept matmul output was changed in place after the forward "
                "pass; use mode 'full' for this block"
            )
        return out


def kept_for_backward(forward: Callable[[], Any], params: Iterable[torch.Tensor] = ()) -> int:
    """Bytes the forward pass ``forward()`` keeps for the backward pass: the tensors saved for
    autograd (each storage once, ``params`` left out), plus the matmul outputs selective
    checkpoints keep inside their checkpoints (where saved-tensor hooks do not see them)."""
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        kept[storage.data_ptr()] = storage.nbytes()
        return t

    with kept_matmul_bytes() as matmuls, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    skip = {p.untyped_storage().data_ptr() for p in params}
    return sum(n for ptr, n in kept.items() if ptr not in skip) + matmuls[0]


def _selective_contexts() -> tuple[_KeepMatmuls, _ReuseMatmuls]:
    kept: list[tuple[torch.Tensor, int]] = []
    return _KeepMatmuls(kept), _ReuseMatmuls(kept)


class _SameStreams:
    """A block's forward, run twice (forward, then recompute) from the same state of tessera's
    random streams: the first run notes the state; the recompute starts from it and leaves the
    streams where the forward had left them."""

    def __init__(self, forward: Callable[..., Any], streams: RNGStreams | None) -> None:
        self.forward = forward
        self.streams = streams
        self.start: Any = None
        self.enclosing: tuple[str, ...] = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.streams is None:
            return self.forward(*args, **kwargs)
        if self.start is None:
            self.start, self.enclosing = self.streams.snapshot(), self.streams.enclosing
            return self.forward(*args, **kwargs)
        after = self.streams.snapshot()
        self.streams.restore(self.start)
        try:
            with self.streams.inside(self.enclosing):  # the forks the forward ran in
                return self.forward(*args, **kwargs)
        finally:
            self.streams.restore(after)


def _keep_matmuls_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _compiled_selective_contexts() -> tuple[Any, Any]:
    """Selective checkpointing in the form torch.compile traces: torch's own policy contexts,
    keeping the same matmul outputs as :class:`_KeepMatmuls` (inside compiled code the partitioner
    follows the policy; tessera's dispatch modes would stop dynamo from compiling the block)."""
    return create_selective_checkpoint_contexts(_keep_matmuls_policy)


def _install(module: nn.Module, mode: str, streams: RNGStreams | None, for_compile: bool = False) -> None:
    original = module.forward
    context_fn: Any = None
    if mode == "selective":
        context_fn = _compiled_selective_contexts if for_compile else _selective_contexts
    if for_compile:  # dynamo traces the checkpoint; torch replays its own random state in the recompute
        streams = None

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        options: dict[str, Any] = {"use_reentrant": False, "preserve_rng_state": True}
        if context_fn is not None:
            options["context_fn"] = context_fn
        fn = original if streams is None else _SameStreams(original, streams)
        return checkpoint(fn, *args, **options, **kwargs)

    module.forward = forward  # type: ignore[method-assign]
    module._tessera_recompute = mode  # type: ignore[assignment]


def checkpoint_blocks(
    model: nn.Module,
    predicate: Callable[[str, nn.Module], bool] | None = None,
    mode: str = "full",
    every: int = 1,
    ctx: ParallelContext | None = None,
    for_compile: bool = False,
) -> list[str]:
    """Recompute the activations of ``model``'s blocks (the submodules for which
    ``predicate(name, module)`` holds; by default those marked with :func:`mark_block`), one
    in every ``every`` of them (the first, then every ``every``-th), in ``mode`` "full" or
    "selective" ("none" does nothing). Returns the names of the blocks it set up.

    ``for_compile``: the blocks are compiled next, the checkpoint inside their compiled code
    (selective through torch's checkpoint policy; tessera's per-axis random streams are not
    replayed, torch's generators are)."""
    if mode not in MODES:
        raise ValueError(f"activation checkpoint mode {mode!r} is not one of {', '.join(MODES)}")
    if every < 1:
        raise ValueError(f"activation checkpoint every={every} must be at least 1")
    if mode == "none":
        return []
    predicate = predicate or is_block
    ctx = resolve_context(ctx)
    streams = ctx.rng if ctx is not None else None
    chosen = [(name, m) for name, m in model.named_modules() if name and predicate(name, m)]
    done = []
    for i, (name, module) in enumerate(chosen):
        if i % every:
            continue
        if getattr(module, "_tessera_recompute", None) is not None:
            raise ValueError(f"{name} is already checkpointed ({module._tessera_recompute})")
        _install(module, mode, streams, for_compile)
        done.append(name)
    return done


__all__ = ["MODES", "checkpoint_blocks", "is_block", "kept_for_backward", "kept_matmul_bytes", "mark_block"]
