"""What a checkpoint needs of the run it saves and loads, as typed protocols.

``tessera.engine.Engine`` is the run these describe, but checkpoints sit below the engine in the
layers (the engine's hooks and trainer save checkpoints), so they name what they read and write
here instead of importing it: :class:`HoldsStrategy` for full state dicts, which need only the
strategy, and :class:`TrainingState` for sharded checkpoints, which save and restore the whole
run. Anything with these members can be saved (a test's stand-in, say).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import nn

from tessera.context import ParallelContext
from tessera.parallel.strategy import Strategy


@runtime_checkable
class HoldsStrategy(Protocol):
    """A trained model under its layout: ``strategy`` holds the user's module, the optimizer and
    what this rank holds of each (``Strategy.checkpoint_tensors``, ``full_precision_weights``)."""

    @property
    def strategy(self) -> Strategy: ...


class TrainingState(HoldsStrategy, Protocol):
    """What a sharded checkpoint saves and restores of a run (``Engine`` is one): the strategy's
    tensors and optimizer, the layout it runs under, the step counters and loss scaler, the
    learning-rate scheduler, and, recorded for reading only, the options and the config."""

    @property
    def ctx(self) -> ParallelContext:
        """The layout and groups the run trains under (random states are per rank of it)."""
        ...

    @property
    def module(self) -> nn.Module:
        """The user's model (its state-dict keys and tied parameters name the pieces)."""
        ...

    @property
    def global_step(self) -> int:
        """Optimizer steps taken: the step a checkpoint is saved at."""
        ...

    @property
    def lr_scheduler(self) -> Any:
        """The learning-rate scheduler (``state_dict``/``load_state_dict``), or None."""
        ...

    @property
    def options(self) -> object:
        """The training options, recorded in the index as JSON."""
        ...

    @property
    def run_config(self) -> object:
        """The run's config when there is one (recorded in the index), else None."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The run's own counters and loss-scaler state (JSON-able)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        ...
