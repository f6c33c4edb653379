"""ShardSpec padding arithmetic, checked without any process (a fake context answers size() and
local_rank(); a group of one rank makes gather_full's all-gathers no-ops)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tessera.comm.group import AxisGroup, single_rank_group
from tessera.parallel.tensor.common import ShardSpec, gather_full, local_shard


class FakeContext:
    """The mesh axes' sizes and this rank's index along each."""

    def __init__(self, sizes: dict[str, int], ranks: dict[str, int] | None = None) -> None:
        self.sizes, self.ranks = sizes, ranks or {}

    def size(self, axis: str) -> int:
        return self.sizes[axis]

    def local_rank(self, axis: str) -> int:
        return self.ranks.get(axis, 0)

    def group(self, axis: str) -> AxisGroup:
        assert self.sizes[axis] == 1, "only groups of one rank without processes"
        return single_rank_group(axis)


def shards(full: torch.Tensor, spec: ShardSpec, axis: str, size: int) -> list[torch.Tensor]:
    """Every rank's block along ``axis`` (of ``size`` ranks)."""
    contexts: list[Any] = [FakeContext({axis: size}, {axis: r}) for r in range(size)]
    return [local_shard(full, spec, ctx) for ctx in contexts]


def test_default_pads_to_the_number_of_parts():
    spec = ShardSpec((10, 6), (("a",), ()))
    assert spec.pad_to == (0, 0) and spec == ShardSpec((10, 6), (("a",), ()), pad_to=(0, 0))
    ctx: Any = FakeContext({"a": 4})
    assert (spec.padded_size(0, ctx), spec.padded_size(1, ctx), spec.local_shape(ctx)) == (12, 6, (3, 6))
    full = torch.arange(60.0).view(10, 6)
    blocks = shards(full, spec, "a", 4)
    assert torch.equal(blocks[3], torch.cat([full[9:], torch.zeros(2, 6)]))
    assert torch.equal(torch.cat(blocks)[:10], full)


def test_pad_to_a_larger_multiple():
    # 30 split 2 ways: padded to 32 (a multiple of 4), not 30
    spec = ShardSpec((30,), (("a",),), pad_to=(4,))
    ctx: Any = FakeContext({"a": 2})
    assert spec.padded_size(0, ctx) == 32 and spec.local_shape(ctx) == (16,)
    full = torch.arange(1.0, 31.0)
    first, second = shards(full, spec, "a", 2)
    assert torch.equal(first, full[:16]) and torch.equal(second, torch.cat([full[16:], torch.zeros(2)]))
    # 29 with a multiple of 8 on 2 parts: 32, blocks of 16
    assert ShardSpec((29,), (("a",),), pad_to=(8,)).padded_size(0, ctx) == 32
    # already a multiple: no padding
    assert ShardSpec((32,), (("a",),), pad_to=(4,)).local_shape(ctx) == (16,)


def test_pad_to_applies_to_each_fused_part():
    # two parts of 29 rows, each padded to 32 and split 2 ways: a rank holds 16 rows of each
    spec = ShardSpec((58, 3), (("a",), ()), groups=(2, 1), pad_to=(4, 0))
    ctx: Any = FakeContext({"a": 2})
    assert spec.padded_size(0, ctx) == 64 and spec.local_shape(ctx) == (32, 3)
    full = torch.arange(1.0, 59.0)[:, None].expand(58, 3)
    first, second = shards(full, spec, "a", 2)
    assert torch.equal(first, torch.cat([full[:16], full[29:45]]))
    assert torch.equal(second, torch.cat([full[16:29], torch.zeros(3, 3), full[45:], torch.zeros(3, 3)]))


def test_pad_to_on_several_axes_and_gather_drops_the_padding():
    # a dimension split by (a, b) = 2 x 2 ways and padded to a multiple of 8: block a*2 + b of 2
    spec = ShardSpec((5, 13), ((), ("a", "b")), pad_to=(0, 8))
    full = torch.arange(65.0).view(5, 13)
    ctx: Any = FakeContext({"a": 2, "b": 2}, {"a": 1, "b": 0})
    assert spec.padded_size(1, ctx) == 16 and spec.local_shape(ctx) == (5, 4)
    assert torch.equal(local_shard(full, spec, ctx), full[:, 8:12])
    # on one rank: padded locally (to 16), and gather_full drops it again
    single: Any = FakeContext({"a": 1, "b": 1})
    local = local_shard(full, spec, single)
    assert local.shape == (5, 16) and not local[:, 13:].any()
    assert torch.equal(gather_full(local, spec, single), full)


def test_invalid_pad_to_is_refused():
    ctx: Any = FakeContext({"a": 2})
    with pytest.raises(ValueError, match="pad_to entries"):
        ShardSpec((4, 4), (("a",), ()), pad_to=(4,))
    with pytest.raises(ValueError, match="pad_to"):
        ShardSpec((4, 4), (("a",), ()), pad_to=(0, 4))  # dimension 1 is not split
    with pytest.raises(ValueError, match="pad_to"):
        ShardSpec((4,), (("a",),), pad_to=(-2,))
    with pytest.raises(ValueError, match="not divisible"):
        ShardSpec((6,), (("a",),), pad_to=(3,)).padded_size(0, ctx)  # 3 is not a multiple of 2 parts
