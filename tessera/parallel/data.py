"""Data parallelism: torch DDP with its gradient buckets reduced through ``tessera.comm`` (so the
comm ledger counts them), data loaders that give each data-parallel rank its own samples, and
the two replicated-optimizer strategies (DDP, and one all-reduce at the step)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from tessera import comm
from tessera.comm import AxisGroup
from tessera.context import ParallelContext
from tessera.errors import ConfigError
from tessera.memory.deferred import allocate_module
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
    """
    if group.size == 1:
        return model
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


def distributed_loader(loader: DataLoader, group: AxisGroup, seed: int) -> DataLoader:
    """The same loader, but each rank of ``group`` reads its own 1/P of the samples.

    ``batch_size`` stays per rank (a micro-batch); shuffling, when the loader shuffled, uses the
    same permutation on every rank (``seed`` + epoch; call ``loader.sampler.set_epoch``).
    """
    if loader.batch_size is None:
        raise ConfigError("data loaders with a custom batch_sampler are not supported; pass batch_size= instead")
    dataset = loader.dataset
    try:
        n = len(dataset)  # type: ignore[arg-type]
    except TypeError as exc:
        raise ConfigError("data loaders over iterable-style datasets are not supported yet") from exc
    if n < group.size:
        raise ConfigError(
            f"the data loader has {n} samples, fewer than the {group.size} data-parallel ranks: "
            "every rank needs at least one sample"
        )
    # Rebuilt even on one rank, so that every layout shuffles alike and has sampler.set_epoch.
    sampler = ResumableSampler(
        dataset,
        num_replicas=group.size,
        rank=group.rank,
        shuffle=isinstance(loader.sampler, RandomSampler),
        seed=seed,
        drop_last=loader.drop_last,
    )
    return ResumableLoader(
        dataset,
        batch_size=loader.batch_size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        persistent_workers=loader.persistent_workers if loader.num_workers > 0 else False,
        # its own generator: starting an iteration draws a worker seed from it, not from the
        # global generator that dropout uses (so where an iteration starts, after a resume for
        # example, does not shift the model's random numbers)
        generator=torch.Generator().manual_seed(seed),
    )


class ResumableSampler(DistributedSampler):
    """A ``DistributedSampler`` that can start an epoch part-way through (``start``: samples of
    this rank to skip), without reading the skipped samples."""

    start: int = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.start :])

    def __len__(self) -> int:
        return max(0, self.num_samples - self.start)


class ResumableLoader(DataLoader):
    """The data loader ``initialize`` returns: it counts the batches handed out in the current
    epoch, and its position (``state_dict``: epoch and samples consumed by all data ranks)
    restores into a loader over any number of data ranks (``load_state_dict``: the next
    iteration starts after those samples)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches_taken = 0  # batches handed out since this epoch's iteration began
        self._resume_at = 0  # batches to skip at the next iteration

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler = self.sampler
        assert isinstance(sampler, ResumableSampler)
        skip, self._resume_at = self._resume_at, 0
        sampler.start = skip * self._batch()
        self.batches_taken = skip
        inner = super().__iter__()  # reads sampler.start lazily: it stays until the next iteration

        def counted() -> Iterator[Any]:
            for batch in inner:
                self.batches_taken += 1
                yield batch

        return counted()

    def _batch(self) -> int:
        assert self.batch_size is not None
        return self.batch_size

    def state_dict(self) -> dict[str, Any]:
        sampler = self.sampler
        assert isinstance(sampler, ResumableSampler)
        return {
            "epoch": sampler.epoch,
            "samples": self.batches_taken * self._batch() * sampler.num_replicas,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the epoch's shuffle, after its first ``samples`` samples."""
        sampler = self.sampler
        assert isinstance(sampler, ResumableSampler)
        per_batch = self._batch() * sampler.num_replicas
        samples = int(state["samples"])
        if samples % per_batch:
            raise ConfigError(
                f"the data position ({samples} samples into epoch {state['epoch']}) is not a whole number of "
                f"batches of {self._batch()} x {sampler.num_replicas} data ranks: keep the global batch the same"
            )
        sampler.set_epoch(int(state["epoch"]))
        self._resume_at = samples // per_batch


class DataParallel(Strategy):
    """Plain data parallelism: the model wrapped in DDP over the data axis, which averages the
    gradients during the step's last backward pass; the user's optimizer steps replicas alike."""

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
        group = self.ctx.replicas
        params = [p for p in self.module.parameters() if p.grad is not None]
        if group.size == 1 or not params:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
        comm.all_reduce(flat, group, op="avg")
        offset = 0
        for p in params:
            assert p.grad is not None
            p.grad.copy_(flat[offset : offset + p.grad.numel()].view_as(p.grad))
            offset += p.grad.numel()
