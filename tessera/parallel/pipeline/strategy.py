"""Pipeline parallelism as a training strategy: a step runs the rank's schedule over all its
micro-batches; the gradients then meet over the data axis through an inner strategy (one
all-reduce for replicated optimizers, or ZeRO-1's reduce-scatter)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from tessera import comm
from tessera.context.placement import placement_of, storages_of
from tessera.context.views import HeldTensor
from tessera.errors import TesseraError
from tessera.memory.deferred import allocate, set_data
from tessera.parallel.pipeline.stage import PipelineStage
from tessera.parallel.strategy import Strategy, WrappingStrategy


class PipelineParallel(WrappingStrategy):
    """This rank's pipeline ``stage``; ``gradients`` (a strategy over the same module, the
    inner one) reduces, clips and steps what the schedule's backward passes leave. Every method
    of the interface not defined here is the inner strategy's."""

    def __init__(self, stage: PipelineStage, gradients: Strategy) -> None:
        self.stage = stage
        self.inner = gradients
        self.module = self.model = gradients.module
        self.optimizer = gradients.optimizer
        self.ctx = gradients.ctx
        self.scheduled_microbatches = stage.microbatches
        self.name = f"pipeline({stage.schedule})+{gradients.name}"
        self._weights_stale = True  # other stages' weights changed since the last sync

    def forward(self, *args: Any, final: bool = True, **kwargs: Any) -> Any:
        """The whole model on this rank, for evaluation under ``no_grad`` (every stage's current
        weights are fetched first, once per step)."""
        if torch.is_grad_enabled():
            raise TesseraError(
                "with pipeline stages the engine trains whole steps: call engine.train_batch(data_iter) "
                "(each item one micro-batch: an (inputs, targets) pair or a dict); engine(x) is for evaluation under no_grad"
            )
        self._sync_weights()
        return self.module(*args, **kwargs)

    def run_schedule(self, batches: Sequence[tuple[Any, Any]], criterion: Callable[..., torch.Tensor]) -> float:
        """The step's schedule over ``batches`` (``(inputs, targets)`` per micro-batch; inputs
        may be a dict), each micro-batch's loss ``criterion(output, targets)`` on the last stage."""
        return self.stage.step(batches, criterion)

    def _sync_weights(self) -> None:
        """Give every rank the current weights of every stage: each parameter is broadcast from
        the stage that trains it (collective over the pipeline axis)."""
        if not self._weights_stale:
            return
        with torch.no_grad():
            for p in self.module.parameters():  # a tied parameter is listed once
                stage = placement_of(p).stage
                if p.is_meta:  # another stage's parameter of a deferred model: made here to evaluate
                    set_data(p, allocate(p, self.ctx.device))
                if stage is not None:
                    comm.broadcast(p.data, self.ctx.group("pipeline"), src=stage)
            for storage in storages_of(self.module.parameters()):
                storage.params_loaded()  # sharded copies (ZeRO-1) follow the received values
        self._weights_stale = False

    def step(self) -> None:
        self.inner.step()
        self._weights_stale = True

    # ---- what this stage holds -----------------------------------------------------------------
    def holds(self, param: torch.Tensor) -> bool:
        return any(param is p for p in self.stage.parameters)

    def checkpoint_tensors(self) -> list[HeldTensor]:
        """The inner strategy's records of the parameters this stage trains (tied ones on every
        stage that holds them), and the buffers."""
        return self._this_stages(self.inner.checkpoint_tensors())

    def checkpoint_groups(self) -> list[AbstractContextManager[list[HeldTensor]]]:
        """The inner strategy's groups, each with the records of :meth:`checkpoint_tensors`."""
        return [self._group(group) for group in self.inner.checkpoint_groups()]

    @contextmanager
    def _group(self, group: AbstractContextManager[list[HeldTensor]]) -> Iterator[list[HeldTensor]]:
        with group as held:
            yield self._this_stages(held)

    def _this_stages(self, held: list[HeldTensor]) -> list[HeldTensor]:
        """Of ``held``, the parameters this stage trains and every buffer."""
        trained = {id(p) for p in self.stage.parameters}
        keys = {key for key, p in self.module.named_parameters() if id(p) in trained}
        params = {key for key, _ in self.module.named_parameters()}
        return [h for h in held if h.key in keys or h.key not in params]

    def checkpoint_session(self) -> AbstractContextManager[None]:
        self._weights_stale = True  # other stages' weights: fetched again before evaluation
        return self.inner.checkpoint_session()
