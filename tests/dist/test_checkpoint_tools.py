"""Checkpoint tools on checkpoints written by several ranks: ``consolidate`` puts ZeRO-3 pieces,
tensor-parallel blocks and pipeline stages back together into exactly (bit for bit) what
``full_state_dict`` gives on the ranks that saved them, and ``inspect`` reports their layout
and pieces."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tessera.checkpoint import consolidate, full_state_dict, inspect, save
from tests.dist.test_checkpoint_resume import BUCKET_MB, build, setup

LAYOUTS = {
    "zero3-dp2": ({"parallel": {"data": 2}, "zero": {"stage": 3, "chunk_mb": BUCKET_MB}}, "zero3"),
    "tp2-1d": ({"parallel": {"data": 1, "tensor": {"size": 2, "mode": "1d"}}}, "ddp"),
    "pp2": ({"parallel": {"data": 1, "pipeline": {"size": 2, "schedule": "1f1b", "microbatches": 2}}}, "pipeline"),
}


def train_and_save(config: dict, path: str):
    engine, loader, scheduler = setup(config, dropout=0.0)
    it = iter(loader)
    for _ in range(3):
        engine.train_batch(it)
        scheduler.step()
    save(path, engine)
    state = full_state_dict(engine.model)
    return state if engine.ctx.rank == 0 else None


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_consolidate_a_multi_rank_checkpoint_equals_full_state_dict(pools, tmp_path, layout):
    config, strategy = LAYOUTS[layout]
    path = tmp_path / layout
    expected = pools.run(2, train_and_save, config, str(path), timeout=300)[0]
    info = inspect(path)
    assert info["complete"], info["problems"]
    assert info["layout"]["world_size"] == 2 and info["layout"]["strategy"].startswith(strategy)
    assert info["step"] == 3
    rows = {r["name"]: r for r in info["tensors"]}
    weight = rows["model/blocks.0.mlp.fc.weight"]
    assert weight["shape"] == [128, 32] and weight["missing_elements"] == 0
    # ZeRO-3: two flat pieces; tp2: two row blocks; pp2: whole, on the stage that holds it
    assert weight["pieces"] == (1 if layout == "pp2" else 2)
    written = {f["name"] for f in info["files"] if f["name"].endswith(".safetensors")}
    assert written == {"rank00000.safetensors", "rank00001.safetensors"}

    out = tmp_path / f"{layout}.safetensors"
    consolidate(path, out)
    state = load_file(str(out))
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert state[key].dtype == value.dtype and state[key].shape == value.shape, key
        assert torch.equal(state[key].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), key
    build(dropout=0.0).load_state_dict(state)  # a single-process model takes it as it is
