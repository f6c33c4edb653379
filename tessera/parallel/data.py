"""Data parallelism: torch DDP with its gradient buckets reduced through ``tessera.comm`` (so the
comm ledger counts them) and the two replicated-optimizer strategies (DDP, and one all-reduce at
the step). The data loaders that give each data-parallel rank its own share of the data are in
:mod:`tessera.parallel.loaders` (``distributed_loader`` is importable from here too)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tessera import comm
from tessera.comm import AxisGroup
from tessera.context import ParallelContext
from tessera.memory.deferred import allocate_module
from tessera.parallel.experts import expert_parameter_names, is_expert, reduce_expert_gradients
from tessera.parallel.loaders import ResumableLoader, ResumableSampler, distributed_loader
from tessera.parallel.strategy import Strategy


def _bucket_all_reduce_hook(group: AxisGroup, bucket):  # type: ignore[no-untyped-def]
    """DDP comm hook: average a gradient bucket over the data axis (divide, then sum).

    ``bucket`` is a ``dist.GradBucket``; it is left unannotated because DDP checks the
    annotation object itself and this module's annotations are strings.
    """
    return comm.all_reduce_async(bucket.buffer().div_(group.size), group)


def wrap_data_parallel(model: nn.Module, group: AxisGroup, device: torch.device, **ddp_options: Any) -> nn.Module:
    """Wrap ``model`` in DDP over ``group`` (returned unchanged when the group has one rank).

    DDP keeps its bucketing and overlap of reduction with the backward pass; only the bucket
    all-reduce is routed through ``tessera.comm``. Its one-off broadcast of the initial weights
    and (with ``broadcast_buffers``) of buffers go through DDP itself and are not in the ledger.
    Expert parameters (split over the ``expert`` axis) are left out: their holders reduce them
    apart (``tessera.parallel.experts``), and DDP's initial broadcast would overwrite them with
    another rank's experts.
    """
    if group.size == 1:
        return model
    experts = expert_parameter_names(model)
    if experts:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, experts)
    device_ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids, process_group=group.pg, **ddp_options)
    ddp.register_comm_hook(group, _bucket_all_reduce_hook)
    comm.hold_process_group(ddp, _release_process_group)
    return ddp


def _release_process_group(ddp: DistributedDataParallel) -> None:
    """At ``tessera.shutdown()``: drop what holds the process group, as DDP's own pickling
    does, so that the group (and its worker threads) can end before the interpreter."""
    for name in ("logger", "reducer", "process_group"):
        ddp.__dict__.pop(name, None)


class DataParallel(Strategy):
    """Plain data parallelism: the model wrapped in DDP over the data axis, which averages the
    gradients during the step's last backward pass (expert parameters after it, over the ranks
    holding the same experts); the user's optimizer steps replicas alike."""

    name = "ddp"

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, ctx: ParallelContext) -> None:
        self.module = module
        self.optimizer = optimizer
        self.ctx = ctx
        allocate_module(module, ctx.device, lambda p: True)  # a deferred model: DDP needs real tensors
        self.model = wrap_data_parallel(module, ctx.replicas, ctx.device)

    def forward(self, *args: Any, final: bool = True, **kwargs: Any) -> Any:
        if isinstance(self.model, DistributedDataParallel):
            self.model.require_backward_grad_sync = final  # no reduction on non-final micro-steps
        return self.model(*args, **kwargs)

    def reduce_gradients(self) -> None:
        reduce_expert_gradients(self.module.parameters(), self.ctx)


class AverageAtStep(Strategy):
    """Replicated optimizer whose gradients are averaged over the data axis in one flat
    all-reduce after the step's last backward (for modules not wrapped in DDP, such as a
    pipeline stage's, whose step runs many backward passes)."""

    name = "allreduce"

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, ctx: ParallelContext) -> None:
        self.module = self.model = module
        self.optimizer = optimizer
        self.ctx = ctx

    def reduce_gradients(self) -> None:
        reduce_expert_gradients(self.module.parameters(), self.ctx)
        group = self.ctx.replicas
        if group.size > 1:
            grads = [p.grad for p in self.module.parameters() if p.grad is not None and not is_expert(p)]
            comm.all_reduce_flat(grads, group, op="avg")


__all__ = [
    "AverageAtStep",
    "DataParallel",
    "ResumableLoader",
    "ResumableSampler",
    "distributed_loader",
    "wrap_data_parallel",
]
