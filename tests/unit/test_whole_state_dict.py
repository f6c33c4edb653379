"""``state_dict()`` of a module whose parameters live in released chunks (ZeRO-3, Gemini):
whole copies under the usual keys, each chunk gathered once, every chunk left as it was.
One process, a chunk store over a group of one rank (its gathers are copies)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tessera.comm import single_rank_group
from tessera.memory.chunks import Chunk, ChunkState, ChunkStore, WholeStateDict


class Tied(nn.Module):
    """An embedding, two linears and a head tied to the embedding, plus a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.body = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 3))
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.arange(3.0))


def packed(
    keep_full: bool = False, hooks: bool = True, loaded: list[int] | None = None
) -> tuple[Tied, ChunkStore, dict[str, torch.Tensor]]:
    """The model with its parameters moved into 3 chunks (released unless ``keep_full``), as
    ZeRO packs them; and its state dict from before. ``loaded`` collects the chunks a load
    reports (by index)."""
    torch.manual_seed(0)
    model = Tied()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    named = list(model.named_parameters())  # the tied weight once
    chunk_of: dict[int, Chunk] = {}

    def adopt(chunk: Chunk) -> None:
        for slot in chunk.slots:
            p = named[slot.index][1]
            p.data = chunk.view(slot)
            chunk_of[id(p)] = chunk

    store = ChunkStore(named, single_rank_group("data"), chunk_numel=16, keep_full=keep_full, on_close=adopt)
    assert len(store.chunks) == 3
    if hooks:
        WholeStateDict(model, chunk_of, on_loaded=None if loaded is None else lambda c: loaded.append(c.index))
    return model, store, expected


@pytest.fixture
def gathers(monkeypatch):
    """The chunks gathered (each ``Chunk.gather`` that communicates), by index, in order."""
    seen: list[int] = []
    original = Chunk.gather

    def counting(self: Chunk, async_op: bool = False) -> None:
        if self.state is ChunkState.SHARDED:
            seen.append(self.index)
        original(self, async_op)

    monkeypatch.setattr(Chunk, "gather", counting)
    return seen


def test_without_the_hooks_released_parameters_have_empty_storage():
    model, _, _ = packed(hooks=False)
    assert model.state_dict()["body.0.weight"].untyped_storage().nbytes() == 0


def test_state_dict_is_whole_gathers_each_chunk_once_and_releases_it_again(gathers):
    model, store, expected = packed()
    state = model.state_dict()
    assert list(state) == list(expected)
    for key, value in state.items():
        assert value.untyped_storage().nbytes() > 0, key
        assert torch.equal(value, expected[key]), key
    assert sorted(gathers) == [0, 1, 2]
    assert all(c.state is ChunkState.SHARDED for c in store.chunks)
    # the tied weight is one copy under both keys, as one process shares one tensor's storage
    assert state["head.weight"] is state["emb.weight"]
    assert not any(v.requires_grad for v in state.values())


def test_a_submodule_state_dict_is_whole_too():
    model, store, expected = packed()
    for module, prefix in ((model.body, "body."), (model.body[1], "body.1."), (model.head, "head.")):
        state = module.state_dict()
        assert {k: v.tolist() for k, v in state.items()} == {
            k.removeprefix(prefix): v.tolist() for k, v in expected.items() if k.startswith(prefix)
        }
        assert all(c.state is ChunkState.SHARDED for c in store.chunks)


def test_keep_vars_returns_the_live_parameters_without_gathering(gathers):
    model, _, _ = packed()
    state = model.state_dict(keep_vars=True)
    assert state["body.0.weight"] is model.body[0].weight
    assert gathers == []


def test_chunks_gathered_before_the_call_stay_gathered_but_entries_are_copies():
    model, store, expected = packed()
    with store.gathered():
        state = model.state_dict()
        assert all(c.state is ChunkState.GATHERED for c in store.chunks)
    assert all(c.state is ChunkState.SHARDED for c in store.chunks)
    assert all(torch.equal(state[k], expected[k]) for k in expected)


def test_chunks_that_keep_their_full_buffer_give_views_as_plain_pytorch_does(gathers):
    model, store, expected = packed(keep_full=True)
    state = model.state_dict()
    chunk = store.locate("body.0.weight")[0]
    assert state["body.0.weight"].untyped_storage().data_ptr() == chunk.full.untyped_storage().data_ptr()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    assert gathers == []


def test_a_call_that_raised_is_cleaned_up_by_the_next_one():
    model, store, expected = packed()
    raised = []

    def fail_once(module, prefix, keep_vars):
        if not raised:
            raised.append(True)
            raise RuntimeError("boom")

    model.body[1].register_state_dict_pre_hook(fail_once)
    with pytest.raises(RuntimeError, match="boom"):
        model.state_dict()
    state = model.state_dict()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    assert all(c.state is ChunkState.SHARDED for c in store.chunks)


# ---- load_state_dict ------------------------------------------------------------------------------


def test_load_state_dict_reaches_the_shards_and_releases_again(gathers):
    loaded: list[int] = []
    model, store, expected = packed(loaded=loaded)
    target = {k: v + 1.0 for k, v in expected.items()}
    model.load_state_dict(target)
    assert all(c.state is ChunkState.SHARDED for c in store.chunks)
    assert sorted(gathers) == [0, 1, 2]
    assert sorted(loaded) == [0, 1, 2]  # each chunk once, after its last module
    for name in ("emb.weight", "body.0.bias", "body.1.weight"):
        chunk, slot = store.locate(name)
        part = chunk.shard[slot.offset - chunk.shard_range[0] :][: slot.numel]
        assert torch.equal(part, target[name].reshape(-1)), name  # the shard (one rank: all of it)
    state = model.state_dict()
    assert all(torch.equal(state[k], target[k]) for k in target)


def test_a_partial_load_keeps_the_other_values():
    model, store, expected = packed()
    model.load_state_dict({"body.0.bias": torch.full((4,), 7.0)}, strict=False)
    state = model.state_dict()
    assert state["body.0.bias"].tolist() == [7.0] * 4
    assert all(torch.equal(state[k], expected[k]) for k in expected if k != "body.0.bias")
    assert all(c.state is ChunkState.SHARDED for c in store.chunks)


def test_load_with_assign_is_refused_before_anything_changes():
    model, store, expected = packed()
    weight = model.emb.weight
    with pytest.raises(ValueError, match="assign=True"):
        model.load_state_dict({k: v + 1.0 for k, v in expected.items()}, assign=True)
    assert model.emb.weight is weight
    state = model.state_dict()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    assert all(c.state is ChunkState.SHARDED for c in store.chunks)
