"""A byte-level text corpus that needs no download: the Python standard library's own source.

Every Python install carries megabytes of well-formed, varied text in its ``.py`` files. Read as
bytes (vocabulary 256) it is enough to train the tiny and small GPT presets and watch the loss fall.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import Dataset

# Below this many bytes the stdlib is taken to ship only bytecode, and the fallback is used.
MIN_STDLIB_BYTES = 256 * 2**10
_STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})
_FALLBACK_SKIP = frozenset({"site-packages", "build", "dist", "runs", "venv", "node_modules", "__pycache__"})


def _stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _sorted_files(root: Path, suffixes: tuple[str, ...], skip: frozenset[str]) -> list[Path]:
    """Files under ``root`` with one of ``suffixes``, outside skipped or hidden folders, in path order."""
    found = []
    for folder, subfolders, names in os.walk(root):
        # Prune in place so that skipped trees (site-packages can be large) are never walked.
        subfolders[:] = [d for d in subfolders if not (d in skip or d.startswith(".") or d.endswith(".egg-info"))]
        found += [Path(folder, name) for name in names if name.endswith(suffixes)]
    # Sort on path components, not strings, so that a folder's files stay together.
    return sorted(found, key=lambda p: p.relative_to(root).parts)


def _concatenate(files: list[Path], max_bytes: int) -> bytes:
    """The files' bytes joined by b"\\n", read only until ``max_bytes`` are in hand, then truncated."""
    chunks: list[bytes] = []
    total = 0
    for path in files:
        if total >= max_bytes:
            break
        chunk = path.read_bytes() if not chunks else b"\n" + path.read_bytes()
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)[:max_bytes]


def _fallback_files() -> list[Path]:
    """The tessera package's ``.py`` and ``.md`` files, with the repository's when run from a checkout."""
    package = Path(__file__).resolve().parents[1]
    root = package.parent if (package.parent / "pyproject.toml").is_file() else package
    return _sorted_files(root, (".py", ".md"), _FALLBACK_SKIP)


def load_byte_corpus(max_bytes: int = 4 * 2**20) -> torch.Tensor:
    """The standard library's ``.py`` sources as one uint8 tensor [min(max_bytes, available)].

    Files under ``sysconfig.get_paths()["stdlib"]``, skipping ``site-packages``, ``test``/``tests``,
    ``idlelib`` and ``lib2to3``, are read in sorted path order, joined with b"\\n" and truncated to
    ``max_bytes``. The result is deterministic for a given Python install (it changes with the
    Python version). If the stdlib gives fewer than 256 KiB (some installs ship only ``.pyc``), the
    ``.py`` and ``.md`` files of the tessera package (and of its repository, in a checkout) are used
    instead, which may give fewer bytes than asked for. Nothing is cached on disk.
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes={max_bytes} must be at least 1")
    data = _concatenate(_sorted_files(_stdlib_dir(), (".py",), _STDLIB_SKIP), max_bytes)
    if len(data) < min(max_bytes, MIN_STDLIB_BYTES):
        data = _concatenate(_fallback_files(), max_bytes)
    if not data:
        raise RuntimeError("found no .py sources in the standard library nor in the tessera package")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class ByteSequences(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping next-token windows over a 1-D token tensor.

    Item ``i`` is ``(x, y)``, both int64 [seq_len]: ``x = tokens[i*seq_len : (i+1)*seq_len]`` and
    ``y`` the same window shifted one token on. There are ``(len(tokens) - 1) // seq_len`` items.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise ValueError(f"tokens must have an integer dtype (uint8 for bytes), got {tokens.dtype}")
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be at least 1")
        if tokens.numel() < seq_len + 1:
            raise ValueError(
                f"{tokens.numel()} tokens are too few for one window of seq_len={seq_len} (need seq_len + 1)"
            )
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), both int64 [seq_len], with ``y[j] == x[j + 1]`` for ``j < seq_len - 1``."""
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for {n} sequences")
        start = (index % n) * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1].long()
        return window[:-1], window[1:]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (self[i] for i in range(len(self)))


def byte_datasets(
    seq_len: int, max_bytes: int = 4 * 2**20, eval_fraction: float = 0.05
) -> tuple[ByteSequences, ByteSequences]:
    """Train and eval ``ByteSequences`` over ``load_byte_corpus(max_bytes)``.

    The eval set is built from the last ``eval_fraction`` of the bytes and the train set from the
    rest; no byte (input or target) is in both. Each part must hold at least ``seq_len + 1`` bytes.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be at least 1")
    if max_bytes < 1:
        raise ValueError(f"max_bytes={max_bytes} must be at least 1")
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction={eval_fraction} must be strictly between 0 and 1")
    hint = f"raise max_bytes (={max_bytes}) or adjust eval_fraction (={eval_fraction})"
    return split_sequences(load_byte_corpus(max_bytes), seq_len, eval_fraction, hint)


def split_sequences(
    tokens: torch.Tensor, seq_len: int, eval_fraction: float, hint: str = ""
) -> tuple[ByteSequences, ByteSequences]:
    """Train and eval next-token windows of ``seq_len`` over the 1-D ``tokens``: the eval set from
    the last ``eval_fraction`` of them, the train set from the rest. ValueError (ending with
    ``hint``, what the caller's user can change) when a part is shorter than one window."""
    n_eval = int(len(tokens) * eval_fraction)
    n_train = len(tokens) - n_eval
    for name, size in (("train", n_train), ("eval", n_eval)):
        if size < seq_len + 1:
            raise ValueError(
                f"the {name} split has {size} tokens, fewer than seq_len + 1 = {seq_len + 1}"
                + (f"; {hint}" if hint else "")
            )
    return ByteSequences(tokens[:n_train], seq_len), ByteSequences(tokens[n_train:], seq_len)
