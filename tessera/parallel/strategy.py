"""The gradient/optimizer strategy: the one interface through which a layout trains.

``initialize`` picks one strategy from the layout (plain data parallelism over DDP, ZeRO with a
stage's policy, a pipeline with or without ZeRO-1; Gemini will be another). The engine,
clipping and checkpoints call only these methods and never ask which strategy they hold, so a
new strategy is a new subclass, not new branches. ``docs/architecture.md`` walks through writing
one. A strategy around another (pipeline stages around the gradients' strategy) is a
:class:`WrappingStrategy`: what it does not define itself is forwarded, every method of the
interface included.

A training step, as the engine drives it::

    strategy.zero_grad()
    for each micro-batch:                   # or strategy.run_schedule(batches, criterion)
        loss = criterion(strategy.forward(x, final=...), y); loss.backward()
    strategy.reduce_gradients()             # gradients now as single-process training has them
    strategy.scale_gradients(1 / scale)     # fp16: unscaled
    strategy.grad_norm()                    # the whole model's gradient norm
    strategy.scale_gradients(coefficient)   # clipped
    strategy.step()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from tessera.context import ParallelContext
from tessera.context.placement import placement_of
from tessera.context.views import HeldTensor, View, spec_view, whole_view
from tessera.errors import TesseraError
from tessera.optim.norms import global_grad_norm


class Strategy:
    """How one layout runs forward, brings gradients together, steps and saves.

    Attributes every strategy sets: ``module`` (the user's model, whose state-dict keys are the
    single-process ones), ``model`` (what a forward pass calls: ``module`` or a wrapper of it),
    ``optimizer`` (what schedulers and users see: the user's optimizer or a sharded one behaving
    like it) and ``ctx``.
    """

    module: nn.Module
    model: nn.Module
    optimizer: Any
    ctx: ParallelContext
    #: a short description for logs (``"ddp"``, ``"zero2"``, ``"pipeline(1f1b)+zero1"``)
    name: str = "strategy"

    #: micro-batches a step runs through a schedule (pipelines); None when the engine feeds
    #: micro-batches one by one (gradient accumulation).
    scheduled_microbatches: int | None = None

    # ---- forward and backward ----------------------------------------------------------------
    def forward(self, *args: Any, final: bool = True, **kwargs: Any) -> Any:
        """One forward pass; ``final``: whether its backward ends the step's accumulation (so
        gradients may be reduced during it)."""
        return self.model(*args, **kwargs)

    def run_schedule(self, batches: Sequence[tuple[Any, Any]], criterion: Callable[..., torch.Tensor]) -> float:
        """Forward and backward of a whole step over ``batches`` through a schedule; returns the
        step's mean loss. Only strategies with ``scheduled_microbatches`` run schedules."""
        raise TesseraError(f"{type(self).__name__} does not run whole-step schedules")

    # ---- gradients and the step --------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """After the step's last backward: make the gradients of :meth:`gradient_tensors` what
        single-process training would hold (each reduced as ``tessera.context.reduction``
        says). Default: nothing left to do (reduced during the backward pass)."""

    def gradient_tensors(self) -> list[torch.Tensor]:
        """The tensors whose ``.grad`` the step reads: the engine unscales and clips these."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def grad_norm(self) -> torch.Tensor:
        """The 2-norm of the whole model's gradient, each parameter counted once (collective)."""
        return global_grad_norm(self.gradient_tensors(), self.ctx)

    def scale_gradients(self, factor: torch.Tensor | float) -> None:
        """Multiply every gradient the step will read by ``factor`` (fp16 unscaling, clipping)."""
        grads = [p.grad for p in self.gradient_tensors() if p.grad is not None]
        if grads:
            if isinstance(factor, torch.Tensor):
                factor = factor.to(grads[0].device)
            torch._foreach_mul_(grads, factor)

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    # ---- weights -------------------------------------------------------------------------------
    def full_precision_weights(self) -> list[tuple[nn.Parameter, torch.Tensor]] | None:
        """The weights the optimizer steps where they are kept apart from the module's parameters
        (fp32 masters of bf16/fp16 parameters): ``(parameter, value)`` pairs, each value of the
        parameter's shape on this rank (its tensor-parallel block) and whole over the data axis.
        None when the parameters are those weights. Collective over the data axis: every rank
        calls it. ``tessera.checkpoint.full_state_dict(engine)`` saves these values."""
        return None

    # ---- checkpoints ---------------------------------------------------------------------------
    def checkpoint_tensors(self) -> list[HeldTensor]:
        """What this rank holds of the model for a sharded checkpoint: every parameter it trains
        (a tensor-parallel block, a ZeRO piece, or whole) and every persistent buffer, each with
        its single-process key and its view in full coordinates. A parameter's ``tensor`` is the
        one the optimizer steps (its state is saved under the same view). Ranks holding the same
        view (data-parallel replicas) hold the same values; the checkpoint writes it once."""
        return module_tensors(self.module, self.holds)

    def checkpoint_session(self) -> AbstractContextManager[None]:
        """The block inside which :meth:`checkpoint_tensors` (and the optimizer's per-parameter
        state) may be read and written: a checkpoint's save or load, a deferred model's
        materialisation. Default: nothing to prepare (the tensors are always in memory); a
        strategy whose state may be on disk brings it in here and puts it back after."""
        return nullcontext()

    def checkpoint_groups(self) -> list[AbstractContextManager[list[HeldTensor]]]:
        """:meth:`checkpoint_tensors` in groups, each readable and writable inside its block, for
        filling a deferred model one group at a time (a strategy whose state may be on disk keeps
        one group in memory at a time). Default: one group, all of them."""
        return [nullcontext(self.checkpoint_tensors())]

    def report(self) -> dict[str, Any]:
        """What the strategy can tell of its memory (ZeRO and Gemini: chunks, utilisation, bytes
        per tier at their peak); empty by default. ``tessera train`` writes it to the run
        folder. Not collective."""
        return {}

    def close(self) -> None:
        """Release what the strategy holds outside the process (Gemini: its offload files);
        nothing by default. ``Engine.close()`` calls it once, at the end of the run or on its
        error; the strategy does not train after. Not collective: a rank that failed alone
        closes too."""

    def holds(self, param: torch.Tensor) -> bool:
        """Whether this rank trains (and so saves and loads) ``param``. Default: every one."""
        return True

    def checkpoint_loaded(self) -> None:
        """After a checkpoint wrote new values into :meth:`checkpoint_tensors`: make every copy
        that derives from them follow (sharded copies, other stages' weights). Collective."""


