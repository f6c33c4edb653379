"""Writing the full state of an engine or a model, in any layout, as a Hugging Face checkpoint
folder (:func:`save_pretrained`): the keys ``transformers`` keeps, cut into files of at most
``max_shard_size``, gathered one tensor at a time and written by rank 0 as they arrive."""

from __future__ import annotations

import copy
import json
import math
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from tessera.checkpoint.format import CheckpointError, dtype_name, encode_header, raw_bytes
from tessera.checkpoint.full import FullEntry, streamed_full_state
from tessera.checkpoint.planning import exchange
from tessera.context import ParallelContext, has_context
from tessera.context import get_context as current_context
from tessera.context.placement import placement_of
from tessera.files import atomic_path, write_atomically
from tessera.hf.folder import CONFIG, INDEX, SHARD, SHARD_NAME, WEIGHTS, key_patterns, tied_key_groups

__all__ = ["plan_files", "save_pretrained", "saved_entries"]


def _size_in_bytes(size: int | str) -> int:
    """``5000000``, ``"5GB"`` (10^9) or ``"5GiB"`` (2^30) as bytes."""
    if isinstance(size, int):
        return size
    found = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b", size.strip().lower())
    if found is None:
        raise ValueError(f"max_shard_size={size!r}: give bytes or a size such as '5GB' or '500MiB'")
    number, unit, binary = found.groups()
    return int(float(number) * (1024 if binary else 1000) ** " kmgt".index(unit or " "))


def saved_entries(module: nn.Module, entries: list[FullEntry]) -> list[FullEntry]:
    """The tensors a ``transformers`` folder holds of ``entries``: one of each group of tied
    keys (the one ``transformers`` keeps: keys matching the models' ``_tied_weights_keys`` go,
    the first remaining stays) and none of ``_keys_to_ignore_on_save``."""
    tied_patterns = [
        f"{name}.{key}" if name else key
        for name, sub in module.named_modules()
        for key in key_patterns(sub, "_tied_weights_keys")
    ]
    dropped = set(key_patterns(module, "_keys_to_ignore_on_save"))
    for names in tied_key_groups(module, (e.key for e in entries)):
        if len(names) < 2:
            continue
        found = 0
        for name in sorted(names):
            if any(re.search(p, name) for p in tied_patterns):
                found += 1
                if found < len(names):
                    dropped.add(name)
        dropped.update([n for n in names if n not in dropped][1:])
    return [e for e in entries if e.key not in dropped]


def _nbytes(entry: FullEntry) -> int:
    return math.prod(entry.shape) * entry.dtype.itemsize


def plan_files(entries: list[FullEntry], max_bytes: int) -> list[list[FullEntry]]:
    """``entries`` in order, cut into files of at most ``max_bytes`` (a larger tensor alone)."""
    files: list[list[FullEntry]] = [[]]
    size = 0
    for entry in entries:
        if files[-1] and size + _nbytes(entry) > max_bytes:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += _nbytes(entry)
    return files


class _Writer:
    """Rank 0's files of a save, written as the tensors arrive (each file atomically)."""

    def __init__(self, folder: Path, files: list[list[FullEntry]]) -> None:
        self.folder, self.files = folder, files
        count = len(files)
        self.names = [WEIGHTS] if count == 1 else [SHARD.format(n + 1, count) for n in range(count)]
        self.place = {e.key: (n, e) for n, entries in enumerate(files) for e in entries}
        self.stack: ExitStack | None = None
        self.handle: BinaryIO | None = None
        self.left = 0
        self.written = 0
        folder.mkdir(parents=True, exist_ok=True)

    def write(self, key: str, value: torch.Tensor) -> None:
        if key not in self.place:
            return  # a tied alias, or a key not saved
        n, entry = self.place[key]
        if tuple(value.shape) != tuple(entry.shape) or value.dtype != entry.dtype:
            raise CheckpointError(
                f"{key}: gathered {tuple(value.shape)} {value.dtype}, expected {entry.shape} {entry.dtype}"
            )
        if self.handle is None:
            self._open(n)
        assert self.handle is not None
        self.handle.write(raw_bytes(value))
        self.written += 1
        self.left -= 1
        if self.left == 0:
            self._close()

    def _open(self, n: int) -> None:
        self.stack = ExitStack()
        tmp = self.stack.enter_context(atomic_path(self.folder / self.names[n]))
        self.handle = self.stack.enter_context(open(tmp, "wb"))
        entries = [(e.key, dtype_name(e.dtype), e.shape) for e in self.files[n]]
        self.handle.write(encode_header(entries, {"format": "pt"}))
        self.left = len(entries)

    def _close(self) -> None:
        assert self.stack is not None
        self.handle, stack, self.stack = None, self.stack, None
        stack.close()  # the file is renamed into place

    def abort(self) -> None:
        if self.stack is not None:
            stack, self.stack, self.handle = self.stack, None, None
            error = CheckpointError("save abandoned")
            stack.__exit__(type(error), error, None)  # the partial file is removed

    def finish(self, module: nn.Module) -> None:
        """After the tensors: the index (several files), config.json, generation_config.json,
        and no stale weight file of an earlier save."""
        if self.written != len(self.place):
            raise CheckpointError(f"the save ended before every tensor of {self.folder} was written")
        if len(self.names) > 1:
            weight_map = {e.key: self.names[n] for n, entries in enumerate(self.files) for e in entries}
            params = {k for k, _ in module.named_parameters(remove_duplicate=False)}
            entries = [e for files in self.files for e in files]
            metadata = {
                "total_parameters": sum(math.prod(e.shape) for e in entries if e.key in params),
                "total_size": sum(_nbytes(e) for e in entries),
            }
            text = json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=2, sort_keys=True)
            write_atomically(self.folder / INDEX, text + "\n")
        _write_configs(module, self.folder, _dtype_of(self.files))
        kept = {*self.names, INDEX} if len(self.names) > 1 else {WEIGHTS}
        for stale in self.folder.iterdir():
            if (stale.name in (WEIGHTS, INDEX) or SHARD_NAME.fullmatch(stale.name)) and stale.name not in kept:
                stale.unlink()


