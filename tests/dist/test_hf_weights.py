"""Hugging Face checkpoint folders in and out of tessera layouts (tessera.hf.weights).

Tiny random GPT-2 and LLaMA models (grouped-query attention, a vocabulary of 67 that the tensor
size does not divide) are saved by plain transformers; ``tessera.hf.from_pretrained`` builds
them deferred and ``tessera.initialize`` fills each rank's blocks or pieces from the folder
(single file and sharded with an index) under 1d tp2, tp2 x dp2, ZeRO-3 dp2, 2d tp4, pp2 x tp2,
pp2 x tp2 x dp2 and 3d tp8: the logits are plain transformers' (1e-5), the pipeline layouts'
from the engine's evaluation of the whole model. After training under tp2 and under 3d tp8,
``save_pretrained`` writes a folder that plain ``from_pretrained`` loads to the parallel model's
logits (those of the same steps in one process), with the keys transformers itself writes.
Folders that do not fit the model fail naming the file and the tensor; loading keeps each
rank's peak memory within its share plus one tensor under tp2, 2d tp4 and pp2 x tp2 x dp2.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

import tessera
from tessera.bench.zero_ranks import trim_heap
from tessera.checkpoint import CheckpointError, full_state_dict
from tessera.hf.weights import INDEX, WEIGHTS, read_folder
from tessera.memory.report import model_state_bytes, peak_rss_bytes, reset_peak_rss
from tessera.testing import tolerance, use_layout
from tests.conftest import REPORT

BATCH, SEQ, VOCAB = 4, 16, 67
STEPS = 3
FORWARD = tolerance(blocks=2)  # the logits of the same weights, another layout (2 layers)


def config_of(family: str, **overrides) -> transformers.PretrainedConfig:
    if family == "gpt2":
        fields = dict(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return transformers.GPT2Config(**(fields | overrides))
    fields = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=50, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ,
    )  # fmt: skip
    return transformers.LlamaConfig(**(fields | overrides))


def build(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    config = config_of(family, **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config)


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    rows = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=g)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in rows]


def loss_of(output, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1), targets.flatten())


def logits_of(model: Any) -> torch.Tensor:
    """The logits of ``model`` (a module or an engine) for :func:`tokens`, evaluated."""
    model.eval()
    with torch.no_grad():
        return model(tokens()).logits


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Per family: a folder saved by plain transformers, a sharded copy of it (with an index),
    and the plain model's logits."""
    out = {}
    for family in ("gpt2", "llama"):
        model = build(family, seed=11)
        whole = tmp_path_factory.mktemp(f"{family}-whole")
        sharded = tmp_path_factory.mktemp(f"{family}-sharded")
        model.save_pretrained(whole)
        model.save_pretrained(sharded, max_shard_size="20KB")
        out[family] = (str(whole), str(sharded), logits_of(model))
    return out


# name -> (use_layout's arguments, the run's config)
LAYOUTS = {
    "tp2": ({"tensor": 2}, {"parallel": {"tensor": {"size": 2, "mode": "1d"}}}),
    "tp2xdp2": ({"tensor": 2, "data": 2}, {"parallel": {"data": 2, "tensor": {"size": 2, "mode": "1d"}}}),
    "zero3-dp2": ({"data": 2}, {"parallel": {"data": 2}, "zero": {"stage": 3}}),
    "2d-tp4": ({"tensor": 4, "mode": "2d"}, {"parallel": {"tensor": {"size": 4, "mode": "2d"}}}),
    "pp2xtp2": (
        {"pipeline": 2, "tensor": 2},
        {"parallel": {"pipeline": {"size": 2, "schedule": "1f1b"}, "tensor": {"size": 2, "mode": "1d"}}},
    ),
    "pp2xtp2xdp2": (
        {"pipeline": 2, "tensor": 2, "data": 2},
        {
            "parallel": {
                "data": 2,
                "pipeline": {"size": 2, "schedule": "1f1b"},
                "tensor": {"size": 2, "mode": "1d"},
            }
        },
    ),
    "3d-tp8": ({"tensor": 8, "mode": "3d"}, {"parallel": {"tensor": {"size": 8, "mode": "3d"}}}),
}
WORLD = {"tp2": 2, "tp2xdp2": 4, "zero3-dp2": 2, "2d-tp4": 4, "pp2xtp2": 4, "pp2xtp2xdp2": 8, "3d-tp8": 8}


