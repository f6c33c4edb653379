"""Releasing a chunk on the device gives its storage back to the allocator; gathering it brings
the data back, also into views taken before the release."""

from __future__ import annotations

import torch

from tessera.memory.chunks import ChunkState, ChunkStore
from tessera.testing import use_layout
from tests.cuda.lane import allocated_bytes
from tests.cuda.runs import gpt_config, train_gpt

N = 64 * 1024  # fp32 elements per tensor: 256 KiB, a multiple of the allocator's 512-byte blocks


def test_release_frees_the_device_storage_and_gather_restores_it(device):
    ctx = use_layout(device=device)
    g = torch.Generator().manual_seed(0)
    tensors = [("a", torch.randn(N, generator=g).to(device)), ("b", torch.randn(256, N // 256, generator=g).to(device))]
    store = ChunkStore(tensors, ctx.group("data"), chunk_numel=4 * N)
    (chunk,) = store.chunks
    payload = chunk.padded_numel * chunk.full.element_size()
    assert chunk.state is ChunkState.SHARDED
    assert chunk.full.untyped_storage().nbytes() == 0 and chunk.full.device == device

    before = allocated_bytes(device)
    chunk.gather()
    assert chunk.full.untyped_storage().nbytes() == payload
    if before is not None:
        assert allocated_bytes(device) - before == payload
    saved = store.view("b")  # a view taken while gathered, as autograd saves one in forward
    for name, tensor in tensors:
        torch.testing.assert_close(store.view(name), tensor, rtol=0, atol=0)

    chunk.release()
    assert chunk.state is ChunkState.SHARDED
    assert chunk.full.untyped_storage().nbytes() == 0
    if before is not None:
        assert allocated_bytes(device) == before

    chunk.gather()
    torch.testing.assert_close(saved, tensors[1][1], rtol=0, atol=0)
    assert saved.device == device
    chunk.release()


def test_zero3_leaves_every_chunk_released_on_the_device_between_steps(device):
    _, _, engine = train_gpt(device, gpt_config("fp32", stage=3), steps=2)
    chunks = engine.optimizer.store.chunks
    assert len(chunks) > 1
    for chunk in chunks:
        assert chunk.state is ChunkState.SHARDED
        assert chunk.full.untyped_storage().nbytes() == 0
        assert chunk.shard.device == device
