"""The data loaders initialize builds, seen from every data rank in one process (no collective is
involved): each rank's share is disjoint, the shares together are what one process reads, every
rank gets as many batches, and a saved position continues where it was, also under another
number of ranks."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, SequentialSampler

from tessera.comm import AxisGroup
from tessera.errors import ConfigError
from tessera.parallel.loaders import (
    BatchSamplerLoader,
    ResumableLoader,
    ShardedBatchSampler,
    StreamLoader,
    distributed_loader,
    whole_groups,
)


class Numbers(Dataset):
    """Item ``i`` is ``{"x": i}`` (collated into a dict batch of int64 [rows])."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, int]:
        return {"x": i}


class Stream(IterableDataset):
    """``{"x": 0}, {"x": 1}, ...``: ``n`` items, optionally with a length; records set_epoch."""

    def __init__(self, n: int, sized: bool = False) -> None:
        self.n, self.sized, self.epoch = n, sized, 0

    def __iter__(self):
        return ({"x": self.epoch * 1000 + i} for i in range(self.n))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("a stream without a length")
        return self.n


def group(rank: int, size: int) -> AxisGroup:
    return AxisGroup("data", tuple(range(size)), rank, None)  # no process group: nothing is sent


def shard(loader: DataLoader, size: int) -> list[DataLoader]:
    return [distributed_loader(loader, group(r, size), seed=3) for r in range(size)]


def joined(lists) -> list:
    return list(itertools.chain.from_iterable(lists))


def rows(batches) -> list[list[int]]:
    return [b["x"].tolist() if isinstance(b["x"], torch.Tensor) else [b["x"]] for b in batches]


def test_whole_groups_leaves_out_an_unfinished_group():
    assert list(whole_groups(range(7), 3, 0)) == [0, 3] and list(whole_groups(range(7), 3, 2)) == [2, 5]
    assert list(whole_groups(range(2), 3, 0)) == []


# ---- iterable datasets -----------------------------------------------------------------------


@pytest.mark.parametrize(("n", "size", "drop_last"), [(20, 2, False), (23, 2, False), (23, 2, True), (21, 4, False)])
def test_a_stream_is_shared_by_rows_of_what_one_process_collates(n, size, drop_last):
    b = 3
    loaders = shard(DataLoader(Stream(n), batch_size=b, drop_last=drop_last), size)
    assert all(isinstance(loader, StreamLoader) and loader.batch_size == b for loader in loaders)
    per_rank = [rows(loader) for loader in loaders]
    assert len({len(batches) for batches in per_rank}) == 1, "every rank gets as many batches"
    one_process = rows(DataLoader(Stream(n), batch_size=b * size, drop_last=drop_last))
    for step, whole in enumerate(one_process):
        if len(whole) < size:  # fewer rows than ranks: left out
            assert step == len(one_process) - 1 and len(per_rank[0]) == step
            continue
        assert joined(per_rank[r][step] for r in range(size)) == whole
        if len(whole) == b * size:
            assert all(len(per_rank[r][step]) == b for r in range(size))


def test_a_stream_with_a_length_knows_each_ranks_batches():
    for n, drop_last in [(20, False), (23, False), (23, True), (25, False)]:
        for loader in shard(DataLoader(Stream(n, sized=True), batch_size=3, drop_last=drop_last), 4):
            assert len(loader) == len(list(loader)), (n, drop_last)
    with pytest.raises(TypeError):
        len(shard(DataLoader(Stream(20), batch_size=3), 2)[0])


def test_a_stream_of_batches_gives_each_rank_whole_items_in_turn():
    loaders = shard(DataLoader(Stream(7), batch_size=None), 3)
    assert [rows(loader) for loader in loaders] == [[[0], [3]], [[1], [4]], [[2], [5]]]


def test_a_stream_resumes_after_the_batches_read_also_under_other_ranks():
    source = DataLoader(Stream(40), batch_size=2)
    first = shard(source, 2)
    for loader in first:
        loader.set_epoch(1)
    iters = [iter(loader) for loader in first]
    for it in iters:
        next(it), next(it), next(it)
    state = first[0].state_dict()
    assert state == {"kind": "stream", "epoch": 1, "batches": 3, "batch_size": 4} == first[1].state_dict()
    rest = [rows(it) for it in iters]
    for size, b in [(2, 2), (4, 1), (1, 4)]:  # the same global batch of 4
        again = shard(DataLoader(Stream(40), batch_size=b), size)
        for loader in again:
            loader.load_state_dict(state)
        got = [rows(loader) for loader in again]
        merged = [joined(got[r][k] for r in range(size)) for k in range(len(got[0]))]
        assert merged == [joined(rest[r][k] for r in range(2)) for k in range(len(rest[0]))]
        assert merged[0][0] == 1000 + 12  # epoch 1's stream, after 3 x 4 items
    with pytest.raises(ConfigError, match="not a whole number of this loader's batches of 10"):
        shard(DataLoader(Stream(40), batch_size=5), 2)[0].load_state_dict(state)


