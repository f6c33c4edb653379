"""Files tessera writes get the user's umask (0644 under 022, not mkstemp's 0600) and replace
the old file atomically: a write that fails midway leaves the old file and no temporary file."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import tessera.checkpoint.full as full
import tessera.files as files
from tessera.bench.report import Row, write_rows
from tessera.checkpoint import load_weights, save_weights
from tessera.config import load_config
from tessera.engine import CheckpointHook, LogHook
from tessera.files import atomic_path, current_umask, write_atomically
from tessera.parallel.data import DataParallel
from tessera.testing import use_layout
from tessera.train import plot_losses, write_run_config


@pytest.fixture
def umask() -> Iterator[Callable[[int], int]]:
    """``umask(m)`` sets the process umask for the test; the old one comes back after it."""
    old = os.umask(0o022)
    try:
        yield os.umask
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def fake_trainer(module: nn.Module, step: int, metrics: dict) -> SimpleNamespace:
    # the weights hook reads the engine's strategy (full_state_dict(engine)): a one-rank DDP one
    strategy = DataParallel(module, torch.optim.SGD(module.parameters(), lr=0.1), use_layout())
    engine = SimpleNamespace(module=module, strategy=strategy, ctx=SimpleNamespace(rank=0))
    return SimpleNamespace(engine=engine, step=step, metrics=metrics)


def test_current_umask_reads_the_process_umask(umask):
    for mask in (0o022, 0o027, 0o002, 0o077):
        umask(mask)
        assert current_umask() == mask


def test_current_umask_without_proc_falls_back_and_leaves_the_umask_as_it_was(umask, monkeypatch, tmp_path):
    monkeypatch.setattr(files, "PROC_STATUS", tmp_path / "absent")
    umask(0o027)
    assert current_umask() == 0o027
    assert os.umask(0o027) == 0o027, "the fallback restored the umask"


def test_every_run_file_is_0644_under_umask_022(umask, tmp_path):
    umask(0o022)
    model = nn.Linear(3, 2)
    written = [
        write_atomically(tmp_path / "a.txt", "text"),
        save_weights(model.state_dict(), tmp_path / "weights" / "model.safetensors"),
    ]
    plot_losses([{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5, "eval_loss": 1.6}], tmp_path / "loss.png")
    write_run_config(load_config(None), 2, tmp_path / "config.json")
    write_rows([Row("dp2", "step_time_s", 1.0, "ddp", 1.0)], tmp_path / "bench.json")
    log = LogHook(every=1, jsonl=tmp_path / "metrics.jsonl", printer=lambda line: None)
    checkpoints = CheckpointHook(tmp_path / "ckpt", every=1)
    trainer = fake_trainer(model, 1, {"step": 1, "loss": 1.0})
    log.before_fit(trainer)
    log.after_step(trainer)
    checkpoints.after_step(trainer)
    checkpoints.after_fit(trainer)
    written += [tmp_path / n for n in ("loss.png", "config.json", "bench.json", "metrics.jsonl")]
    written += [tmp_path / "ckpt" / "step_1" / "model.safetensors", tmp_path / "ckpt" / "model.safetensors"]
    assert {str(p.relative_to(tmp_path)): oct(mode(p)) for p in written} == {
        str(p.relative_to(tmp_path)): "0o644" for p in written
    }
    assert json.loads((tmp_path / "config.json").read_text())["world_size"] == 2
    assert load_weights(tmp_path / "ckpt" / "model.safetensors").keys() == model.state_dict().keys()
    assert not [p for p in tmp_path.rglob(".*")], "no temporary file left"


@pytest.mark.parametrize("mask, expected", [(0o027, 0o640), (0o002, 0o664), (0o077, 0o600)], ids=["027", "002", "077"])
def test_the_mode_follows_the_umask(umask, tmp_path, mask, expected):
    umask(mask)
    assert mode(write_atomically(tmp_path / "a.json", "{}")) == expected
    assert mode(save_weights({"w": torch.ones(2)}, tmp_path / "w.safetensors")) == expected


def test_replacing_a_file_gives_the_umask_mode_not_the_old_files(umask, tmp_path):
    target = tmp_path / "config.json"
    target.write_text("old")
    target.chmod(0o600)
    umask(0o022)
    write_atomically(target, "new")
    assert target.read_text() == "new" and mode(target) == 0o644


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_write_that_fails_midway_keeps_the_old_file_and_leaves_no_temporary(tmp_path, error):
    target = tmp_path / "config.json"
    target.write_text("old contents")
    with pytest.raises(error), atomic_path(target) as tmp:
        tmp.write_text("half of the new")
        raise error("disk full")
    assert target.read_text() == "old contents"
    assert listing(tmp_path) == ["config.json"]


def test_a_failed_first_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "model.safetensors") as tmp:
        tmp.write_bytes(b"\0" * 10)
        raise RuntimeError("killed")
    assert listing(tmp_path) == []


def test_save_weights_that_fails_midway_keeps_the_old_weights(tmp_path, monkeypatch):
    target = save_weights({"w": torch.ones(4)}, tmp_path / "model.safetensors")

    def half_then_fail(tensors: dict, filename: str) -> None:
        Path(filename).write_bytes(b"partial safetensors header")
        raise OSError("No space left on device")

    monkeypatch.setattr(full, "save_file", half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        save_weights({"w": torch.zeros(4)}, target)
    assert torch.equal(load_weights(target)["w"], torch.ones(4))
    assert listing(tmp_path) == ["model.safetensors"]


def test_the_temporary_file_keeps_the_suffix_and_is_hidden(tmp_path):
    with atomic_path(tmp_path / "loss.png") as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".loss.") and tmp.suffix == ".png"
        tmp.write_bytes(b"png")
    assert listing(tmp_path) == ["loss.png"]
