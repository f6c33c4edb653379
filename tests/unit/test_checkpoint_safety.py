"""Sharded checkpoints are safe: a save killed part-way leaves the previous checkpoint complete
and nothing that ``latest`` would pick; damaged pieces and checkpoints of another model fail to
load naming the file, the tensor or the keys; loading never unpickles."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import tessera
from tessera.checkpoint import CheckpointError, full_state_dict, is_complete, latest, load, save, step_folder
from tessera.models import NextTokenLoss, gpt
from tessera.testing import use_layout

ROOT = Path(__file__).resolve().parents[2]


def engine_for(d_model: int = 32, n_layers: int = 2, zero: int = 0):
    use_layout(config={"zero": {"stage": zero, "chunk_mb": 0.016}} if zero else {})
    torch.manual_seed(0)
    model = gpt("tiny", vocab_size=64, max_seq_len=16, d_model=d_model, n_layers=n_layers, n_heads=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 64, (32, 17), generator=torch.Generator().manual_seed(3))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4, shuffle=True)
    engine, loader, _, _ = tessera.initialize(model, optimizer, NextTokenLoss(), loader)
    it = iter(loader)
    for _ in range(2):
        engine.train_batch(it)
    return engine


def test_a_checkpoint_loads_back_with_the_same_weights(tmp_path):
    engine = engine_for()
    save(tmp_path / "a", engine)
    other = engine_for()
    for p in other.module.parameters():
        p.data.zero_()
    assert load(tmp_path / "a", other) == 2
    expected, got = full_state_dict(engine.module), full_state_dict(other.module)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    index = json.loads((tmp_path / "a" / "index.json").read_text())  # what wrote it
    assert index["layout"]["world_size"] == 1 and index["strategy"] == "ddp" and index["step"] == 2
    assert index["config"]["parallel"]["tensor"]["size"] == 1 and "optimizer" in index["config"]


SAVER = textwrap.dedent(
    """
    import sys, torch, tessera
    sys.path.insert(0, {root!r})
    from tests.unit.test_checkpoint_safety import engine_for
    from tessera.checkpoint import save, step_folder
    engine = engine_for(d_model=256, n_layers=4)
    step = 0
    while True:
        step += 1
        save(step_folder({folder!r}, step), engine)
        print(step, flush=True)
    """
)


def test_a_save_killed_midway_leaves_the_last_checkpoint_whole(tmp_path):
    folder = tmp_path / "ckpts"
    script = tmp_path / "saver.py"
    script.write_text(SAVER.format(root=str(ROOT), folder=str(folder)))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "1"  # one complete checkpoint exists
        deadline = time.monotonic() + 120
        killed_during = None
        while time.monotonic() < deadline:  # kill while a save has written part of its folder
            partials = [p for p in folder.glob(".step-*.partial") if any(p.iterdir())]
            if partials:
                proc.send_signal(signal.SIGKILL)
                killed_during = partials[0]
                break
            time.sleep(0.001)
        assert killed_during is not None, "never caught a save in the middle"
    finally:
        proc.kill()
        proc.wait()
    step = int(killed_during.name.split("-")[1].split(".")[0])
    newest = latest(folder)
    assert newest is not None and newest == step_folder(folder, step - 1)
    assert not is_complete(step_folder(folder, step))  # the killed save left no checkpoint
    # the newest complete checkpoint loads; the partial folder is never picked
    assert load(newest, engine_for(d_model=256, n_layers=4)) == 2
    # the next save of that step clears the leftover and completes
    engine = engine_for(d_model=256, n_layers=4)
    save(step_folder(folder, step), engine)
    assert latest(folder) == step_folder(folder, step)
    assert not killed_during.exists()


def _a_piece(folder: Path, name: str) -> tuple[Path, str, dict]:
    index = json.loads((folder / "index.json").read_text())
    piece = index["tensors"][name]["pieces"][0]
    return folder / piece["file"], piece["key"], piece


def test_a_corrupted_piece_fails_naming_the_file_and_the_tensor(tmp_path):
    engine = engine_for()
    save(tmp_path / "c", engine)
    path, key, _ = _a_piece(tmp_path / "c", "model/blocks.0.mlp.fc.weight")
    data = bytearray(path.read_bytes())
    header = int.from_bytes(data[:8], "little")
    offsets = json.loads(data[8 : 8 + header])[key]["data_offsets"]
    data[8 + header + offsets[0] + 5] ^= 0xFF  # one flipped byte inside that piece
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank00000\.safetensors.*blocks\.0\.mlp\.fc\.weight.*corrupted"):
        load(tmp_path / "c", engine_for())


def test_a_truncated_file_fails_naming_it(tmp_path):
    engine = engine_for()
    save(tmp_path / "t", engine)
    path, _, _ = _a_piece(tmp_path / "t", "model/tok_emb.weight")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"rank00000\.safetensors.*(truncated|cannot read)"):
        load(tmp_path / "t", engine_for())


def test_a_checkpoint_of_another_model_fails_naming_keys_and_shapes(tmp_path):
    save(tmp_path / "m", engine_for())
    with pytest.raises(CheckpointError, match=r"missing \[blocks\.2\..*unexpected none"):
        load(tmp_path / "m", engine_for(n_layers=3))
    with pytest.raises(
        CheckpointError, match=r"shapes differ: .*tok_emb\.weight: checkpoint \(64, 32\), model \(64, 48\)"
    ):
        load(tmp_path / "m", engine_for(d_model=48))


def test_an_incomplete_folder_is_not_a_checkpoint(tmp_path):
    save(tmp_path / "i", engine_for())
    (tmp_path / "i" / "index.json").unlink()
    with pytest.raises(CheckpointError, match="index.*does not exist"):
        load(tmp_path / "i", engine_for())


def test_loading_never_unpickles(tmp_path, monkeypatch):
    engine = engine_for(zero=2)
    save(tmp_path / "p", engine)

    def refuse(*args, **kwargs):
        raise AssertionError("loading a checkpoint unpickled something")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    assert load(tmp_path / "p", engine_for(zero=2)) == 2
    with pytest.raises(AssertionError, match="unpickled"):  # the guard works
        pickle.loads(pickle.dumps(1))
