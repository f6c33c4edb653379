"""What the alignment trainers need of the models they run, as typed protocols.

A job's models are engines (``tessera.initialize``'s, any layout), :class:`~tessera.rlhf.experience.Frozen`
models, or reward rules. The trainers name what they use of each here rather than test for
attributes: :class:`HeldModel` (what every model a rank holds offers: its context, the user's
module, a forward call), :class:`TrainedModel` (an engine's step loop on top of that) and
:class:`ReleasingStorage` (what a rollout asks of the storage behind a parameter's placement).
``tessera.engine.Engine`` is a :class:`TrainedModel`; a ``Frozen`` model is a :class:`HeldModel`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from tessera.context import ParallelContext


@runtime_checkable
class HeldModel(Protocol):
    """A model this rank holds under a layout: called on a batch, it runs its forward there."""

    @property
    def ctx(self) -> ParallelContext:
        """The ranks the model lives on: its data ranks split the rows between them."""
        ...

    @property
    def module(self) -> nn.Module:
        """The user's model (what log-probs, generation and value heads read)."""
        ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


@runtime_checkable
class TrainedModel(HeldModel, Protocol):
    """A model the job steps (an engine): its forward, the accumulation's micro-batches, one
    optimizer step, and the mean of a number over its data ranks."""

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches one optimizer step takes."""
        ...

    def train(self) -> object: ...

    def eval(self) -> object: ...

    def zero_grad(self) -> None: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self) -> object:
        """Finish a micro-step (the optimizer steps on the last of the accumulation)."""
        ...

    def mean_over_data(self, value: torch.Tensor | float) -> float:
        """``value`` averaged over the replicas (a collective)."""
        ...


@runtime_checkable
class ReleasingStorage(Protocol):
    """The storage behind a parameter's placement (``placement_of(p).storage``) that says whether
    it releases the parameter between uses (ZeRO-3's and Gemini's chunks do; ZeRO-1 and 2 keep
    every parameter whole). A storage that does not say is taken to release it."""

    @property
    def releases_parameters(self) -> bool: ...
