"""An engine's end: ``Engine.close()`` closes its strategy once (also as a context manager);
``Trainer.fit`` closes it at its end and when training raises, and ``tessera.shutdown()``
closes every engine still open (through ``close_open_engines``). Under Gemini with a disk tier,
the offload folder holds files while training runs and none after, however it ended."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tessera
from tessera.engine import Hook, Trainer
from tessera.engine.lifecycle import close_open_engines, open_engines
from tessera.models import NextTokenLoss, gpt
from tessera.testing import use_layout

SEQ = 16
# chunks through the device, host and disk tiers (as in tests/dist/test_gemini.py)
GEMINI = {"placement": "auto", "device_budget": 450_000, "host_budget": 60_000, "chunk_mb": 0.02}


class FailsAt(nn.Module):
    """The model, raising in its training forward number ``fails_at`` (counting from 1)."""

    def __init__(self, model: nn.Module, fails_at: int | None) -> None:
        super().__init__()
        self.model = model
        self.fails_at = fails_at
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == self.fails_at:
                raise RuntimeError(f"the model failed in forward {self.calls}")
        return self.model(x)


class FilesSeen(Hook):
    """After each step: how many files this rank's disk tier holds."""

    def __init__(self, offload: str) -> None:
        self.offload = Path(offload)
        self.counts: list[int] = []

    def after_step(self, trainer) -> None:
        self.counts.append(len(files_of_this_process(self.offload)))


def files_of_this_process(offload: Path) -> list[Path]:
    return [p for p in offload.glob(f"rank*-{os.getpid()}/**/*") if p.is_file()]


def gemini_engine(offload: str, fails_at: int | None = None):
    use_layout(config={"gemini": {"offload_dir": offload, **GEMINI}})
    torch.manual_seed(0)
    model = FailsAt(gpt("tiny", vocab_size=64, max_seq_len=SEQ, d_model=32, n_layers=2, n_heads=4), fails_at)
    tokens = torch.randint(0, 64, (32, SEQ + 1), generator=torch.Generator().manual_seed(7))
    data = DataLoader(TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()), batch_size=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, loader, _, _ = tessera.initialize(model, optimizer, NextTokenLoss(), data)
    return engine, loader


def fit(offload: str, fails_at: int | None):
    """Trainer.fit over 3 steps (failing in forward ``fails_at``): the error, the files seen
    after each step, those left after fit, and whether the engine is closed and forgotten."""
    engine, loader = gemini_engine(offload, fails_at)
    seen = FilesSeen(offload)
    error = None
    try:
        Trainer(engine, [seen]).fit(loader, steps=3)
    except RuntimeError as exc:
        error = str(exc)
    return error, seen.counts, len(files_of_this_process(Path(offload))), engine.closed, engine in open_engines()


def test_fit_removes_the_offload_files_at_its_end_and_when_training_raises(pools, tmp_path):
    for rank, (error, seen, left, closed, still_open) in enumerate(pools.run(2, fit, str(tmp_path), None)):
        assert error is None
        assert len(seen) == 3 and min(seen) > 0, f"rank {rank}: the disk tier held files while training ran"
        assert left == 0 and closed and not still_open
    assert list(tmp_path.iterdir()) == []
    for rank, (error, seen, left, closed, _) in enumerate(pools.run(2, fit, str(tmp_path), 2)):
        assert error == "the model failed in forward 2"
        assert seen and min(seen) > 0, f"rank {rank}: the disk tier held files when training raised"
        assert left == 0 and closed
    assert list(tmp_path.iterdir()) == []


def closes(offload: str):
    """Engine.close once, as a context manager, and through close_open_engines (shutdown's)."""
    engine, loader = gemini_engine(offload)
    calls = []
    close = engine.strategy.close
    engine.strategy.close = lambda: calls.append("close") or close()  # type: ignore[method-assign]
    engine.train_batch(iter(loader))
    had_files = len(files_of_this_process(Path(offload)))
    with engine:
        pass
    engine.close()
    once = (calls, engine.closed, len(files_of_this_process(Path(offload))))
    opened = [gemini_engine(offload)[0] for _ in range(2)]
    for engine in opened:
        engine.train_batch(iter(loader))
    assert all(engine in open_engines() for engine in opened)
    close_open_engines()
    return had_files, once, [engine.closed for engine in opened], len(files_of_this_process(Path(offload)))


def test_an_engine_closes_once_and_shutdown_closes_every_open_one(pools, tmp_path):
    for had_files, once, closed, left in pools.run(2, closes, str(tmp_path)):
        assert had_files > 0
        assert once == (["close"], True, 0), "the strategy is closed once; its files are gone"
        assert closed == [True, True] and left == 0
    assert list(tmp_path.iterdir()) == []
