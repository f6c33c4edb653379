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
from tessera.checkpoint import full_state_dict, load_full_state_dict
from tessera.config import Config
from tessera.context import ParallelContext
from tessera.errors import TesseraError
from tessera.optim import clip_grad_norm_, global_grad_norm
from tessera.zero import ZeroOptimizer


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
    """Runs forward, backward and optimizer steps for one model under the current layout."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | ZeroOptimizer,
        criterion: Callable[..., torch.Tensor] | None,
        *,
        ctx: ParallelContext,
        config: Config,
        module: nn.Module | None = None,
        pipeline: Any = None,
    ) -> None:
        self.model = model
        self.module = module if module is not None else model
        self.optimizer = optimizer
        self._criterion = criterion
        self.ctx = ctx
        self.config = config
        self.accumulation = config.gradient_accumulation
        self.clip_grad_norm = config.clip_grad_norm
        self.precision = config.mixed_precision.dtype
        mp = config.mixed_precision
        self.scaler: LossScaler | None = None
        if self.precision == "fp16":
            dynamic = mp.loss_scale == "dynamic"
            self.scaler = LossScaler(
                mp.initial_scale if dynamic else float(mp.loss_scale),
                dynamic=dynamic,
                growth_interval=mp.growth_interval,
                growth_factor=mp.growth_factor,
                backoff_factor=mp.backoff_factor,
                min_scale=mp.min_scale,
            )
        self.pipeline = pipeline  # a PipelineStage when the layout has pipeline stages
        self._synced_at = -1  # the step at which every rank last received every stage's weights
        self.micro_step = 0  # micro-steps since the last optimizer step
        self.global_step = 0  # optimizer steps taken or skipped
        self.last_grad_norm: float | None = None
        self.last_step_skipped = False

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
        """Micro-batches one optimizer step consumes: the pipeline's, else the accumulation steps."""
        return self.pipeline.microbatches if self.pipeline is not None else self.accumulation

    @property
    def is_final_micro_step(self) -> bool:
        return self.micro_step == self.accumulation - 1

    def zero_grad(self) -> None:
        """Clear gradients at the start of an accumulation cycle (a no-op inside one)."""
        if self.micro_step == 0:
            self.optimizer.zero_grad(set_to_none=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Forward pass under autocast; gradients sync only on the final micro-step."""
        if self.pipeline is not None:
            if torch.is_grad_enabled():
                raise TesseraError(
                    "with pipeline stages the engine trains whole steps: call engine.train_batch(data_iter) "
                    "(each item one micro-batch of (inputs, targets)); engine(x) is for evaluation under no_grad"
                )
            self._sync_pipeline_weights()
            with autocast(self.precision, self.ctx.device):
                return self.module(*args, **kwargs)
        if hasattr(self.model, "require_backward_grad_sync"):
            self.model.require_backward_grad_sync = self.is_final_micro_step or not torch.is_grad_enabled()  # type: ignore[assignment]
        with autocast(self.precision, self.ctx.device):
            return self.model(*args, **kwargs)

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
        if isinstance(self.optimizer, ZeroOptimizer):
            self.optimizer.reduce_gradients()  # each rank now holds the average of its shard
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if self.scaler is not None:
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, 1.0 / self.scaler.scale)
            overflow = self._overflow_anywhere(params)
            self.scaler.update(overflow)
            if overflow:
                self.last_step_skipped = True
                self.optimizer.zero_grad(set_to_none=True)
                return False
        if self.clip_grad_norm is not None:
            norm = self._grad_norm(params)
            self.last_grad_norm = float(clip_grad_norm_(params, self.clip_grad_norm, self.ctx, norm=norm))
        self.optimizer.step()
        self.last_step_skipped = False
        return True

    def _grad_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        """The whole model's gradient norm (ZeRO's pieces need their own bookkeeping)."""
        if isinstance(self.optimizer, ZeroOptimizer):
            return self.optimizer.grad_norm()
        return global_grad_norm(params, self.ctx)

    def _overflow_anywhere(self, params: list[nn.Parameter]) -> bool:
        """Whether any rank of the world holds a non-finite gradient."""
        norm = self._grad_norm(params)
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
        if self.pipeline is not None:
            return self._train_pipeline_batch(data_iter)
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

    def _train_pipeline_batch(self, data_iter: Iterator[Any]) -> float:
        """One optimizer step through the pipeline schedule over ``microbatches`` items of
        ``data_iter``; gradients are then averaged over the data axis in one all-reduce."""
        self.optimizer.zero_grad(set_to_none=True)
        batches = [
            _split_batch(_to_device(next(data_iter), self.ctx.device)) for _ in range(self.pipeline.microbatches)
        ]
        with autocast(self.precision, self.ctx.device):
            loss = self.pipeline.step(batches)
        if not math.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss} at step {self.global_step} in {self.precision}")
        if not isinstance(self.optimizer, ZeroOptimizer):  # ZeRO reduce-scatters in _apply_gradients
            self._average_over_data([p for p in self.module.parameters() if p.grad is not None])
        self._apply_gradients()
        return self.mean_over_data(loss)

    def _sync_pipeline_weights(self) -> None:
        """Give every rank the current weights of every stage (collective), once per step, so a
        forward pass for evaluation can run the whole model on each rank."""
        if self._synced_at == self.global_step:
            return
        load_full_state_dict(self.module, full_state_dict(self.module))
        self._synced_at = self.global_step

    def _average_over_data(self, params: list[nn.Parameter]) -> None:
        group = self.ctx.group("data")
        if group.size == 1 or not params:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
        comm.all_reduce(flat, group, op="avg")
        offset = 0
        for p in params:
            assert p.grad is not None
            p.grad.copy_(flat[offset : offset + p.grad.numel()].view_as(p.grad))
            offset += p.grad.numel()

    @torch.no_grad()
    def eval_batch(self, data_iter: Iterator[Any]) -> tuple[float, Any]:
        """Loss (averaged over the data-parallel ranks) and outputs of one batch."""
        inputs, targets = _split_batch(_to_device(next(data_iter), self.ctx.device))
        outputs = self(inputs)
        loss = self.criterion(outputs, targets)
        return self.mean_over_data(loss), outputs

    def state_dict(self) -> dict[str, Any]:
        """Engine counters and loss-scaler state (model and optimizer state are saved apart)."""
        return {
            "global_step": self.global_step,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }
