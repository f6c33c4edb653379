"""The chunk store's packing with a group per tensor (ZeRO's experts shard over a smaller group
than the rest of the model): tensors of different groups never share a chunk, and each chunk
is sharded over its tensors' group."""

from __future__ import annotations

import pytest
import torch

from tessera.comm.group import single_rank_group
from tessera.memory.chunks import ChunkStore


def test_tensors_of_different_groups_never_share_a_chunk():
    dense, experts = single_rank_group("data"), single_rank_group("expert_data")
    named = [(f"t{i}", torch.full((3,), float(i))) for i in range(5)]
    groups = [dense, dense, experts, experts, dense]
    store = ChunkStore(named, dense, chunk_numel=100, keep_full=True, groups=groups)
    assert [[s.name for s in c.slots] for c in store.chunks] == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert [c.group for c in store.chunks] == [dense, experts, dense]
    for name, tensor in named:
        assert torch.equal(store.view(name), tensor)
    with pytest.raises(ValueError, match="2 groups for 5 tensors"):
        ChunkStore(named, dense, chunk_numel=100, groups=groups[:2])
