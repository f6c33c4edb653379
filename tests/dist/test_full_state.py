"""The user's own view of the model stays whole: ``full_state_dict(engine)`` gives the fp32
masters under mixed-precision ZeRO (also through a pipeline), ``model.state_dict()`` under
ZeRO-3 gives whole tensors, and a Hugging Face model trained under ZeRO-3 saves with
``save_pretrained`` and reloads in one process to the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

import tessera
from tessera import comm
from tessera.amp import autocast
from tessera.checkpoint import full_state_dict, load_full_state_dict
from tessera.context.placement import placement_of
from tessera.memory.chunks import ChunkState
from tessera.models import NextTokenLoss
from tessera.testing import tolerance, use_layout
from tests.dist.test_zero import GLOBAL_BATCH, build, dataset, make_config

STEPS = 4


def mine(step: int, data_rank: int, data: int) -> slice:
    """This data rank's part of the global batch of ``step``."""
    per_rank = GLOBAL_BATCH // data
    start = step * GLOBAL_BATCH + data_rank * per_rank
    return slice(start, start + per_rank)


def train_zero3(dtype: str, offload: str):
    """The GPT under ZeRO-3 on 2 data ranks for a few steps; what each view of its weights says."""
    ctx = use_layout(config=make_config(3, 2, dtype=dtype, offload=offload))
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    engine, *_ = tessera.initialize(model, optimizer, NextTokenLoss())
    x, y = dataset().tensors
    for step in range(STEPS):
        part = mine(step, ctx.local_rank("data"), 2)
        engine.train_batch(iter([(x[part], y[part])]))
    # The masters as the shards hold them, taken apart from tessera's gather: (name, offset
    # in the flattened parameter, values) for each piece of this rank.
    store = engine.optimizer.store
    by_slot = {placement_of(p).zero.index: p for g in engine.optimizer.param_groups for p in g["params"]}
    pieces = []
    for chunk in store.chunks:
        for slot, start, end in chunk.shard_pieces():
            piece = by_slot[slot.index].detach()
            assert piece.numel() == end - start and piece.dtype == torch.float32
            pieces.append((slot.name, chunk.shard_range[0] + start - slot.offset, piece.clone()))
    masters = full_state_dict(engine)
    with comm.ledger() as led:
        state = model.state_dict()
    gathered_once = led.payload_bytes(op="all_gather") == sum(c.padded_numel for c in store.chunks) * (
        2 if dtype == "bf16" else 4
    )
    released = all(c.state is ChunkState.SHARDED for c in store.chunks)
    storage = {k: v.untyped_storage().nbytes() for k, v in state.items()}
    return {
        "pieces": pieces,
        "masters": masters,
        "state": {k: v.clone() for k, v in state.items()},
        "storage": storage,
        "model_form": full_state_dict(model),
        "gathered_once": gathered_once,
        "released": released,
        "shapes": {slot.name: tuple(slot.shape) for c in store.chunks for slot in c.slots},
    }


def reference_bf16_autocast() -> dict[str, torch.Tensor]:
    """One process, fp32 weights, bf16 autocast: the weights ZeRO's masters follow."""
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    x, y = dataset().tensors
    for step in range(STEPS):
        batch = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        optimizer.zero_grad()
        with autocast("bf16", torch.device("cpu")):
            loss = NextTokenLoss()(model(x[batch]), y[batch])
        loss.backward()
        optimizer.step()
    return full_state_dict(model)


def assemble(results: list[dict]) -> dict[str, torch.Tensor]:
    """Each parameter's master from every rank's pieces."""
    shapes = results[0]["shapes"]
    flat = {name: torch.full((torch.Size(shape).numel(),), float("nan")) for name, shape in shapes.items()}
    for result in results:
        for name, offset, values in result["pieces"]:
            flat[name][offset : offset + values.numel()] = values
    return {name: flat[name].view(shapes[name]) for name in shapes}


@pytest.mark.parametrize("dtype,offload", [("bf16", "none"), ("bf16", "cpu"), ("fp32", "none")])
def test_zero3_full_state_is_the_masters_and_state_dict_is_whole(pools, dtype, offload):
    results = pools.run(2, train_zero3, dtype, offload, timeout=600)
    first = results[0]
    masters, state = first["masters"], first["state"]
    assert all(torch.equal(r["masters"][k], masters[k]) for r in results for k in masters), "every rank alike"
    # full_state_dict(engine) is, bitwise, what the shards hold (the tied head is the embedding)
    assembled = assemble(results)
    assert set(assembled) | {"lm_head.weight"} == set(masters)
    for name, value in assembled.items():
        assert masters[name].dtype == torch.float32
        assert torch.equal(masters[name], value), name
    assert torch.equal(masters["lm_head.weight"], masters["tok_emb.weight"])
    # model.state_dict(): whole tensors (the parameters' own dtype), each chunk gathered once,
    # released again after the call
    assert state.keys() == masters.keys()
    for r in results:
        assert all(n > 0 for n in r["storage"].values()), r["storage"]
        assert r["gathered_once"] and r["released"]
    for key in masters:
        param_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        assert state[key].dtype == param_dtype, key
        assert torch.equal(state[key], masters[key].to(param_dtype)), key
        assert torch.equal(first["model_form"][key], state[key]), key
    if dtype == "bf16":
        # the masters keep what bf16 cannot hold, and follow single-process bf16 autocast training
        assert any(not torch.equal(v, v.bfloat16().float()) for v in masters.values())
        reference = reference_bf16_autocast()
        for key in reference:
            torch.testing.assert_close(masters[key], reference[key], rtol=2e-2, atol=2e-2, msg=key)