class WrappingStrategy(Strategy):
    """A strategy around another, ``inner`` (over the same module): every method of the
    interface that a subclass does not define itself is the inner strategy's. The forwarding is
    made from the interface, not written out, so a method added to :class:`Strategy` reaches the
    inner strategy with no change here."""

    inner: Strategy


def interface_methods() -> list[str]:
    """The names of the methods of the :class:`Strategy` interface."""
    return [name for name, value in vars(Strategy).items() if callable(value) and not name.startswith("_")]


def _forwarded(name: str) -> Callable[..., Any]:
    """``name`` of the interface, called on the wrapping strategy's ``inner``."""

    def method(self: WrappingStrategy, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.inner, name)(*args, **kwargs)

    method.__name__, method.__qualname__ = name, f"WrappingStrategy.{name}"
    method.__doc__ = getattr(Strategy, name).__doc__
    return method


for _name in interface_methods():
    setattr(WrappingStrategy, _name, _forwarded(_name))
del _name


def module_tensors(module: nn.Module, holds: Callable[[torch.Tensor], bool]) -> list[HeldTensor]:
    """The :class:`HeldTensor` records of ``module``'s parameters that ``holds`` and of its
    persistent buffers, under their first state-dict key (a tied parameter once)."""
    keys = state_dict_keys(module)
    out: list[HeldTensor] = []
    for key, param in module.named_parameters():
        if key in keys and holds(param):
            out.append(HeldTensor(key, param, view_of(param)))
    for key, buffer in module.named_buffers():
        if key in keys:
            out.append(HeldTensor(key, buffer, whole_view(buffer.shape)))
    return out


def state_dict_keys(module: nn.Module) -> set[str]:
    """The keys ``module.state_dict()`` has (tied parameters under each of theirs), taken with
    ``keep_vars=True``: the live tensors, so nothing is gathered or copied (under ZeRO-3 a plain
    ``state_dict()`` gathers every parameter)."""
    return set(module.state_dict(keep_vars=True).keys())


def view_of(param: torch.Tensor) -> View:
    """The view of this rank's (tensor-parallel block of a) parameter."""
    placement = placement_of(param)
    if placement.shard is None:
        return whole_view(param.shape)
    if placement.mesh is None:
        raise TesseraError("a sharded parameter's placement names no context to place its block with")
    return spec_view(placement.shard, placement.mesh)
