"""``Trainer``: the loop around an engine, with hooks for everything around the step."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch.utils.data import DataLoader

from tessera.engine.engine import Engine
from tessera.engine.hooks import Hook


class Trainer:
    """Runs ``engine.train_batch`` over epochs or a number of steps and calls the hooks.

    ``trainer.metrics`` holds the current step's numbers; hooks read and add to it (the
    throughput hook adds ``samples_per_s``, the memory hook byte counts, ...), and the logging
    hooks, which run last, report it. ``trainer.history`` keeps every step's metrics.
    """

    def __init__(self, engine: Engine, hooks: Iterable[Hook] = ()) -> None:
        self.engine = engine
        self.hooks = sorted(hooks, key=lambda h: h.priority)
        self.step = 0
        self.epoch = 0
        self.metrics: dict[str, Any] = {}
        self.history: list[dict[str, Any]] = []
        self.train_dataloader: DataLoader | None = None
        self.test_dataloader: DataLoader | None = None
        self.max_steps: int | None = None
        self.stop_requested = False

    def _call(self, event: str, *args: Any) -> None:
        for hook in self.hooks:
            getattr(hook, event)(self, *args)

    def steps_per_epoch(self, loader: DataLoader) -> int:
        return len(loader) // self.engine.micro_batches_per_step

    def fit(
        self,
        train_dataloader: DataLoader,
        *,
        epochs: int | None = None,
        steps: int | None = None,
        test_dataloader: DataLoader | None = None,
    ) -> list[dict[str, Any]]:
        """Train for ``epochs`` passes or ``steps`` optimizer steps (whichever is given; with
        both, whichever ends first). Returns the per-step metrics."""
        if epochs is None and steps is None:
            raise ValueError("fit() needs epochs= or steps=")
        per_epoch = self.steps_per_epoch(train_dataloader)
        if per_epoch < 1:
            raise ValueError(
                f"the data loader gives {len(train_dataloader)} micro-batches per rank, fewer than one optimizer "
                f"step of {self.engine.micro_batches_per_step} micro-batches"
            )
        if steps is None:
            assert epochs is not None
            steps = epochs * per_epoch
        if epochs is None:
            epochs = -(-steps // per_epoch)
        self.train_dataloader, self.test_dataloader, self.max_steps = train_dataloader, test_dataloader, steps
        self.engine.train()
        self._call("before_fit")
        for epoch in range(epochs):
            self.epoch = epoch
            set_epoch = getattr(getattr(train_dataloader, "sampler", None), "set_epoch", None)
            if set_epoch is not None:
                set_epoch(epoch)  # a new shuffle per epoch, the same on every rank
            self._call("before_epoch")
            data_iter = iter(train_dataloader)
            for _ in range(per_epoch):
                if self.step >= steps or self.stop_requested:
                    break
                self.metrics = {"step": self.step + 1, "epoch": epoch}
                self._call("before_step")
                self.metrics["loss"] = self.engine.train_batch(data_iter)
                self.metrics["skipped"] = self.engine.last_step_skipped
                self.step += 1
                self._call("after_step")
                self.history.append(dict(self.metrics))
            self._call("after_epoch")
            if self.step >= steps or self.stop_requested:
                break
        self._call("after_fit")
        return self.history
