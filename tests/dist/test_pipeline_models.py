"""The GPT and the ViT trained through pipeline stages, alone and with tensor and data
parallelism, give the single-process losses and weights."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import tessera
from tessera.checkpoint import full_state_dict
from tessera.errors import ConfigError
from tessera.models import gpt
from tessera.testing import tolerance, use_layout
from tests.dist.test_tp_models import GLOBAL_BATCH, STEPS, build, criterion, dataset, train


def deep_gpt() -> torch.nn.Module:
    """Six blocks: with embeddings and head, 8 layers, enough for 4 stages x 2 chunks."""
    torch.manual_seed(0)
    return gpt("tiny", vocab_size=64, max_seq_len=16, d_model=32, n_layers=6, n_heads=4)


def train_pipeline(kind: str, pp: int, schedule: str, m: int, v: int = 1, data: int | None = None,
                   tensor: int = 1, mode: str = "1d"):  # fmt: skip
    pipeline = {"size": pp, "schedule": schedule, "microbatches": m, "chunks": v}
    config = {"parallel": {"data": data, "pipeline": pipeline, "tensor": {"size": tensor, "mode": mode}}}
    ctx = use_layout(pipeline=pp, data=data, tensor=tensor, mode=mode, config=config)
    model = deep_gpt() if kind == "deep-gpt" else build(kind)
    initial = full_state_dict(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    data_kind = "gpt" if kind == "deep-gpt" else kind
    loader = DataLoader(dataset(data_kind), batch_size=GLOBAL_BATCH // (ctx.size("data") * m))
    loss = criterion("gpt" if kind == "deep-gpt" else kind)
    engine, loader, _, _ = tessera.initialize(model, optimizer, loss, loader)
    it = iter(loader)
    losses = [engine.train_batch(it) for _ in range(STEPS)]
    final = full_state_dict(model)
    return losses, (initial, final) if ctx.rank == 0 else None


@pytest.fixture(scope="module")
def references():
    return {kind: train(kind, None) for kind in ("gpt", "vit")}


CASES = {
    # name: (pool, pp, schedule, micro-batches, chunks per rank, data, tensor, mode)
    "pp2-gpipe": (2, 2, "gpipe", 4, 1, None, 1, "1d"),
    "pp2-1f1b": (2, 2, "1f1b", 4, 1, None, 1, "1d"),
    "pp2-interleaved-v2": (2, 2, "interleaved", 4, 2, None, 1, "1d"),
    "pp2-zero-bubble": (2, 2, "zero_bubble", 4, 1, None, 1, "1d"),
    "pp4-gpipe": (4, 4, "gpipe", 4, 1, None, 1, "1d"),
    "pp4-1f1b": (4, 4, "1f1b", 4, 1, None, 1, "1d"),
    "pp4-zero-bubble": (4, 4, "zero_bubble", 4, 1, None, 1, "1d"),
    "pp2-tp2-1d-dp2": (8, 2, "1f1b", 4, 1, 2, 2, "1d"),
    "pp2-tp4-2d": (8, 2, "1f1b", 4, 1, None, 4, "2d"),
}


def assert_same_run(result, reference, blocks: int = 2):
    """The same initial weights (bitwise), then STEPS steps of a model of ``blocks`` blocks."""
    losses, (initial, final) = result
    ref_losses, (ref_initial, ref_final) = reference
    for key in ref_initial:
        assert torch.equal(initial[key], ref_initial[key]), key
    tol = tolerance(blocks=blocks, steps=STEPS)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **tol)
    assert final.keys() == ref_final.keys()
    for key in ref_final:
        torch.testing.assert_close(final[key], ref_final[key], **tol, msg=key)


@pytest.mark.parametrize("kind", ["gpt", "vit"])
@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_trains_to_the_single_process_answer(pools, references, kind, name):
    ranks, pp, schedule, m, v, data, tensor, mode = CASES[name]
    results = pools.run(ranks, train_pipeline, kind, pp, schedule, m, v, data, tensor, mode, timeout=600)
    assert_same_run(results[0], references[kind])
    assert all(r[0] == results[0][0] for r in results), "every rank reports the same loss"


def train_deep_reference():
    use_layout(config={})
    model = deep_gpt()
    initial = full_state_dict(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    engine, loader, _, _ = tessera.initialize(
        model, optimizer, criterion("gpt"), DataLoader(dataset("gpt"), batch_size=GLOBAL_BATCH)
    )
    it = iter(loader)
    losses = [engine.train_batch(it) for _ in range(STEPS)]
    return losses, (initial, full_state_dict(model))


def test_interleaved_on_four_stages_trains_to_the_single_process_answer(pools):
    results = pools.run(4, train_pipeline, "deep-gpt", 4, "interleaved", 4, 2, timeout=600)
    assert_same_run(results[0], train_deep_reference(), blocks=6)


def body_too_many_stages():
    config = {"parallel": {"pipeline": {"size": 4, "schedule": "1f1b", "microbatches": 4}}}
    use_layout(pipeline=4, config=config)
    model = gpt("tiny", vocab_size=64, max_seq_len=16, d_model=32, n_layers=1, n_heads=4)  # embeddings, block, head
    tessera.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), criterion("gpt"))


def test_more_stages_than_layers_fails_clearly(pools):
    with pytest.raises(Exception, match="pipeline of 4 parts .* needs at least 4 layers, the model has 3"):
        pools.run(4, body_too_many_stages)


def test_one_f_one_b_needs_a_micro_batch_per_stage():
    with pytest.raises(ConfigError, match="microbatches=2 is fewer than the 4 stages"):
        tessera.load_config({"parallel": {"pipeline": {"size": 4, "schedule": "1f1b", "microbatches": 2}}})