def load_body(folder: str, layout: str) -> tuple[torch.Tensor, bool, dict[str, torch.Tensor]]:
    """(logits, whether from_pretrained left the parameters unallocated, the full state). The
    engine evaluates: with pipeline stages it fetches every stage's weights and runs the whole
    model under no_grad."""
    dims, config = LAYOUTS[layout]
    use_layout(**dims, config=config)
    torch.manual_seed(123)  # not the folder's seed: the values must come from the folder
    model = tessera.hf.from_pretrained(folder, attn_implementation="eager")
    deferred = all(p.is_meta for p in model.parameters())
    engine, *_ = tessera.initialize(model, torch.optim.AdamW(model.parameters()), loss_of)
    return logits_of(engine), deferred, full_state_dict(engine)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_folder_loads_into_a_layout_with_the_logits_of_transformers(pools, folders, family, layout):
    whole, _, expected = folders[family]
    stored = load_file(Path(whole) / WEIGHTS)
    for logits, deferred, state in pools.run(WORLD[layout], load_body, whole, layout, timeout=300):
        assert deferred, "from_pretrained allocated parameters"
        torch.testing.assert_close(logits, expected, **FORWARD)
        for key, value in state.items():  # tied keys too: the head has the embedding's values
            assert torch.equal(value, stored.get(key, stored.get("transformer.wte.weight"))), key


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_sharded_folder_with_an_index_loads(pools, folders, family):
    _, sharded, expected = folders[family]
    sharded_index = Path(sharded) / INDEX
    assert sharded_index.is_file()
    assert len(set(json.loads(sharded_index.read_text())["weight_map"].values())) > 1
    for logits, _, _ in pools.run(2, load_body, sharded, "tp2", timeout=300):
        torch.testing.assert_close(logits, expected, **FORWARD)


