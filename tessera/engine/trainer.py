"""``Trainer``: the loop around an engine, with hooks for everything around the step."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from tessera import checkpoint
from tessera.checkpoint import CheckpointError
from tessera.engine.engine import Engine
from tessera.engine.hooks import Hook


class Trainer:
    """Runs ``engine.train_batch`` over epochs or a number of steps and calls the hooks.

    ``trainer.metrics`` holds the current step's numbers; hooks read and add to it (the
    throughput hook adds ``samples_per_s``, the memory hook byte counts, ...), and the logging
    hooks, which run last, report it. ``trainer.history`` keeps every step's metrics.

    Checkpoints: with ``checkpoint_dir`` and ``checkpoint_every``, a sharded checkpoint of the
    whole run (``tessera.checkpoint.save``: model, optimizer, scheduler, scaler, random states,
    data position, the trainer's counters) goes to ``checkpoint_dir/step-NNNNNNNN`` every that
    many steps and at the end, keeping the newest ``keep_last``. ``resume`` continues a run:
    ``"auto"`` from the newest complete checkpoint in ``checkpoint_dir`` if there is one (else
    from the start: the setting for jobs restarted by ``tessera run --max-restarts``),
    ``"latest"`` likewise but one must exist, or a checkpoint folder's path.

    A loader without a length (an iterable dataset's, a stream) has epochs that end when its
    data does: ``fit(steps=...)`` runs that many steps over as many epochs as it takes, and
    ``fit(epochs=...)`` that many passes. Over an iterable dataset the trainer takes each step's
    micro-batches before the step: a last step the data cannot fill is left out, on every rank
    alike (the loaders ``initialize`` returns give every data rank as many batches).
    """

    def __init__(
        self,
        engine: Engine,
        hooks: Iterable[Hook] = (),
        *,
        checkpoint_dir: str | Path | None = None,
        checkpoint_every: int | None = None,
        keep_last: int | None = None,
        checkpoint_async: bool = False,
        resume: str | Path | None = None,
    ) -> None:
        if checkpoint_every is not None and checkpoint_every < 1:
            raise ValueError(f"checkpoint_every={checkpoint_every} must be at least 1")
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last={keep_last} must be at least 1")
        if checkpoint_every is not None and checkpoint_dir is None:
            raise ValueError("checkpoint_every needs checkpoint_dir= (where the checkpoints go)")
        if resume in ("auto", "latest") and checkpoint_dir is None:
            raise ValueError(f"resume={resume!r} looks in checkpoint_dir=, which is not given")
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every = checkpoint_every
        self.keep_last = keep_last
        self.checkpoint_async = checkpoint_async
        self.resume = resume
        self.resumed_from: Path | None = None
        self._step_in_epoch = 0
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

    def steps_per_epoch(self, loader: DataLoader) -> int | None:
        """Optimizer steps in one pass over ``loader``; None when it has no length (a stream)."""
        try:
            return len(loader) // self.engine.micro_batches_per_step
        except TypeError:
            return None

    def fit(
        self,
        train_dataloader: DataLoader,
        *,
        epochs: int | None = None,
        steps: int | None = None,
        test_dataloader: DataLoader | None = None,
    ) -> list[dict[str, Any]]:
        """Train for ``epochs`` passes or ``steps`` optimizer steps (whichever is given; with
        both, whichever ends first). Returns the per-step metrics. The engine is closed at the
        end, after the hooks' ``after_fit``, and when training raises (``Engine.close``: Gemini's
        offload files are removed)."""
        with self.engine:
            return self._fit(train_dataloader, epochs, steps, test_dataloader)

    def _fit(
        self, train_dataloader: DataLoader, epochs: int | None, steps: int | None, test_dataloader: DataLoader | None
    ) -> list[dict[str, Any]]:
        if epochs is None and steps is None:
            raise ValueError("fit() needs epochs= or steps=")
        per_epoch = self.steps_per_epoch(train_dataloader)
        if per_epoch is not None and per_epoch < 1:
            raise ValueError(
                f"the data loader gives {len(train_dataloader)} micro-batches per rank, fewer than one optimizer "
                f"step of {self.engine.micro_batches_per_step} micro-batches"
            )
        if per_epoch is not None and steps is None:
            assert epochs is not None
            steps = epochs * per_epoch
        if per_epoch is not None and epochs is None:
            assert steps is not None
            epochs = -(-steps // per_epoch)
        self.train_dataloader, self.test_dataloader, self.max_steps = train_dataloader, test_dataloader, steps
        # an iterable dataset's loader may end before its length says (workers' short batches left out)
        lookahead = per_epoch is None or isinstance(train_dataloader.dataset, IterableDataset)
        first_epoch, done_in_epoch = self._resume(train_dataloader)
        self.engine.train()
        self._call("before_fit")
        epoch = first_epoch
        while epochs is None or epoch < epochs:
            self.epoch = epoch
            resuming = epoch == first_epoch and done_in_epoch > 0
            if not resuming:
                _set_epoch(train_dataloader, epoch)  # a new shuffle per epoch, the same on every rank
            self._call("before_epoch")
            data_iter = iter(train_dataloader)  # a resumed loader starts where the checkpoint was
            self._step_in_epoch = done_in_epoch if resuming else 0
            taken = self._run_epoch(data_iter, per_epoch, steps, lookahead)
            self._call("after_epoch")
            if self._finished(steps):
                break
            if taken == 0 and not resuming:
                raise ValueError(
                    f"epoch {epoch} of the data loader gave no whole optimizer step of "
                    f"{self.engine.micro_batches_per_step} micro-batches"
                )
            epoch += 1
        if self.checkpoint_every and self.step % self.checkpoint_every != 0:
            self.save_checkpoint()  # the end of the run, too
        checkpoint.wait_for_saves()
        self._call("after_fit")
        return self.history

    def _finished(self, steps: int | None) -> bool:
        return (steps is not None and self.step >= steps) or self.stop_requested

    def _run_epoch(self, data_iter: Iterator[Any], per_epoch: int | None, steps: int | None, lookahead: bool) -> int:
        """The steps of one epoch (the rest of it, when resumed); returns how many ran."""
        taken = 0
        while per_epoch is None or self._step_in_epoch < per_epoch:
            if self._finished(steps):
                break
            step_iter = self._step_batches(data_iter) if lookahead else data_iter
            if step_iter is None:
                break  # the data ended
            self.metrics = {"step": self.step + 1, "epoch": self.epoch}
            self._call("before_step")
            self.metrics["loss"] = self.engine.train_batch(step_iter)
            self.metrics["skipped"] = self.engine.last_step_skipped
            self.step += 1
            self._step_in_epoch += 1
            taken += 1
            self._call("after_step")
            self.history.append(dict(self.metrics))
            if self.checkpoint_every and self.step % self.checkpoint_every == 0:
                self.save_checkpoint()
        return taken

    def _step_batches(self, data_iter: Iterator[Any]) -> Iterator[Any] | None:
        """The next step's micro-batches, or None when the data ends before a whole step."""
        wanted = self.engine.micro_batches_per_step
        batches = list(itertools.islice(data_iter, wanted))
        return iter(batches) if len(batches) == wanted else None

    # ---- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """Save the whole run at this step to ``checkpoint_dir/step-NNNNNNNN`` (collective)."""
        if self.checkpoint_dir is None:
            raise ValueError("save_checkpoint needs the Trainer's checkpoint_dir=")
        loader = self.train_dataloader
        if loader is not None and not callable(getattr(loader, "state_dict", None)):
            raise CheckpointError(
                f"the training data loader ({type(loader).__name__}) cannot say where it is in its epoch (it has no "
                "state_dict), so a resumed run would not continue its data where this one stopped: train on the "
                "loader tessera.initialize returns, or give yours state_dict() and load_state_dict()"
            )
        path = checkpoint.step_folder(self.checkpoint_dir, self.step)
        extra = {"trainer": {"step": self.step, "epoch": self.epoch, "step_in_epoch": self._step_in_epoch}}
        handle = checkpoint.save(
            path, self.engine, dataloader=self.train_dataloader, extra=extra, blocking=not self.checkpoint_async
        )
        if self.keep_last is not None and self.engine.ctx.rank == 0:
            if self.checkpoint_async:
                handle.wait()  # rank 0's wait ends when the checkpoint is complete
            checkpoint.prune(self.checkpoint_dir, self.keep_last)
        return path

    def _resume_path(self) -> Path | None:
        if self.resume is None:
            return None
        if self.resume in ("auto", "latest"):
            assert self.checkpoint_dir is not None
            found = checkpoint.latest(self.checkpoint_dir)
            if found is None and self.resume == "latest":
                raise CheckpointError(f"resume='latest': no complete checkpoint in {self.checkpoint_dir}")
            return found
        return Path(self.resume)

    def _resume(self, loader: DataLoader) -> tuple[int, int]:
        """Load the checkpoint ``resume`` names, if any; returns ``(epoch, steps done in it)``."""
        path = self._resume_path()
        if path is None:
            return 0, 0
        self.step = checkpoint.load(path, self.engine, dataloader=loader)
        self.resumed_from = path
        state = (checkpoint.read_index(path).get("extra") or {}).get("trainer") or {}
        self.epoch = int(state.get("epoch", 0))
        if self.engine.ctx.rank == 0:
            print(f"tessera: resumed from {path} at step {self.step}", file=sys.stderr, flush=True)
        return self.epoch, int(state.get("step_in_epoch", 0))


def _set_epoch(loader: DataLoader, epoch: int) -> None:
    """Start ``epoch`` of ``loader``: its ``set_epoch``, else its sampler's, if either has one."""
    set_epoch = getattr(loader, "set_epoch", None)
    if not callable(set_epoch):
        set_epoch = getattr(getattr(loader, "sampler", None), "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)