def _dtype_of(files: list[list[FullEntry]]) -> torch.dtype | None:
    """The dtype of the first floating-point tensor saved (the model's, for its config)."""
    return next((e.dtype for entries in files for e in entries if e.dtype.is_floating_point), None)


def _write_configs(module: nn.Module, folder: Path, dtype: torch.dtype | None) -> None:
    """config.json (with the model's class and the saved dtype, as ``transformers`` writes it)
    and, for a model that generates, generation_config.json."""
    config: Any = copy.deepcopy(module.config)
    config.architectures = [type(module).__name__]
    if dtype is not None:
        config.dtype = str(dtype).removeprefix("torch.")
    write_atomically(folder / CONFIG, config.to_json_string(use_diff=True))
    generation = getattr(module, "generation_config", None)
    can_generate = getattr(module, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        write_atomically(folder / "generation_config.json", generation.to_json_string(use_diff=True))


def _context_of(source: Any, module: nn.Module, ctx: ParallelContext | None) -> ParallelContext | None:
    """The context the save is collective over: given, the engine's, the one the parameters were
    split with, or the current one (None: one process, no context)."""
    if ctx is not None:
        return ctx
    found = getattr(source, "ctx", None)
    if isinstance(found, ParallelContext):
        return found
    for param in module.parameters():
        mesh = placement_of(param).mesh
        if mesh is not None:
            return mesh
    return current_context() if has_context() else None


def save_pretrained(
    source: Any, path: str | Path, *, max_shard_size: int | str = "50GB", ctx: ParallelContext | None = None
) -> Path:
    """Write ``source`` (an engine, or a ``transformers`` model in any layout) as a Hugging Face
    folder at ``path`` that ``transformers``' ``from_pretrained`` loads: config.json and the
    full state as ``model.safetensors``, or above ``max_shard_size`` (bytes, or "5GB") as
    several files and ``model.safetensors.index.json``; keys as ``transformers`` writes them
    (one key of a tied pair). Collective: every rank calls it; the tensors are gathered one at
    a time (the fp32 masters where mixed precision keeps them, as ``full_state_dict`` gives)
    and rank 0 writes each as it comes, every file atomically. Returns ``path`` once every
    rank knows the folder is complete; a failure raises CheckpointError on every rank."""
    folder = Path(path)
    max_bytes = _size_in_bytes(max_shard_size)
    failed: str | None = None
    with streamed_full_state(source) as stream:
        module = stream.module
        if not hasattr(getattr(module, "config", None), "to_json_string"):
            raise TypeError(f"save_pretrained writes transformers models; {type(module).__name__} has no config")
        context = _context_of(source, module, ctx)
        files = plan_files(saved_entries(module, stream.entries), max_bytes)
        writer: _Writer | None = None
        if context is None or context.rank == 0:
            try:
                writer = _Writer(folder, files)
            except OSError as exc:
                failed = f"rank 0 could not make {folder}: {exc}"
        for key, value in stream:  # every rank gathers each tensor; rank 0 writes it
            if writer is not None and failed is None:
                try:
                    writer.write(key, value)
                except Exception as exc:  # the other ranks hear of it below rather than wait
                    failed = f"rank 0 could not write {folder}: {exc}"
                    writer.abort()
            del value
        if writer is not None and failed is None:
            try:
                writer.finish(module)
            except Exception as exc:
                failed = f"rank 0 could not write {folder}: {exc}"
    said = exchange(failed, context.group("world"), context.device) if context is not None else [failed]
    problems = [p for p in said if p is not None]
    if problems:
        raise CheckpointError(problems[0])
    return folder
