"""``Engine``: one model, optimizer and criterion under a configured layout.

The engine owns the parts of a training step that the layout changes: gradient accumulation
(without gradient sync on the non-final micro-steps), mixed precision and loss scaling, global
gradient clipping, and the loss reported back (averaged over the data axis).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from tessera import comm
from tessera.amp import LossScaler, autocast
from tessera.context import ParallelContext
from tessera.engine.options import LossScaleOptions, TrainingOptions
from tessera.errors import TesseraError
from tessera.optim.clip import clip_coefficient
from tessera.parallel.strategy import Strategy


class _MissingCriterion:
    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise TesseraError(
            "engine.criterion was called, but tessera.initialize() got no criterion: "
            "pass criterion=... (for example torch.nn.CrossEntropyLoss()) to initialize"
        )


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, list | tuple):
        return type(batch)(_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


def _split_batch(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, list | tuple) and len(batch) == 2:
        return batch[0], batch[1]
    raise TesseraError(
        f"train_batch/eval_batch need batches of (inputs, targets); got {type(batch).__name__}"
        + (f" of length {len(batch)}" if isinstance(batch, list | tuple) else "")
    )


class Engine:
    """Runs forward, backward and optimizer steps for one model through its layout's strategy."""

    def __init__(
        self,
        strategy: Strategy,
        criterion: Callable[..., torch.Tensor] | None,
        *,
        ctx: ParallelContext,
        options: TrainingOptions,
    ) -> None:
        self.strategy = strategy
        self._criterion = criterion
        self.ctx = ctx
        self.options = options
        self.accumulation = options.gradient_accumulation
        self.clip_grad_norm = options.clip_grad_norm
        self.precision = options.precision
        self.scaler: LossScaler | None = None
        if self.precision == "fp16":
            ls = options.loss_scale or LossScaleOptions()
            self.scaler = LossScaler(
                ls.initial_scale,
                dynamic=ls.dynamic,
                growth_interval=ls.growth_interval,
                growth_factor=ls.growth_factor,
                backoff_factor=ls.backoff_factor,
                min_scale=ls.min_scale,
            )
        self.micro_step = 0  # micro-steps since the last optimizer step
        self.global_step = 0  # optimizer steps taken or skipped
        self.last_grad_norm: float | None = None
        self.last_step_skipped = False
        #: the learning-rate scheduler given to ``initialize`` (checkpoints save and load it)
        self.lr_scheduler: Any = None
        self.init_peak_rss: int | None = None  # peak RSS of the init phase (set by initialize)
        #: the run's config, when ``tessera.initialize`` built the engine (checkpoints record it)
        self.run_config: Any = None

    @property
    def model(self) -> nn.Module:
        """What a forward pass calls (the user's model, or the strategy's wrapper of it)."""
        return self.strategy.model

    @property
    def module(self) -> nn.Module:
        """The user's model."""
        return self.strategy.module

    @property
    def optimizer(self) -> Any:
        """The optimizer that steps (the user's, or a sharded one that behaves like it)."""
        return self.strategy.optimizer

    # ---- the user-facing loop ---------------------------------------------------------------
    @property
    def criterion(self) -> Callable[..., torch.Tensor]:
        """The loss function given to initialize (calling it without one raises a clear error)."""
        return self._criterion if self._criterion is not None else _MissingCriterion()

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches one optimizer step consumes: the schedule's, else the accumulation steps."""
        scheduled = self.strategy.scheduled_microbatches
        return scheduled if scheduled is not None else self.accumulation

    @property
    def is_final_micro_step(self) -> bool:
        return self.micro_step == self.accumulation - 1

    def zero_grad(self) -> None:
        """Clear gradients at the start of an accumulation cycle (a no-op inside one)."""
        if self.micro_step == 0:
            self.strategy.zero_grad()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Forward pass under autocast; gradients sync only on the final micro-step."""
        final = self.is_final_micro_step or not torch.is_grad_enabled()
        with autocast(self.precision, self.ctx.device):
            return self.strategy.forward(*args, final=final, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` (divided by the accumulation steps, scaled for fp16)."""
        if self.scaler is None and not bool(torch.isfinite(loss.detach())):
            raise FloatingPointError(
                f"non-finite loss {loss.item()} at step {self.global_step} (micro-step {self.micro_step}) "
                f"in {self.precision}: lower the learning rate, clip gradients, or check the data"
            )
        scaled = loss.float() / self.accumulation
        if self.scaler is not None:
            scaled = scaled * self.scaler.scale
        scaled.backward()

    def step(self) -> bool:
        """Finish a micro-step; on the last of a cycle, step the optimizer. Returns whether the
        optimizer stepped (False inside a cycle or when fp16 gradients overflowed)."""
        if not self.is_final_micro_step:
            self.micro_step += 1
            return False
        self.micro_step = 0
        return self._apply_gradients()

    def _apply_gradients(self) -> bool:
        """Unscale and check overflow (fp16), clip, and step the optimizer; counts the step."""
        self.global_step += 1
        self.strategy.reduce_gradients()  # gradients now as single-process training has them
        if self.scaler is not None:
            self.strategy.scale_gradients(1.0 / self.scaler.scale)
            overflow = self._overflow_anywhere()
            self.scaler.update(overflow)
            if overflow:
                self.last_step_skipped = True
                self.strategy.zero_grad()
                return False
        if self.clip_grad_norm is not None:
            norm = self.strategy.grad_norm()
            self.strategy.scale_gradients(clip_coefficient(norm, self.clip_grad_norm))
            self.last_grad_norm = float(norm)
        self.strategy.step()
        self.last_step_skipped = False
        return True

    def _overflow_anywhere(self) -> bool:
        """Whether any rank of the world holds a non-finite gradient."""
        norm = self.strategy.grad_norm()
        flag = torch.tensor([0.0 if math.isfinite(float(norm)) else 1.0], device=self.ctx.device)
        comm.all_reduce(flag, self.ctx.group("world"), op="max")
        return bool(flag.item() > 0)

    # ---- whole steps --------------------------------------------------------------------------
    def mean_over_data(self, value: torch.Tensor | float) -> float:
        """``value`` averaged over the data-parallel ranks (a collective over the data axis)."""
        value = torch.as_tensor(value, dtype=torch.float32, device=self.ctx.device).detach().reshape(1).clone()
        comm.all_reduce(value, self.ctx.group("data"), op="avg")
        return float(value.item())

    def train_batch(self, data_iter: Iterator[Any]) -> float:
        """One optimizer step over ``gradient_accumulation`` micro-batches of ``(inputs, targets)``.

        Returns the loss averaged over the micro-batches and the data-parallel ranks: the loss of
        the global batch, as one process would compute it. Its reduction starts as soon as the
        last forward is done and overlaps the backward pass and the optimizer step.
        """
        if self.strategy.scheduled_microbatches is not None:
            return self._train_scheduled_batch(data_iter, self.strategy.scheduled_microbatches)
        self.zero_grad()
        total = torch.zeros((), device=self.ctx.device)
        pending = None
        for micro in range(self.accumulation):
            inputs, targets = _split_batch(_to_device(next(data_iter), self.ctx.device))
            loss = self.criterion(self(inputs), targets)
            total = total + loss.detach().float()
            if micro == self.accumulation - 1:
                mean = (total / self.accumulation).reshape(1).clone()
                pending = comm.all_reduce_async(mean, self.ctx.group("data"))
            self.backward(loss)
            self.step()
        assert pending is not None
        return float(pending.wait()) / self.ctx.size("data")

    def _train_scheduled_batch(self, data_iter: Iterator[Any], microbatches: int) -> float:
        """One optimizer step through the strategy's schedule over ``microbatches`` items of
        ``data_iter``; the gradients then meet over the data axis through the strategy."""
        self.strategy.zero_grad()
        batches = [_split_batch(_to_device(next(data_iter), self.ctx.device)) for _ in range(microbatches)]
        with autocast(self.precision, self.ctx.device):
            loss = self.strategy.run_schedule(batches, self.criterion)
        if not math.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss} at step {self.global_step} in {self.precision}")
        self._apply_gradients()
        return self.mean_over_data(loss)

    @torch.no_grad()
    def eval_batch(self, data_iter: Iterator[Any]) -> tuple[float, Any]:
        """Loss (averaged over the data-parallel ranks) and outputs of one batch."""
        inputs, targets = _split_batch(_to_device(next(data_iter), self.ctx.device))
        outputs = self(inputs)
        loss = self.criterion(outputs, targets)
        return self.mean_over_data(loss), outputs

    def state_dict(self) -> dict[str, Any]:
        """Engine counters and loss-scaler state (model and optimizer state are saved apart:
        ``full_state_dict(engine.module)`` and ``engine.strategy.state_dict()``)."""
        return {
            "global_step": self.global_step,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (a checkpoint's engine counters and scaler)."""
        self.global_step = int(state["global_step"])
        self.micro_step = 0
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