def load_both_ways(stage: int):
    """bf16 ZeRO on 2 data ranks: ``model.load_state_dict`` and ``load_full_state_dict`` of the
    same values, then one step each; the fp32 masters after loading and after the step."""
    ctx = use_layout(config=make_config(stage, 2, dtype="bf16"))
    target = {k: (v + 0.5).bfloat16().float() for k, v in full_state_dict(build()).items()}  # bf16-exact
    x, y = dataset().tensors
    part = mine(0, ctx.local_rank("data"), 2)
    results = {}
    for how in ("load_state_dict", "load_full_state_dict"):
        model = build()
        engine, *_ = tessera.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), NextTokenLoss())
        if how == "load_state_dict":
            model.load_state_dict(target)  # collective under ZeRO-3, like state_dict()
        else:
            load_full_state_dict(model, target)
        after_load = full_state_dict(engine)
        engine.train_batch(iter([(x[part], y[part])]))
        results[how] = (after_load, full_state_dict(engine))
    return target, results


@pytest.mark.parametrize("stage", [1, 3])
def test_model_load_state_dict_reaches_shards_and_masters(pools, stage):
    for target, results in pools.run(2, load_both_ways, stage, timeout=600):
        for key in target:
            for how, (after_load, _) in results.items():
                assert torch.equal(after_load[key], target[key]), (how, key)
            assert torch.equal(results["load_state_dict"][1][key], results["load_full_state_dict"][1][key]), key


# ---- through a pipeline ----------------------------------------------------------------------------


def train_pipeline_bf16():
    """The GPT in 2 pipeline stages x 2 data ranks, ZeRO-1 with bf16 parameters."""
    config = make_config(1, 2, dtype="bf16")
    config["parallel"]["pipeline"] = {"size": 2, "schedule": "1f1b", "microbatches": 2}
    ctx = use_layout(pipeline=2, config=config)
    model = build()
    engine, *_ = tessera.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6), NextTokenLoss())
    x, y = dataset().tensors
    for step in range(STEPS):
        part = mine(step, ctx.local_rank("data"), 2)
        micro = (part.stop - part.start) // 2
        engine.train_batch(iter([(x[part.start + i * micro : part.start + (i + 1) * micro],
                                  y[part.start + i * micro : part.start + (i + 1) * micro]) for i in range(2)]))  # fmt: skip
    return full_state_dict(engine), full_state_dict(model)


def test_pipeline_full_state_is_the_masters_of_each_stage(pools):
    results = pools.run(4, train_pipeline_bf16, timeout=600)
    masters, params = results[0]
    reference = reference_bf16_autocast()
    assert all(torch.equal(r[0][k], masters[k]) for r in results for k in masters), "every rank alike"
    for key in reference:
        assert masters[key].dtype == torch.float32 and params[key].dtype == torch.bfloat16, key
        # each stage's masters, not another stage's stale copy: they round to its parameters
        assert torch.equal(masters[key].bfloat16(), params[key]), key
        torch.testing.assert_close(masters[key], reference[key], rtol=2e-2, atol=2e-2, msg=key)


# ---- Hugging Face: save_pretrained under ZeRO-3, from_pretrained in one process -------------------


def tiny_gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def hf_loss(output, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.logits.flatten(0, 1).float(), targets.flatten())


def train_hf_zero3(dtype: str, directory: str):
    """GPT-2 (random weights) under ZeRO-3 on 2 data ranks; saved as the docs say."""
    ctx = use_layout(config=make_config(3, 2, dtype=dtype))
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine, *_ = tessera.initialize(model, optimizer, hf_loss)
    x, y = dataset().tensors
    for step in range(STEPS):
        part = mine(step, ctx.local_rank("data"), 2)
        engine.train_batch(iter([(x[part], y[part])]))
    engine.eval()
    with torch.no_grad():
        logits = engine(x[:4]).logits.float()
    # every rank: model.state_dict() gathers (collective); rank 0 writes
    model.save_pretrained(Path(directory) / "model", is_main_process=ctx.rank == 0)
    masters = full_state_dict(engine)  # every rank
    if ctx.rank == 0:
        model.save_pretrained(Path(directory) / "masters", state_dict=masters)
    return logits, masters


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_hugging_face_model_saved_under_zero3_reloads_in_one_process(pools, tmp_path, dtype):
    logits, masters = pools.run(2, train_hf_zero3, dtype, str(tmp_path), timeout=600)[0]
    x = dataset().tensors[0][:4]
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "model").eval()
    with torch.no_grad(), autocast(dtype, torch.device("cpu")):
        again = reloaded(x).logits.float()
    if dtype == "fp32":
        torch.testing.assert_close(again, logits, **tolerance(blocks=2))  # the same weights, another forward
    else:  # bf16 parameters, computed under autocast as the engine did
        assert reloaded.dtype == torch.bfloat16
        torch.testing.assert_close(again, logits, rtol=0, atol=1e-2)
    # the fp32 masters, saved through state_dict=, reload bitwise
    full = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "masters", dtype=torch.float32)
    loaded = full.state_dict()
    for key, value in masters.items():
        assert value.dtype == loaded[key].dtype == torch.float32, key
        assert torch.equal(loaded[key], value), key
