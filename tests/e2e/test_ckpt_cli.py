"""``tessera ckpt inspect`` and ``tessera ckpt consolidate`` run as a user runs them: their
output and exit status (0 complete, 1 incomplete, 2 not a checkpoint)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tessera.checkpoint import full_state_dict, save
from tests.e2e.test_cli import run, tessera_cmd
from tests.unit.test_checkpoint_safety import engine_for


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    engine = engine_for()
    path = tmp_path_factory.mktemp("ckpt") / "step-00000002"
    save(path, engine)
    return path, full_state_dict(engine.module)


def test_inspect_prints_the_summary_and_exits_0_when_complete(saved):
    path, _ = saved
    out = run([*tessera_cmd(), "ckpt", "inspect", str(path)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "world size 1: data 1, pipeline 1, sequence 1, tensor 1; strategy ddp" in out.stdout
    assert "model       28 tensors, 112,128 bytes" in out.stdout
    assert "tied        lm_head.weight = tok_emb.weight" in out.stdout
    assert "rank00000.safetensors" in out.stdout and "the 20 largest of 113" in out.stdout
    assert out.stdout.rstrip().endswith("complete    yes: every tensor is covered and every file is whole")
    out = run([*tessera_cmd(), "ckpt", "inspect", "--json", str(path)])
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["step"] == 2 and info["complete"] and len(info["tensors"]) == 113


def test_inspect_exits_1_naming_what_is_missing_and_2_for_a_bad_path(saved, tmp_path):
    path = tmp_path / "broken"
    shutil.copytree(saved[0], path)
    index = json.loads((path / "index.json").read_text())
    del index["tensors"]["model/ln_f.weight"]["pieces"][0]
    (path / "index.json").write_text(json.dumps(index))
    out = run([*tessera_cmd(), "ckpt", "inspect", "--all", str(path)])
    assert out.returncode == 1, out.stdout + out.stderr
    assert "complete    NO: 1 problem(s)\n  model/ln_f.weight: 32 of 32 elements are in no piece" in out.stdout
    out = run([*tessera_cmd(), "ckpt", "inspect", str(tmp_path / "nope")])
    assert out.returncode == 2 and out.stdout == ""
    assert (
        out.stderr.strip() == f"tessera ckpt: error: checkpoint {tmp_path / 'nope'} does not exist (or is not a folder)"
    )


def test_consolidate_writes_a_file_that_loads_as_the_full_state(saved, tmp_path):
    path, expected = saved
    target = tmp_path / "model.safetensors"
    out = run([*tessera_cmd(), "ckpt", "consolidate", str(path), str(target)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"wrote {target}: 29 model tensors" in out.stderr
    state = load_file(str(target))
    assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in expected)
    out = run([*tessera_cmd(), "ckpt", "consolidate", str(tmp_path / "nope"), str(target)])
    assert out.returncode == 2 and "does not exist" in out.stderr
