"""Data loaders that give each data-parallel rank its own share of the data and know where they
are in an epoch (the data position a checkpoint saves).

``initialize`` rebuilds a user's ``DataLoader`` with :func:`distributed_loader`. The loader's batch
stays one rank's micro-batch; under ``P`` data ranks ``P`` of them make one micro-step of the
global batch. How the share is taken depends on the kind of loader:

- **map-style with ``batch_size``** (:class:`ResumableLoader`): a ``DistributedSampler`` over
  the samples (rank ``r`` reads samples ``r, r + P, ...`` of the epoch's order, shuffled alike
  on every rank from the seed and the epoch); without ``drop_last`` the sampler repeats samples
  so that every rank has as many. ``batch_size=None`` (each item is a batch) likewise, item by item.
- **a custom ``batch_sampler``** (:class:`BatchSamplerLoader`): rank ``r`` takes batches
  ``r, r + P, ...`` of the batch sampler's batches, in whole groups of ``P``: the last
  ``len % P`` batches of an epoch are left out. The batch sampler must give the same batches on
  every rank (seed its shuffling; its ``set_epoch`` is called each epoch, if it has one).
- **an iterable dataset** (streaming; :class:`StreamLoader`): every rank reads the whole stream
  through a loader of ``P x batch_size`` and keeps its rows of each batch (rows ``[r * b,
  (r + 1) * b)``: the batch one process would collate, cut by rows, every tensor alike). A
  shorter batch (the stream's end) is cut as evenly as it goes; one with fewer rows than ranks is
  left out. With ``batch_size=None`` (the stream yields batches) rank ``r`` takes items
  ``r, r + P, ...`` in whole groups of ``P``. The stream must give the same items on every rank
  (its ``set_epoch`` is called each epoch, if it has one).

Every rank thus gets as many batches as the others, so all stop together at the end of the data.
Each loader's ``state_dict`` is its position (epoch, what all ranks consumed in it) and
``load_state_dict`` continues from there, under any number of data ranks that divides the data
consumed into whole batches. A stream resumes by reading its epoch again from the start up to
the position (its items are not kept): it must give the same items when read again.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler

from tessera.comm import AxisGroup
from tessera.errors import ConfigError
from tessera.parallel.batches import row_share, rows_of, take_rows

T = TypeVar("T")


def distributed_loader(loader: DataLoader, group: AxisGroup, seed: int) -> DataLoader:
    """The same loader, but each rank of ``group`` reads its own share of the data (above).

    ``batch_size`` stays per rank (a micro-batch); shuffling, when the loader shuffled, uses the
    same permutation on every rank (``seed`` + epoch; call ``loader.set_epoch``).
    """
    if isinstance(loader.dataset, IterableDataset):
        return StreamLoader(loader, group.rank, group.size, seed)
    if loader.batch_size is None and loader.batch_sampler is not None:
        return BatchSamplerLoader(loader, group.rank, group.size, seed)
    return _sampled_loader(loader, group, seed)


def _sampled_loader(loader: DataLoader, group: AxisGroup, seed: int) -> ResumableLoader:
    dataset = loader.dataset
    n = len(dataset)  # type: ignore[arg-type]
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
        dataset, sampler=sampler, batch_size=loader.batch_size, drop_last=loader.drop_last, **_loading(loader, seed)
    )


def _loading(loader: DataLoader, seed: int) -> dict[str, Any]:
    """How ``loader`` loads (workers, collation, pinning), to rebuild it with."""
    return dict(
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        persistent_workers=loader.persistent_workers if loader.num_workers > 0 else False,
        # its own generator: starting an iteration draws a worker seed from it, not from the
        # global generator that dropout uses (so where an iteration starts, after a resume for
        # example, does not shift the model's random numbers)
        generator=torch.Generator().manual_seed(seed),
    )


def whole_groups(items: Iterable[T], size: int, rank: int) -> Iterator[T]:
    """Item ``rank`` of every whole group of ``size`` consecutive ``items`` (an unfinished last
    group gives nothing, so every rank gets as many items)."""
    group: list[T] = []
    for item in items:
        group.append(item)
        if len(group) == size:
            yield group[rank]
            group = []


def _set_epoch(source: Any, epoch: int) -> None:
    """Call ``source.set_epoch(epoch)`` if it has one."""
    set_epoch = getattr(source, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)


class PositionedLoader(DataLoader):
    """A data loader that counts the batches it hands out in the current epoch and can start an
    epoch after the batches a checkpoint says were taken (``load_state_dict``)."""

    #: what ``state_dict`` calls this kind of position (a checkpoint of one kind does not load into another)
    kind = "sampler"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches_taken = 0  # batches handed out since this epoch's iteration began
        self._resume_at = 0  # batches of this rank to skip at the next iteration

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        skip, self._resume_at = self._resume_at, 0
        self.batches_taken = skip
        inner = self._batches(skip)

        def counted() -> Iterator[Any]:
            for batch in inner:
                self.batches_taken += 1
                yield batch

        return counted()

    def _batches(self, skip: int) -> Iterator[Any]:
        """This rank's batches of the epoch after its first ``skip``."""
        raise NotImplementedError

    def set_epoch(self, epoch: int) -> None:
        """Start the epoch ``epoch``: its shuffle, the same on every rank."""
        raise NotImplementedError

    def _check_kind(self, state: dict[str, Any]) -> None:
        kind = state.get("kind", "sampler")
        if kind != self.kind:
            raise ConfigError(
                f"the checkpoint's data position is of a {kind} loader; this is a {self.kind} loader: "
                "resume with the kind of data loader the run was saved with"
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


class ResumableLoader(PositionedLoader):
    """The loader of a map-style dataset: its position (``state_dict``: epoch and samples consumed
    by all data ranks) restores into a loader over any number of data ranks (``load_state_dict``:
    the next iteration starts after those samples)."""

    def _batches(self, skip: int) -> Iterator[Any]:
        self._sampler().start = skip * self._batch()
        return DataLoader.__iter__(self)  # reads sampler.start lazily: it stays until the next iteration

    def _sampler(self) -> ResumableSampler:
        sampler = self.sampler
        assert isinstance(sampler, ResumableSampler)
        return sampler

    def _batch(self) -> int:
        return self.batch_size if self.batch_size is not None else 1  # None: each item is a batch

    def set_epoch(self, epoch: int) -> None:
        self._sampler().set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        sampler = self._sampler()
        return {"epoch": sampler.epoch, "samples": self.batches_taken * self._batch() * sampler.num_replicas}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the epoch's shuffle, after its first ``samples`` samples."""
        self._check_kind(state)
        sampler = self._sampler()
        per_batch = self._batch() * sampler.num_replicas
        samples = int(state["samples"])
        if samples % per_batch:
            raise ConfigError(
                f"the data position ({samples} samples into epoch {state['epoch']}) is not a whole number of "
                f"batches of {self._batch()} x {sampler.num_replicas} data ranks: keep the global batch the same"
            )
        sampler.set_epoch(int(state["epoch"]))
        self._resume_at = samples // per_batch


class ShardedBatchSampler:
    """Batches ``rank, rank + size, ...`` of ``batch_sampler``'s, in whole groups of ``size``
    (:func:`whole_groups`), after its first ``start`` batches (a multiple of ``size``)."""

    def __init__(self, batch_sampler: Iterable[list[int]], rank: int, size: int) -> None:
        self.batch_sampler = batch_sampler
        self.rank, self.size = rank, size
        self.start = 0
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        _set_epoch(self.batch_sampler, epoch)
        if not hasattr(self.batch_sampler, "set_epoch"):  # a torch BatchSampler over a sampler that has one
            _set_epoch(getattr(self.batch_sampler, "sampler", None), epoch)

    def __iter__(self) -> Iterator[list[int]]:
        start = self.start  # read now: a later change is for the next iteration
        batches = iter(self.batch_sampler)
        for _ in range(start):  # indices only: no sample is read
            if next(batches, None) is None:
                break
        return whole_groups(batches, self.size, self.rank)

    def __len__(self) -> int:
        return max(0, (len(self.batch_sampler) - self.start) // self.size)  # type: ignore[arg-type]


class BatchSamplerLoader(PositionedLoader):
    """The loader of a custom batch sampler, sharded by :class:`ShardedBatchSampler`; its position
    is the epoch and the batch sampler's batches all data ranks consumed."""

    kind = "batch_sampler"

    def __init__(self, loader: DataLoader, rank: int, size: int, seed: int) -> None:
        batch_sampler = ShardedBatchSampler(loader.batch_sampler, rank, size)  # type: ignore[arg-type]
        total = getattr(loader.batch_sampler, "__len__", None)
        if total is not None and total() < size:
            raise ConfigError(
                f"the batch sampler gives {total()} batches, fewer than the {size} data-parallel ranks: "
                "every rank needs at least one batch"
            )
        super().__init__(loader.dataset, batch_sampler=batch_sampler, **_loading(loader, seed))

    def _sharded(self) -> ShardedBatchSampler:
        batch_sampler = self.batch_sampler
        assert isinstance(batch_sampler, ShardedBatchSampler)
        return batch_sampler

    def _batches(self, skip: int) -> Iterator[Any]:
        sharded = self._sharded()
        sharded.start = skip * sharded.size
        return DataLoader.__iter__(self)

    def set_epoch(self, epoch: int) -> None:
        self._sharded().set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        sharded = self._sharded()
        return {"kind": self.kind, "epoch": sharded.epoch, "batches": self.batches_taken * sharded.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the epoch's batches after its first ``batches``."""
        self._check_kind(state)
        sharded = self._sharded()
        batches = int(state["batches"])
        if batches % sharded.size:
            raise ConfigError(
                f"the data position ({batches} batches into epoch {state['epoch']}) is not a whole number of "
                f"groups of {sharded.size} data ranks' batches: resume with a number of data ranks that divides it"
            )
        sharded.set_epoch(int(state["epoch"]))
        self._resume_at = batches // sharded.size


class StreamLoader(PositionedLoader):
    """The loader of an iterable dataset: every rank reads the whole stream through ``source``, a
    loader like the user's of ``size`` times its ``batch_size``, and keeps its rows of each batch
    (or, with ``batch_size=None``, its items of each whole group). Its position is the epoch and
    the source's batches read."""

    kind = "stream"

    def __init__(self, loader: DataLoader, rank: int, size: int, seed: int) -> None:
        rows = loader.batch_size
        loading = _loading(loader, seed)
        super().__init__(loader.dataset, batch_size=rows, drop_last=loader.drop_last, **loading)
        self.rank, self.size = rank, size
        self.epoch = 0
        batch = rows * size if rows is not None else None
        self.source = DataLoader(loader.dataset, batch_size=batch, drop_last=loader.drop_last, **loading)
        self._read = 0  # the source's batches read in this epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        _set_epoch(self.dataset, epoch)

    def _batches(self, skip: int) -> Iterator[Any]:
        source = iter(self.source)
        self._read = 0
        skipped = skip if self.batch_size is not None else skip * self.size  # a restored position is whole
        for _ in range(skipped):  # read again, not kept: a stream cannot seek
            if next(source, None) is None:
                break
            self._read += 1
        return self._shares(source)

    def _counted(self, source: Iterator[Any]) -> Iterator[Any]:
        for batch in source:
            self._read += 1
            yield batch

    def _shares(self, source: Iterator[Any]) -> Iterator[Any]:
        if self.batch_size is None:
            yield from whole_groups(self._counted(source), self.size, self.rank)
            return
        for batch in self._counted(source):
            rows = rows_of(batch)
            if rows is None:
                raise ConfigError(
                    "a batch of the iterable dataset's loader holds no tensor with a batch dimension, "
                    "so its rows cannot be shared over the data-parallel ranks"
                )
            if rows >= self.size:  # else too few rows for every rank to have one: left out
                yield take_rows(batch, *row_share(rows, self.size, self.rank), rows)

    def __len__(self) -> int:
        """This rank's batches in an epoch (when the dataset has a length)."""
        n = len(self.dataset)  # type: ignore[arg-type]  # TypeError when the stream has none
        if self.batch_size is None:
            return n // self.size
        whole, tail = divmod(n, self.batch_size * self.size)
        return whole + int(tail >= self.size and not self.drop_last)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "epoch": self.epoch, "batches": self._read, "batch_size": self.source.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the epoch's stream after the batches (or items) read."""
        self._check_kind(state)
        read, saved = int(state["batches"]), state.get("batch_size")
        mine = self.source.batch_size
        if saved != mine:
            if saved is None or mine is None or (read * saved) % mine:
                raise ConfigError(
                    f"the data position ({read} batches of {saved} into epoch {state['epoch']}) is not a whole "
                    f"number of this loader's batches of {mine}: keep the global batch the same"
                )
            read = read * saved // mine
        self.set_epoch(int(state["epoch"]))
        self._resume_at = read if mine is not None else -(-read // self.size)


__all__ = [
    "BatchSamplerLoader",
    "PositionedLoader",
    "ResumableLoader",
    "ResumableSampler",
    "ShardedBatchSampler",
    "StreamLoader",
    "distributed_loader",
    "whole_groups",
]
