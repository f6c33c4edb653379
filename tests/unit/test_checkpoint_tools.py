"""Checkpoint tools in one process: ``inspect`` reports the layout, the contents and the files
of a checkpoint and finds what is missing; ``consolidate`` writes one safetensors file equal,
bit for bit, to ``full_state_dict`` of the engine that saved it, one tensor at a time."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tessera.checkpoint import CheckpointError, full_state_dict, save, tools
from tessera.models import gpt
from tests.unit.test_checkpoint_safety import engine_for


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A single-process DDP checkpoint and the engine that wrote it."""
    engine = engine_for()
    path = tmp_path_factory.mktemp("tools") / "step-00000002"
    save(path, engine)
    return path, engine


def copy_of(folder: Path, tmp_path: Path) -> Path:
    out = tmp_path / folder.name
    out.mkdir()
    for f in folder.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out


def test_inspect_reports_layout_contents_and_files(saved):
    path, engine = saved
    info = tools.inspect(path)
    assert info["step"] == 2 and info["complete"] and info["problems"] == []
    assert info["layout"] == {
        "world_size": 1,
        "sizes": {"data": 1, "pipeline": 1, "sequence": 1, "tensor": 1},
        "tensor_mode": "1d",
        "tensor_depth": 1,
        "strategy": "ddp",
    }
    assert info["aliases"] == {"lm_head.weight": "tok_emb.weight"}
    state = {k: v for k, v in full_state_dict(engine.module).items() if k != "lm_head.weight"}
    params = list(engine.module.parameters())  # tied: each once
    assert info["groups"]["model"] == {"count": len(state), "bytes": sum(v.numel() * 4 for v in state.values())}
    # AdamW: step (a scalar) plus two moments shaped like the parameter
    assert info["groups"]["optimizer"] == {"count": 3 * len(params), "bytes": sum(4 + 8 * p.numel() for p in params)}
    assert info["groups"]["rng"]["count"] >= 1
    files = {f["name"]: f for f in info["files"]}
    assert set(files) == {"index.json", "rank00000.json", "rank00000.safetensors"}
    for name, f in files.items():
        assert f["bytes"] == (path / name).stat().st_size
    assert files["rank00000.safetensors"]["expected_bytes"] == files["rank00000.safetensors"]["bytes"]
    assert info["total_file_bytes"] == sum(f["bytes"] for f in files.values())
    rows = {r["name"]: r for r in info["tensors"]}
    assert rows["model/blocks.0.mlp.fc.weight"] == {
        "name": "model/blocks.0.mlp.fc.weight",
        "group": "model",
        "shape": [128, 32],
        "dtype": "F32",
        "pieces": 1,
        "bytes": 128 * 32 * 4,
        "stored_bytes": 128 * 32 * 4,
        "missing_elements": 0,
    }
    assert [r["bytes"] for r in info["tensors"]] == sorted((r["bytes"] for r in info["tensors"]), reverse=True)
    assert json.loads(json.dumps(info)) == info  # plain JSON data


def test_the_text_shows_a_summary_and_the_largest_tensors(saved):
    info = tools.inspect(saved[0])
    text = tools.format_inspection(info)
    assert "step        2" in text
    assert "world size 1: data 1, pipeline 1, sequence 1, tensor 1; strategy ddp" in text
    assert "the 20 largest of 113 (--all: every one)" in text
    assert "model/blocks.0.mlp.fc.weight" in text and "128x32" in text and "16,384" in text
    assert text.endswith("complete    yes: every tensor is covered and every file is whole")
    listed = [line for line in text.splitlines() if line.startswith(("  model/", "  optim/", "  rng/"))]
    assert len(listed) == 20
    every = tools.format_inspection(info, all_tensors=True)
    assert len([line for line in every.splitlines() if line.startswith(("  model/", "  optim/", "  rng/"))]) == 113


def test_a_missing_file_makes_it_incomplete(saved, tmp_path):
    path = copy_of(saved[0], tmp_path)
    (path / "rank00000.safetensors").unlink()
    info = tools.inspect(path)
    assert not info["complete"]
    assert any(
        p.startswith("rank00000.safetensors is missing (it holds pieces of 113 tensors") for p in info["problems"]
    )
    assert "complete    NO: 1 problem(s)" in tools.format_inspection(info)