def test_positions_of_one_kind_of_loader_do_not_load_into_another():
    stream = shard(DataLoader(Stream(8), batch_size=2), 2)[0]
    mapped = shard(DataLoader(Numbers(8), batch_size=2), 2)[0]
    with pytest.raises(ConfigError, match="of a sampler loader; this is a stream loader"):
        stream.load_state_dict(mapped.state_dict())
    with pytest.raises(ConfigError, match="of a stream loader; this is a sampler loader"):
        mapped.load_state_dict(stream.state_dict())


# ---- custom batch samplers ---------------------------------------------------------------------


class Buckets:
    """Batches of different sizes, the same on every rank for an epoch (shifted by it)."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes, self.epoch = sizes, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        start = self.epoch
        for size in self.sizes:
            yield list(range(start, start + size))
            start += size

    def __len__(self) -> int:
        return len(self.sizes)


def test_a_batch_sampler_gives_each_rank_every_pth_batch_in_whole_groups():
    sizes = [2, 3, 1, 4, 2, 2, 3]
    loaders = shard(DataLoader(Numbers(40), batch_sampler=Buckets(sizes)), 2)
    assert all(isinstance(loader, BatchSamplerLoader) for loader in loaders)
    one_process = [b.tolist() for b in (x["x"] for x in DataLoader(Numbers(40), batch_sampler=Buckets(sizes)))]
    assert rows(loaders[0]) == one_process[0:6:2] and rows(loaders[1]) == one_process[1:6:2]
    assert [len(loader) for loader in loaders] == [3, 3]  # the seventh batch is left out


def test_a_batch_sampler_resumes_and_follows_the_epoch():
    loaders = shard(DataLoader(Numbers(60), batch_sampler=Buckets([2] * 12)), 2)
    for loader in loaders:
        loader.set_epoch(5)
    iters = [iter(loader) for loader in loaders]
    taken = [rows([next(it), next(it)]) for it in iters]
    assert taken[0][0] == [5, 6]  # the batch sampler's own set_epoch was called
    state = loaders[0].state_dict()
    assert state == {"kind": "batch_sampler", "epoch": 5, "batches": 4}
    rest = [rows(it) for it in iters]
    again = shard(DataLoader(Numbers(60), batch_sampler=Buckets([2] * 12)), 4)
    for loader in again:
        loader.load_state_dict(state)
    got = [rows(loader) for loader in again]
    assert sorted(joined(joined(got))) == sorted(joined(joined(rest)))
    with pytest.raises(ConfigError, match="resume with a number of data ranks that divides it"):
        shard(DataLoader(Numbers(60), batch_sampler=Buckets([2] * 12)), 3)[0].load_state_dict(state)


def test_a_torch_batch_sampler_hears_the_epoch_through_its_sampler():
    class Seen(SequentialSampler):
        epoch = -1

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

    inner = BatchSampler(Seen(range(8)), batch_size=2, drop_last=False)
    sharded = ShardedBatchSampler(inner, 0, 2)
    sharded.set_epoch(4)
    assert inner.sampler.epoch == 4 and list(sharded) == [[0, 1], [4, 5]] and len(sharded) == 2


def test_a_batch_sampler_with_fewer_batches_than_ranks_is_refused():
    with pytest.raises(ConfigError, match="gives 1 batches, fewer than the 2 data-parallel ranks"):
        shard(DataLoader(Numbers(4), batch_sampler=Buckets([3])), 2)


# ---- map-style -----------------------------------------------------------------------------------


def test_a_map_style_loader_of_ready_batches_shares_items():
    loaders = shard(DataLoader(Numbers(7), batch_size=None), 2)
    assert all(isinstance(loader, ResumableLoader) for loader in loaders)
    got = [rows(loader) for loader in loaders]
    assert got == [[[0], [2], [4], [6]], [[1], [3], [5], [0]]]  # the sampler repeats to even out
    iters = [iter(loader) for loader in loaders]
    next(iters[0]), next(iters[1])
    assert loaders[0].state_dict() == {"epoch": 0, "samples": 2}
