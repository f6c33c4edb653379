"""Data parallelism: torch DDP with its gradient buckets reduced through ``tessera.comm`` (so the
comm ledger counts them) and the two replicated-optimizer strategies (DDP, and one all-reduce at
the step). The data loaders that give each data-parallel rank its own share of the data are in
:mod:`tessera.parallel.loaders` (``distributed_loader`` is importable from here too)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tessera import comm
from tessera.context import ParallelContext
from tessera.context.reduction import Reduction, gradient_reduction, reduce_gradients_of
from tessera.memory.deferred import allocate_module
from tessera.parallel.loaders import ResumableLoader, ResumableSampler, distributed_loader
from tessera.parallel.strategy import Strategy


def _bucket_all_reduce_hook(reduction: Reduction, bucket):  # type: ignore[no-untyped-def]
    """DDP comm hook: reduce a gradient bucket as ``reduction`` says (divide, then sum).

    ``bucket`` is a ``dist.GradBucket``; it is left unannotated because DDP checks the
    annotation object itself and this module's annotations are strings.
    """
    return comm.all_reduce_async(bucket.buffer().div_(reduction.divide_by), reduction.group)


def reduced_apart(params: Iterable[torch.Tensor], ctx: ParallelContext) -> list[torch.Tensor]:
    """The parameters among ``params`` whose gradients are not reduced like a parameter every
    replica holds (an MoE layer's experts): DDP leaves them to be reduced after the backward."""
    replicated = gradient_reduction(ctx)
    return [p for p in params if gradient_reduction(ctx, p) != replicated]


def wrap_data_parallel(model: nn.Module, ctx: ParallelContext, device: torch.device, **ddp_options: Any) -> nn.Module:
    """Wrap ``model`` in DDP over the group a replicated parameter's gradient is reduced over
    (``tessera.context.reduction``: the replicas); returned unchanged when it has one rank.

    DDP keeps its bucketing and overlap of reduction with the backward pass; only the bucket
    all-reduce is routed through ``tessera.comm``. Its one-off broadcast of the initial weights
    and (with ``broadcast_buffers``) of buffers go through DDP itself and are not in the ledger.
    Parameters reduced over another group (:func:`reduced_apart`: experts) are left out: their
    holders reduce them apart, and DDP's initial broadcast would overwrite them with another
    rank's experts.
    """
    reduction = gradient_reduction(ctx)
    if reduction.group.size == 1:
        return model
    apart = {id(p) for p in reduced_apart(model.parameters(), ctx)}
    if apart:
        names = [name for name, p in model.named_parameters() if id(p) in apart]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    device_ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids, process_group=reduction.group.pg, **ddp_options)
    ddp.register_comm_hook(reduction, _bucket_all_reduce_hook)
    comm.hold_process_group(ddp, _release_process_group)
    return ddp


def _release_process_group(ddp: DistributedDataParallel) -> None:
    """At ``tessera.shutdown()``: drop what holds the process group, as DDP's own pickling
    does, so that the group (and its worker threads) can end before the interpreter."""
    for name in ("logger", "reducer", "process_group"):
        ddp.__dict__.pop(name, None)


class DataParallel(Strategy):
    """Plain data parallelism: the model wrapped in DDP over the replicas, which averages the
    gradients during the step's last backward pass (the parameters reduced apart, such as
    experts, after it, each as ``tessera.context.reduction`` says); the user's optimizer steps
    replicas alike."""

    name = "ddp"

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, ctx: ParallelContext) -> None:
        self.module = module
        self.optimizer = optimizer
        self.ctx = ctx
        allocate_module(module, ctx.device, lambda p: True)  # a deferred model: DDP needs real tensors
        self.model = wrap_data_parallel(module, ctx, ctx.device)

    def forward(self, *args: Any, final: bool = True, **kwargs: Any) -> Any:
        if isinstance(self.model, DistributedDataParallel):
            self.model.require_backward_grad_sync = final  # no reduction on non-final micro-steps
        return self.model(*args, **kwargs)

    def reduce_gradients(self) -> None:
        reduce_gradients_of(reduced_apart(self.module.parameters(), self.ctx), self.ctx)


class AverageAtStep(Strategy):
    """Replicated optimizer whose gradients are reduced after the step's last backward, one flat
    all-reduce per group that ``tessera.context.reduction`` assigns (the replicas; the ranks
    holding the same experts): for modules not wrapped in DDP, such as a pipeline stage's,
    whose step runs many backward passes."""

    name = "allreduce"

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, ctx: ParallelContext) -> None:
        self.module = self.model = module
        self.optimizer = optimizer
        self.ctx = ctx

    def reduce_gradients(self) -> None:
        reduce_gradients_of(self.module.parameters(), self.ctx)


__all__ = [
    "AverageAtStep",
    "DataParallel",
    "ResumableLoader",
    "ResumableSampler",
    "distributed_loader",
    "reduced_apart",
    "wrap_data_parallel",
]