def test_a_piece_dropped_from_the_index_makes_it_incomplete(saved, tmp_path):
    path = copy_of(saved[0], tmp_path)
    index = json.loads((path / "index.json").read_text())
    index["tensors"]["model/blocks.1.attn.qkv.weight"]["pieces"] = []
    (path / "index.json").write_text(json.dumps(index))
    info = tools.inspect(path)
    assert info["problems"] == ["model/blocks.1.attn.qkv.weight: 3,072 of 3,072 elements are in no piece"]
    with pytest.raises(CheckpointError, match=r"blocks\.1\.attn\.qkv\.weight.*lacks 3072"):
        tools.consolidate(path, tmp_path / "out.safetensors")
    assert list(tmp_path.glob("*.safetensors")) == []  # nothing half-written left behind


def test_a_truncated_file_or_a_lost_piece_is_found_from_the_header(saved, tmp_path):
    path = copy_of(saved[0], tmp_path)
    file = path / "rank00000.safetensors"
    size = file.stat().st_size
    file.write_bytes(file.read_bytes()[: size - 100])
    (problem,) = tools.inspect(path)["problems"]
    assert problem == f"rank00000.safetensors has {size - 100:,} bytes, its header says {size:,} (truncated?)"
    index = json.loads((path / "index.json").read_text())
    index["tensors"]["model/ln_f.bias"]["pieces"][0]["key"] = "model/ln_f.bias@9.9"
    (path / "index.json").write_text(json.dumps(index))
    assert (
        "rank00000.safetensors lacks the piece 'model/ln_f.bias@9.9' of model/ln_f.bias"
        in tools.inspect(path)["problems"]
    )


def test_not_a_checkpoint_fails_saying_what_it_is(saved, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        tools.inspect(tmp_path / "nothing")
    with pytest.raises(CheckpointError, match=r"is not a checkpoint but holds 1: step-00000002"):
        tools.inspect(saved[0].parent)
    (tmp_path / "partial").mkdir()
    with pytest.raises(CheckpointError, match="has no index.json"):
        tools.inspect(tmp_path / "partial")


def assert_bitwise(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        assert torch.equal(got[key].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), key


def test_consolidate_equals_full_state_dict_and_loads_into_one_process(saved, tmp_path):
    path, engine = saved
    out = tmp_path / "sub" / "full.safetensors"
    done = tools.consolidate(path, out)
    assert done == {"path": str(out), "tensors": 29, "bytes": out.stat().st_size}
    state = load_file(str(out))
    assert_bitwise(state, full_state_dict(engine.module))
    torch.manual_seed(1)
    model = gpt("tiny", vocab_size=64, max_seq_len=16, d_model=32, n_layers=2, n_heads=4)
    model.load_state_dict(state)  # strict: every key, no other
    assert torch.equal(model.lm_head.weight, state["tok_emb.weight"])


def test_consolidate_with_the_optimizer_states(saved, tmp_path):
    path, engine = saved
    out = tmp_path / "full.safetensors"
    tools.consolidate(path, out, optimizer=True)
    state = load_file(str(out))
    optimizer = engine.strategy.optimizer
    names = {id(p): k for k, p in engine.module.named_parameters()}
    expected = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state[p].items():
                expected[f"optim/{names[id(p)]}/{key}"] = value
    assert_bitwise({k: v for k, v in state.items() if k.startswith("optim/")}, expected)
    assert_bitwise({k: v for k, v in state.items() if not k.startswith("optim/")}, full_state_dict(engine.module))


def test_consolidate_of_zero3_pieces_holds_one_tensor_at_a_time(tmp_path, monkeypatch):
    engine = engine_for(zero=3)
    save(tmp_path / "z3", engine)
    assert tools.inspect(tmp_path / "z3")["layout"]["strategy"] == "zero3"
    live: list[weakref.ref] = []
    real_fill = tools.fill

    def fill(reader, name, entry, target, view):
        # freed by reference counting as soon as it is written (no garbage collection needed)
        assert all(ref() is None for ref in live), "an earlier tensor is still alive"
        live.append(weakref.ref(target))
        real_fill(reader, name, entry, target, view)

    monkeypatch.setattr(tools, "fill", fill)
    tools.consolidate(tmp_path / "z3", tmp_path / "z3.safetensors", optimizer=True)
    assert len(live) == 28 + 3 * 28  # every model tensor, every optimizer state, once
    assert_bitwise(
        {k: v for k, v in load_file(str(tmp_path / "z3.safetensors")).items() if not k.startswith("optim/")},
        full_state_dict(engine.module),
    )