def train_and_save_body(
    family: str, folder: str, out: str, shard_size: int | str, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Load into ``layout``, train a few steps (every rank the whole batch), save; the parallel
    model's logits after loading and after training."""
    dims, config = LAYOUTS[layout]
    use_layout(**dims, config=config)
    model = tessera.hf.from_pretrained(folder, attn_implementation="eager")
    engine, *_ = tessera.initialize(model, optimizer_of(model), loss_of)
    loaded = logits_of(engine)
    engine.train()
    for x, y in batches():
        engine.train_batch(iter([(x, y)]))
    tessera.hf.save_pretrained(engine, out, max_shard_size=shard_size)
    return loaded, logits_of(engine)


def optimizer_of(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)


def trained_in_one_process(folder: str) -> torch.Tensor:
    """Plain transformers: the folder's model after the same steps, its logits."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    model.train()
    optimizer = optimizer_of(model)
    for x, y in batches():
        optimizer.zero_grad()
        loss_of(model(x), y).backward()
        optimizer.step()
    return logits_of(model)


SAVES = {  # name -> (layout, max_shard_size)
    "tp2-one-file": ("tp2", "50GB"),
    "tp2-sharded": ("tp2", 30_000),
    "3d-tp8-sharded": ("3d-tp8", 30_000),
}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("save", list(SAVES))
def test_after_training_save_pretrained_writes_what_transformers_loads(pools, folders, tmp_path, family, save):
    whole, _, before = folders[family]
    layout, size = SAVES[save]
    out = tmp_path / "saved"
    results = pools.run(WORLD[layout], train_and_save_body, family, whole, str(out), size, layout, timeout=300)
    after = results[0][1]
    for loaded, trained in results:
        torch.testing.assert_close(loaded, before, **FORWARD)
        torch.testing.assert_close(trained, after)
    assert not torch.allclose(after, before, atol=1e-3), "training changed nothing"
    torch.testing.assert_close(after, trained_in_one_process(whole), **tolerance(blocks=2, steps=STEPS))
    sharded = size != "50GB"
    assert (out / INDEX).is_file() == sharded
    assert (out / WEIGHTS).is_file() == (not sharded)
    assert set(read_folder(out)) == set(read_folder(whole)), "not the keys transformers writes"
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    config = json.loads((out / "config.json").read_text())
    assert type(loaded).__name__ == config["architectures"][0] and loaded.dtype == torch.float32
    torch.testing.assert_close(logits_of(loaded), after, **FORWARD)
    if family == "gpt2":
        assert loaded.lm_head.weight is loaded.transformer.wte.weight


def mixed_precision_save_body(folder: str, out: str) -> dict[str, torch.Tensor] | None:
    """ZeRO-3 dp2 in bf16: the fp32 masters are saved (full_state_dict's values), not the
    bf16 parameters."""
    use_layout(data=2, config={"parallel": {"data": 2}, "zero": {"stage": 3}, "mixed_precision": {"dtype": "bf16"}})
    model = tessera.hf.from_pretrained(folder, attn_implementation="eager")
    engine, *_ = tessera.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_of)
    rank = torch.distributed.get_rank()
    x, y = batches()[0]
    engine.train_batch(iter([(x[rank::2], y[rank::2])]))
    assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}
    tessera.hf.save_pretrained(engine, out)
    state = full_state_dict(engine)
    return state if rank == 0 else None


def test_under_mixed_precision_the_fp32_masters_are_saved(pools, folders, tmp_path):
    out = tmp_path / "saved"
    state = pools.run(2, mixed_precision_save_body, folders["llama"][0], str(out), timeout=300)[0]
    saved = load_file(out / WEIGHTS)
    assert saved.keys() == state.keys()
    for key, value in state.items():
        assert saved[key].dtype == torch.float32 and torch.equal(saved[key], value), key
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


def failing_save_body(folder: str, out: str) -> str:
    dims, config = LAYOUTS["tp2"]
    use_layout(**dims, config=config)
    model = tessera.hf.from_pretrained(folder, attn_implementation="eager")
    engine, *_ = tessera.initialize(model, torch.optim.AdamW(model.parameters()), loss_of)
    try:
        tessera.hf.save_pretrained(engine, out)
    except CheckpointError as exc:
        return str(exc)
    return "no error"


def test_a_save_rank_0_cannot_write_fails_on_every_rank(pools, folders, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    for message in pools.run(2, failing_save_body, folders["gpt2"][0], str(blocked), timeout=300):
        assert message.startswith(f"rank 0 could not make {blocked}"), message


def test_a_plain_model_is_saved_as_transformers_saves_it(tmp_path):
    """One process, no layout: the same keys and values as transformers' own save."""
    model = build("gpt2", seed=4)
    tessera.hf.save_pretrained(model, tmp_path / "tessera", max_shard_size="20KB")
    model.save_pretrained(tmp_path / "transformers", max_shard_size="20KB")
    ours, theirs = read_folder(tmp_path / "tessera"), read_folder(tmp_path / "transformers")
    assert ours.keys() == theirs.keys()
    state = model.state_dict()
    for key, where in ours.items():
        assert torch.equal(load_file(tmp_path / "tessera" / where.file)[key], state[key]), key


def explicit_load_body(folder: str, how: str) -> torch.Tensor:
    """A model built normally (other values) under tp2, loaded at initialize (``init=``) or
    after it (``load_pretrained``)."""
    dims, config = LAYOUTS["tp2"]
    use_layout(**dims, config=config)
    model = build("llama", seed=99)
    init = tessera.hf.PretrainedWeights(folder, model) if how == "init" else "random"
    engine, *_ = tessera.initialize(model, torch.optim.AdamW(model.parameters()), loss_of, init=init)
    if how == "load_pretrained":
        tessera.hf.load_pretrained(engine, folder)
    return logits_of(engine.model)


@pytest.mark.parametrize("how", ["init", "load_pretrained"])
def test_a_model_built_normally_takes_a_folder_at_or_after_initialize(pools, folders, how):
    whole, _, expected = folders["llama"]
    for logits in pools.run(2, explicit_load_body, whole, how, timeout=300):
        torch.testing.assert_close(logits, expected, **FORWARD)


def load_after_evaluating_body(folder: str) -> tuple[torch.Tensor, torch.Tensor]:
    """pp2 x tp2: evaluated once (every stage's weights fetched), then loaded: evaluating again
    fetches the loaded weights of the other stage."""
    dims, config = LAYOUTS["pp2xtp2"]
    use_layout(**dims, config=config)
    model = build("llama", seed=99)
    engine, *_ = tessera.initialize(model, torch.optim.AdamW(model.parameters()), loss_of)
    before = logits_of(engine)
    tessera.hf.load_pretrained(engine, folder)
    return before, logits_of(engine)


def test_under_pipeline_stages_a_load_after_evaluating_is_what_the_next_evaluation_sees(pools, folders):
    whole, _, expected = folders["llama"]
    for before, after in pools.run(4, load_after_evaluating_body, whole, timeout=300):
        assert not torch.allclose(before, expected, atol=1e-3)
        torch.testing.assert_close(after, expected, **FORWARD)


def deferred_random_body(family: str, layout: str) -> dict[str, torch.Tensor] | None:
    """A deferred transformers model with no folder: under tensor parallelism the policy's
    blocks are recorded with the construction and made by its replay."""
    dims, config = {**LAYOUTS, "dp2": ({"data": 2}, {"parallel": {"data": 2}})}[layout]
    use_layout(**dims, config=config)
    with tessera.deferred_init():
        model = build(family, seed=11)
    engine, *_ = tessera.initialize(model, torch.optim.AdamW(model.parameters()), loss_of)
    state = full_state_dict(engine)
    return state if torch.distributed.get_rank() == 0 else None


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_deferred_transformers_model_is_split_as_its_construction_was_recorded(pools, family):
    whole = pools.run(2, deferred_random_body, family, "dp2", timeout=300)[0]
    split = pools.run(2, deferred_random_body, family, "tp2", timeout=300)[0]
    assert split.keys() == whole.keys()
    for key, value in whole.items():
        assert torch.equal(split[key], value), key
    plain = build(family, seed=11).state_dict()  # its own initialisation: N(0, 0.02) embeddings, ones, zeros
    for key, value in whole.items():  # the same distributions (transformers 5 skips it on meta tensors)
        expected = plain[key].float()
        assert abs(value.float().mean() - expected.mean()) <= 0.01, key
        assert abs(value.float().std() - expected.std()) <= 0.2 * expected.std() + 1e-6, key


# ---- folders that do not fit ---------------------------------------------------------------


def _rewrite(folder, change) -> None:
    path = folder / WEIGHTS
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_a_folder_that_does_not_fit_fails_naming_the_file_and_the_tensor(folders, tmp_path):
    import shutil

    whole = folders["llama"][0]
    cases = {
        "missing": lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
        "shape": lambda t: t.__setitem__("model.norm.weight", torch.ones(33)),
        "extra": lambda t: t.__setitem__("model.layers.0.mlp.extra.weight", torch.ones(2)),
    }
    messages = {}
    for case, change in cases.items():
        folder = tmp_path / case
        shutil.copytree(whole, folder)
        _rewrite(folder, change)
        with pytest.raises(CheckpointError) as error:
            tessera.hf.from_pretrained(folder)
        messages[case] = str(error.value)
    assert "has no values for LlamaForCausalLM's model.layers.1.mlp.up_proj.weight" in messages["missing"]
    assert re.search(r"model\.safetensors: model\.norm\.weight has shape \(33,\), .*\(32,\)", messages["shape"])
    assert "model.safetensors: model.layers.0.mlp.extra.weight" in messages["extra"]
    pickled = tmp_path / "pickled"
    shutil.copytree(whole, pickled)
    (pickled / WEIGHTS).rename(pickled / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pytorch_model.bin: tessera reads only safetensors"):
        tessera.hf.from_pretrained(pickled)


def test_a_head_model_loads_a_base_model_folder_and_tied_weights_stay_tied(folders, tmp_path):
    """GPT-2 folders from the hub hold the base model's keys (no ``transformer.`` prefix) and
    one of the tied pair; the keys are matched as transformers matches them."""
    whole = folders["gpt2"][0]
    base = transformers.GPT2Model.from_pretrained(whole)
    base.save_pretrained(tmp_path / "base")
    model = tessera.hf.from_pretrained(tmp_path / "base", "GPT2LMHeadModel")
    assert model.lm_head.weight is model.transformer.wte.weight
    where = tessera.init.recording_of(model.parameters()).values.where
    assert where["transformer.wte.weight"].key == where["lm_head.weight"].key == "wte.weight"


# ---- memory --------------------------------------------------------------------------------

# a GPT-2 of about 49M parameters (195 MB in fp32): a rank's share of it (a half under tp2, a
# quarter under 2d tp4 and pp2 x tp2 x dp2) plus its largest tensor is well under the whole
BIG = dict(vocab_size=8192, n_positions=64, n_embd=768, n_layer=6, n_head=12)
# layout -> the ranks over which the model's tensors are split (tensor x pipeline)
MEMORY_LAYOUTS = {"tp2": 2, "2d-tp4": 4, "pp2xtp2xdp2": 4}


@pytest.fixture(scope="module")
def big_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2-big")
    model = build("gpt2", seed=1, **BIG)
    model.save_pretrained(folder)
    sizes = [p.numel() * 4 for p in model.parameters()]
    tiny = tmp_path_factory.mktemp("gpt2-tiny")
    build("gpt2", seed=1).save_pretrained(tiny)
    return str(folder), str(tiny), sum(sizes), max(sizes)


def memory_body(folder: str, tiny: str, whole: bool, layout: str) -> tuple[int, int, int]:
    """(baseline RSS, peak RSS while the folder loads into ``layout``, bytes of model state the
    rank then holds: its blocks, pieces or stage, and buffers)."""
    dims, config = LAYOUTS[layout]
    use_layout(**dims, config=config)

    def load(path: str):
        if whole:  # every rank loads the whole model with transformers, then keeps its blocks
            model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
        else:
            model = tessera.hf.from_pretrained(path, attn_implementation="eager")
        return tessera.initialize(model, torch.optim.AdamW(model.parameters()), loss_of)[0]

    load(tiny)  # imports and one-time set-up first
    trim_heap()
    assert reset_peak_rss(), "the peak RSS could not be reset (/proc/self/clear_refs)"
    base = peak_rss_bytes()
    engine = load(folder)
    peak = peak_rss_bytes()
    assert base is not None and peak is not None
    buffers = sum(b.numel() * b.element_size() for b in engine.module.buffers() if not b.is_meta)
    held = model_state_bytes(engine.module, engine.optimizer)["total"] + buffers
    del engine
    return base, peak, held


def _over(base: int, peak: int, held: int, largest: int) -> float:
    """How far ``peak`` is above the bound: the baseline, the rank's share and one tensor, +15%."""
    return peak - (base + held + largest) * 1.15


@pytest.mark.parametrize("layout", list(MEMORY_LAYOUTS))
def test_loading_keeps_each_rank_within_its_share_plus_one_tensor(pools, big_folder, layout):
    folder, tiny, total, largest = big_folder
    split = MEMORY_LAYOUTS[layout]
    results = pools.run(WORLD[layout], memory_body, folder, tiny, False, layout, timeout=600)
    mib = [
        tuple(round(n / 2**20) for n in (base, peak, held, _over(base, peak, held, largest)))
        for base, peak, held in results
    ]
    line = f"hf load {layout}: per rank (baseline, peak, held, over the bound) MiB {mib}; whole model {total / 2**20:.0f} MiB"
    print(line)
    REPORT.append(line)
    for rank, (base, peak, held) in enumerate(results):
        # the share: the rank's blocks (a pipeline stage's tied embedding block on both ends)
        assert held <= total / split + largest, f"rank {rank} holds {held / 2**20:.0f} MiB"
        over = _over(base, peak, held, largest)
        assert over <= 0, f"rank {rank}: peak {peak / 2**20:.0f} MiB, {over / 2**20:.0f} MiB over the bound"
    if layout != "tp2":
        return
    whole = pools.run(WORLD[layout], memory_body, folder, tiny, True, layout, timeout=600)
    line = f"hf load {layout}, whole with transformers: over the bound MiB {[round(_over(*r, largest) / 2**20) for r in whole]}"
    print(line)
    REPORT.append(line)
    assert max(_over(*r, largest) for r in whole) > total / 8, "a whole load exceeds the bound by far"
