"""``Engine``: one model, optimizer and criterion under a configured layout.

The engine owns the parts of a training step that the layout changes: gradient accumulation
(without gradient sync on the non-final micro-steps), mixed precision and loss scaling, global
gradient clipping, the loss reported back (averaged over the replicas: the data axis, and the
sequence axis when sequences are split), and, under sequence parallelism, handing the model and
the loss this rank's tokens of every sequence.

Batches are ``(inputs, targets)`` pairs, or dicts of tensors (:mod:`tessera.engine.batches`:
the model is called with ``**batch`` and each micro-batch's loss is weighed by the items it
averages over, so that ignored labels fall between micro-batches and ranks as they may). Through
pipeline stages a dict is the first stage's input and, with its count, the last stage's target.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

import torch
from torch import nn

from tessera import comm
from tessera.amp import LossScaler, autocast
from tessera.compiling import CompileReport
from tessera.context import ParallelContext
from tessera.engine.batches import loss_items, loss_shifts_labels, output_loss
from tessera.engine.lifecycle import close_after, track, untrack
from tessera.engine.options import LossScaleOptions, TrainingOptions
from tessera.errors import TesseraError
from tessera.nn.moe import moe_layers, set_aux_grad_scale
from tessera.optim.clip import clip_coefficient
from tessera.parallel.batches import rows_of
from tessera.parallel.sequence.tokens import sequence_length_of, take_tokens
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
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


def _take_step(data_iter: Iterator[Any], micro_batches: int) -> list[Any]:
    """The next ``micro_batches`` items of ``data_iter``; StopIteration when it ends before."""
    batches = list(itertools.islice(data_iter, micro_batches))
    if len(batches) < micro_batches:
        raise StopIteration(f"the data ended {len(batches)} micro-batch(es) into a step of {micro_batches}")
    kinds = {isinstance(b, Mapping) for b in batches}
    if len(kinds) > 1:
        raise TesseraError("a step's micro-batches must all be dicts or all (inputs, targets) pairs")
    return batches


def _rows(batches: list[Any]) -> int:
    return sum(rows_of(b) or 0 for b in batches)


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
        self.last_step_rows = 0  # rows (samples) of this rank's micro-batches in the last step
        self.last_step_skipped = False
        #: the learning-rate scheduler given to ``initialize`` (checkpoints save and load it)
        self.lr_scheduler: Any = None
        self.init_peak_rss: int | None = None  # peak RSS of the init phase (set by initialize)
        self.compile_report: CompileReport | None = None  # what compiling did (set by initialize)
        #: the run's config, when ``tessera.initialize`` built the engine (checkpoints record it)
        self.run_config: Any = None
        #: the model's MoE layers: their auxiliary losses enter each backward scaled as the loss is
        self._moe = [layer for _, layer in moe_layers(strategy.module)]
        self._sequence = ctx.group("sequence") if ctx.size("sequence") > 1 else None
        self._length: int | None = None  # the whole sequence length of the last batch split
        #: a model that splits its batches itself (``sequence_tokens(batch, group, mode)``: a video
        #: model cuts the frames, dim 2) instead of dim 1 of each tensor of the sequence's length
        self._own_split: Callable[[Any, Any, str], Any] | None = getattr(strategy.module, "sequence_tokens", None)
        #: ``fn(batch) -> int64 tensor``: the items the loss of a dict batch averages over (what
        #: its micro-batch weighs): by default :func:`~tessera.engine.batches.loss_items`, counting
        #: labels after the causal shift when the model's own loss shifts them. Assign another
        #: rule for a criterion that averages over something else.
        self.loss_items: Callable[[Mapping[str, Any]], torch.Tensor] = partial(
            loss_items, shift=loss_shifts_labels(strategy.module)
        )
        self.closed = False
        track(self)

    # ---- its end -------------------------------------------------------------------------------
    def close(self) -> None:
        """Release what the strategy holds outside the process (Gemini: its offload files); once,
        later calls do nothing. Not collective. What is in memory stays readable (weights, full
        state dicts), but a strategy that kept state on disk cannot train after. ``with engine:``
        closes it at the block's end, ``Trainer.fit`` at its own."""
        if self.closed:
            return
        self.closed = True
        untrack(self)
        self.strategy.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: Any) -> None:
        if error is None:
            self.close()
        else:
            close_after(self, error)  # the error that ended the block stays the one raised

    def local_tokens(self, batch: Any, length: int | None = None) -> Any:
        """This rank's tokens of every sequence in ``batch`` under sequence parallelism (the
        tensors whose dim 1 is the sequence, of ``length`` or of the batch's first tensor's
        length; or as the model's own ``sequence_tokens`` cuts them); ``batch`` itself otherwise."""
        if self._sequence is None:
            return batch
        if self._own_split is not None:
            return self._own_split(batch, self._sequence, self.ctx.dims.sequence_mode)
        length = length or sequence_length_of(batch)
        if length is None:
            return batch
        self._length = length
        return take_tokens(batch, self._sequence, self.ctx.dims.sequence_mode, length)

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
        """The loss function given to initialize (calling it without one raises a clear error).
        Under sequence parallelism it takes whole-sequence targets and uses this rank's tokens."""
        loss = self._loss
        if self._sequence is None:
            return loss

        def local_loss(outputs: Any, targets: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            return loss(outputs, self.local_tokens(targets, self._length), *args, **kwargs)

        return local_loss

    @property
    def _loss(self) -> Callable[..., torch.Tensor]:
        """The criterion as given (on this rank's tokens already under sequence parallelism)."""
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
        """Forward pass under autocast; gradients sync only on the final micro-step. Under
        sequence parallelism the model gets this rank's tokens of the inputs."""
        return self._forward(*self.local_tokens(args), **kwargs)

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        final = self.is_final_micro_step or not torch.is_grad_enabled()
        with autocast(self.precision, self.ctx.device), self._own_tokens_rng():
            return self.strategy.forward(*args, final=final, **kwargs)

    def _own_tokens_rng(self) -> AbstractContextManager[None]:
        """Under sequence parallelism, random draws in the forward (dropout) from a stream that
        differs along the sequence axis: each rank's tokens get masks of their own."""
        return self.ctx.rng.fork("sequence") if self._sequence is not None else contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` (divided by the accumulation steps, scaled for fp16)."""
        if self.scaler is None and not bool(torch.isfinite(loss.detach())):
            raise FloatingPointError(
                f"non-finite loss {loss.item()} at step {self.global_step} (micro-step {self.micro_step}) "
                f"in {self.precision}: lower the learning rate, clip gradients, or check the data"
            )
        scaled = loss.float() / self.accumulation
        factor = 1.0 / self.accumulation
        if self.scaler is not None:
            scaled = scaled * self.scaler.scale
            factor *= float(self.scaler.scale)
        if self._moe:
            set_aux_grad_scale(self._moe, factor)  # the MoE layers' auxiliary losses, weighed as the loss
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
        """``value`` averaged over the replicas (data, and sequence when split; a collective)."""
        value = torch.as_tensor(value, dtype=torch.float32, device=self.ctx.device).detach().reshape(1).clone()
        comm.all_reduce(value, self.ctx.replicas, op="avg")
        return float(value.item())

    def train_batch(self, data_iter: Iterator[Any]) -> float:
        """One optimizer step over ``gradient_accumulation`` micro-batches of ``data_iter``:
        ``(inputs, targets)`` pairs or dicts of tensors.

        Returns the loss averaged over the micro-batches and the replicas: the loss of the global
        batch, as one process would compute it (for dict batches, the mean over every item the
        loss counts: :attr:`loss_items`). Its reduction starts as soon as the last forward is done
        and overlaps the backward pass and the optimizer step. The step's micro-batches are taken
        first: when ``data_iter`` ends before a whole step, StopIteration is raised and nothing ran.
        """
        batches = _take_step(data_iter, self.micro_batches_per_step)
        self.last_step_rows = _rows(batches)
        if self.strategy.scheduled_microbatches is not None:
            return self._train_scheduled_batch(batches)
        if isinstance(batches[0], Mapping):
            return self._train_dict_batches(batches)
        self.zero_grad()
        total = torch.zeros((), device=self.ctx.device)
        pending = None
        for micro, batch in enumerate(batches):
            inputs, targets = self.local_tokens(_split_batch(_to_device(batch, self.ctx.device)))
            loss = self._loss(self._forward(inputs), targets)
            total = total + loss.detach().float()
            if micro == self.accumulation - 1:
                mean = (total / self.accumulation).reshape(1).clone()
                pending = comm.all_reduce_async(mean, self.ctx.replicas)
            self.backward(loss)
            self.step()
        assert pending is not None
        return float(pending.wait()) / self.ctx.replicas.size

    def _train_dict_batches(self, batches: list[Mapping[str, Any]]) -> float:
        """One step over dict micro-batches: micro-batch ``i`` of ``n_i`` counted items, of ``N``
        in the global batch, adds ``loss_i * n_i / N`` (its backward scaled by the accumulation
        steps and replicas that the engine and the gradient reduction divide by again)."""
        self.zero_grad()
        local, counts, total, scale = self._counted_batches(batches)
        weighted = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        pending = None
        for micro, (batch, count) in enumerate(zip(local, counts, strict=True)):
            loss = self.dict_loss(self._forward(**batch), batch)
            weighted = weighted + _weigh(loss.detach().double(), count, 1.0)
            if micro == self.accumulation - 1:
                pending = comm.all_reduce_async(weighted.reshape(1).clone(), self.ctx.replicas)
            self.backward(_weigh(loss.float(), count, scale))
            self.step()
        assert pending is not None
        return float(pending.wait()) / total

    def _counted_batches(
        self, batches: list[Mapping[str, Any]]
    ) -> tuple[list[Mapping[str, Any]], torch.Tensor, int, float]:
        """The step's dict micro-batches on this rank's device (its tokens of them), the items
        each one's loss counts, their sum ``N`` over the micro-batches and replicas (a
        collective), and the scale of ``loss_i * n_i`` that the micro-batches and replicas the
        gradients are divided by again turn into ``loss_i * n_i / N``."""
        local = [self.local_tokens(_to_device(b, self.ctx.device)) for b in batches]
        counts = torch.stack([self.loss_items(b).to(self.ctx.device) for b in local])
        total = self._counted_over_replicas(counts)
        return local, counts, total, len(local) * self.ctx.replicas.size / total

    def _counted_over_replicas(self, counts: torch.Tensor) -> int:
        """The sum of ``counts`` over the micro-batches and the replicas (a collective)."""
        total = counts.sum().reshape(1).clone()
        comm.all_reduce(total, self.ctx.replicas)
        n = int(total.item())
        if n == 0:
            raise TesseraError(
                f"step {self.global_step}: the global batch has no item for its loss to average over "
                "(every label is -100)"
            )
        return n

    def dict_loss(self, output: Any, batch: Mapping[str, Any]) -> torch.Tensor:
        """The loss of a dict batch: ``criterion(output, batch)`` when initialize got a criterion,
        else the model's own (``output.loss`` or ``output["loss"]``)."""
        if self._criterion is not None:
            return self._criterion(output, batch)
        return output_loss(output)

    def _train_scheduled_batch(self, batches: list[Any]) -> float:
        """One optimizer step through the strategy's schedule over ``batches`` (one per
        micro-batch); the gradients then meet over the data axis through the strategy."""
        self.strategy.zero_grad()
        if isinstance(batches[0], Mapping):
            scheduled, loss_fn = self._scheduled_dict_batches(batches)
        else:
            if self._criterion is None:  # refused on every rank, before the schedule starts
                raise TesseraError(
                    "(inputs, targets) batches through pipeline stages need the loss the last stage computes: "
                    "pass criterion=... to initialize, or give dict batches with labels (the model's own loss)"
                )
            scheduled = [self.local_tokens(_split_batch(_to_device(b, self.ctx.device))) for b in batches]
            loss_fn = self._loss
        if self._moe:  # the schedule divides each micro-batch's loss by their number
            set_aux_grad_scale(self._moe, 1.0 / len(scheduled))
        with autocast(self.precision, self.ctx.device), self._own_tokens_rng():
            loss = self.strategy.run_schedule(scheduled, loss_fn)
        if not math.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss} at step {self.global_step} in {self.precision}")
        self._apply_gradients()
        return self.mean_over_data(loss)

    def _scheduled_dict_batches(
        self, batches: list[Mapping[str, Any]]
    ) -> tuple[list[tuple[Any, Any]], Callable[[Any, Any], torch.Tensor]]:
        """Dict micro-batches as a schedule's ``(inputs, targets)`` and the loss that weighs them.

        Each dict is chunk 0's input (the later stages read it too: masks, positions) and, with
        its count of items (:attr:`loss_items`, counted on every rank from the batch before the
        schedule: every pipeline rank draws the same micro-batches), the last stage's target.
        Micro-batch ``i`` of ``n_i`` items, of ``N`` over the step's micro-batches and the
        replicas, gives ``loss_i * n_i / N`` times the micro-batches and replicas that the
        schedule and the gradient reduction divide by again: the step's gradient and loss are
        those of the global batch in one process."""
        local, counts, _, scale = self._counted_batches(batches)

        def weighed_loss(output: Any, target: tuple[Mapping[str, Any], torch.Tensor]) -> torch.Tensor:
            batch, count = target
            return _weigh(self.dict_loss(output, batch).float(), count, scale)

        return [(b, (b, n)) for b, n in zip(local, counts, strict=True)], weighed_loss

    @torch.no_grad()
    def eval_batch(self, data_iter: Iterator[Any]) -> tuple[float, Any]:
        """Loss (averaged over the replicas; for a dict batch, over the items its loss counts)
        and outputs of one batch (this rank's tokens of them under sequence parallelism)."""
        batch = _to_device(next(data_iter), self.ctx.device)
        if isinstance(batch, Mapping):
            batch = self.local_tokens(batch)
            outputs = self._forward(**batch)
            count = self.loss_items(batch).to(self.ctx.device)
            both = torch.stack([_weigh(self.dict_loss(outputs, batch).double(), count, 1.0), count.double()])
            comm.all_reduce(both, self.ctx.replicas)
            return float(both[0] / both[1]), outputs
        inputs, targets = self.local_tokens(_split_batch(batch))
        outputs = self._forward(inputs)
        loss = self._loss(outputs, targets)
        return self.mean_over_data(loss), outputs

    def state_dict(self) -> dict[str, Any]:
        """Engine counters and loss-scaler state (model and optimizer state are saved apart, by
        ``tessera.checkpoint``)."""
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


def _weigh(loss: torch.Tensor, count: torch.Tensor, scale: float) -> torch.Tensor:
    """``loss * count * scale``, and 0 where ``count`` is 0 (a mean over no items is NaN; the
    where gives its backward zeros, not NaN)."""
    return torch.where(count > 0, loss * (count.to(loss.dtype) * scale), torch.zeros_like(loss))
