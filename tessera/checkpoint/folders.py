"""Checkpoint folders: ``step-NNNNNNNN`` under a run's checkpoint directory; a folder is a
complete checkpoint once its ``index.json`` exists (written last, see
``tessera.checkpoint.sharded``), so an interrupted save is never picked."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from tessera.checkpoint.format import INDEX


def is_complete(path: str | Path) -> bool:
    """Whether ``path`` is a finished checkpoint folder (it has its index)."""
    return (Path(path) / INDEX).is_file()


def step_folder(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}"


def complete_checkpoints(directory: str | Path) -> list[Path]:
    """The complete checkpoints under ``directory`` (``step-*`` folders with an index), oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: p.name)


def latest(directory: str | Path) -> Path | None:
    """The newest complete checkpoint under ``directory``, or None."""
    found = complete_checkpoints(directory)
    return found[-1] if found else None


def prune(directory: str | Path, keep_last: int, *, keep: Callable[[Path], bool] = lambda p: False) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints under ``directory``."""
    found = complete_checkpoints(directory)
    doomed = [p for p in found[: max(0, len(found) - keep_last)] if not keep(p)]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed
