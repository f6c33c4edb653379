"""Hugging Face checkpoint folders in and out of any tessera layout.

A folder is what ``transformers``' ``save_pretrained`` writes: ``config.json`` and the weights
as ``model.safetensors`` or, above a size, as ``model-0000k-of-0000n.safetensors`` files named
by ``model.safetensors.index.json``. Only safetensors are read: nothing is unpickled.

- :func:`from_pretrained`: the model the folder's config describes, built under
  ``tessera.deferred_init`` (no memory), its keys and shapes checked against the folder's.
  ``tessera.initialize`` applies the layout (the family's policy, the strategy) and fills what
  each rank keeps from the folder.
- :func:`load_pretrained`: the folder's values into an engine already made (collective).
- :func:`save_pretrained`: the full state of an engine or a model written as such a folder by
  rank 0, gathered one tensor at a time (collective).

A rank reads only what it keeps: for each of its tensors (a tensor-parallel block, a ZeRO piece
of one, or the whole: ``Strategy.checkpoint_tensors`` and their views, the geometry tessera's
checkpoints reshard with, ``tessera.context.views``) the boxes where the block meets the stored
tensor, through ``safe_open(...).get_slice``; a file is mapped only while one tensor is read.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from tessera.checkpoint.format import CheckpointError, dtype_name, encode_header, raw_bytes, read_header, read_json
from tessera.checkpoint.full import FullEntry, streamed_full_state
from tessera.checkpoint.planning import exchange
from tessera.context import ParallelContext, has_context
from tessera.context import get_context as current_context
from tessera.context.placement import placement_of
from tessera.context.views import View, boxes, whole_view
from tessera.files import atomic_path, write_atomically
from tessera.init.recording import deferred_init, forget

__all__ = [
    "CONFIG",
    "INDEX",
    "WEIGHTS",
    "PretrainedWeights",
    "from_pretrained",
    "load_pretrained",
    "read_folder",
    "read_view",
    "save_pretrained",
]

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD = "model-{:05d}-of-{:05d}.safetensors"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError("tessera.hf needs transformers: pip install 'tessera[hf]'") from None
    return transformers


# ---- reading a folder ------------------------------------------------------------------------


@dataclass(frozen=True)
class Stored:
    """A tensor of a folder: the ``file`` holding it, its ``key`` there, ``shape`` and ``dtype``
    (the safetensors name: "F32", "BF16", ...)."""

    file: str
    key: str
    shape: tuple[int, ...]
    dtype: str


def read_folder(path: str | Path) -> dict[str, Stored]:
    """Every tensor of the Hugging Face folder ``path`` by its key, from the files' headers
    (``model.safetensors``, else the files ``model.safetensors.index.json`` names, as
    ``transformers`` looks for them). Raises CheckpointError naming what is missing."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(
            f"{folder} is not a folder (a Hugging Face checkpoint folder holds {CONFIG} and {WEIGHTS})"
        )
    weight_map: dict[str, str] | None = None
    if (folder / WEIGHTS).is_file():
        files = [WEIGHTS]
    elif (folder / INDEX).is_file():
        index = read_json(folder / INDEX, "safetensors index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{folder / INDEX} has no weight_map")
        files = sorted(set(weight_map.values()))
    else:
        pickled = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLED)
        hint = (
            f"; it has {', '.join(pickled)}: tessera reads only safetensors (it never unpickles); convert them "
            "with transformers (from_pretrained, then save_pretrained) where you trust the file"
            if pickled
            else ""
        )
        raise CheckpointError(f"{folder} has neither {WEIGHTS} nor {INDEX}{hint}")
    stored: dict[str, Stored] = {}
    for name in files:
        path_ = folder / name
        if not path_.is_file():
            raise CheckpointError(f"{folder / INDEX} names {name}, which is missing")
        try:
            header, _ = read_header(path_)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path_} is not a safetensors file: {exc}") from exc
        for key, entry in header.items():
            if key != "__metadata__" and (weight_map is None or weight_map.get(key) == name):
                stored[key] = Stored(name, key, tuple(int(n) for n in entry["shape"]), str(entry["dtype"]))
    for key, name in (weight_map or {}).items():
        if key not in stored:
            raise CheckpointError(f"{folder / INDEX} places {key} in {name}, which does not hold it")
    return stored


def _patterns(module: nn.Module, attribute: str) -> list[str]:
    """The key patterns a ``transformers`` model lists in ``attribute`` (a list, set or dict)."""
    found = getattr(module, attribute, None) or ()
    return [str(p) for p in found]


def _tied_key_groups(module: nn.Module, keys: Iterable[str]) -> list[list[str]]:
    """The state-dict keys of each parameter, in the module's order (a tied one has several)."""
    wanted = set(keys)
    groups: dict[int, list[str]] = {}
    for key, param in module.named_parameters(remove_duplicate=False):
        if key in wanted:
            groups.setdefault(id(param), []).append(key)
    return list(groups.values())


def _full_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every state-dict key of ``module`` with its single-process shape (a deferred model's meta
    tensors, or a parallel model's blocks and pieces, by their placements)."""
    return {k: placement_of(t).full_shape(t) for k, t in module.state_dict(keep_vars=True).items()}


def _listed(keys: list[str], at_most: int = 8) -> str:
    return ", ".join(keys[:at_most]) + (f", ... ({len(keys)} in all)" if len(keys) > at_most else "")


def _variants(key: str, dotted: str) -> list[str]:
    """``key`` and the key with the base model's prefix (``dotted``: "transformer.") dropped or
    added: a head model's key in a base model's folder and back."""
    if not dotted:
        return [key]
    return [key, key[len(dotted) :]] if key.startswith(dotted) else [key, dotted + key]


def _match(module: nn.Module, stored: dict[str, Stored], folder: Path) -> dict[str, Stored]:
    """Where each state-dict key of ``module`` has its values in the folder: under its own key,
    a key it is tied to, or with the model's ``base_model_prefix`` dropped or added (as
    ``transformers`` matches them). Raises CheckpointError naming the files and the tensors for
    parameters the folder lacks, tensors the model has no place for and shapes that differ."""
    shapes = _full_shapes(module)
    prefix = str(getattr(module, "base_model_prefix", "") or "")
    dotted = f"{prefix}." if prefix else ""
    aliases = {key: group for group in _tied_key_groups(module, shapes) for key in group}
    where: dict[str, Stored] = {}
    for key in shapes:
        names = [key] + [k for k in aliases.get(key, []) if k != key]
        found = next((stored[v] for name in names for v in _variants(name, dotted) if v in stored), None)
        if found is not None:
            where[key] = found
    name = type(module).__name__
    optional = _patterns(module, "_keys_to_ignore_on_load_missing")
    missing = [k for k in aliases if k not in where and not any(re.search(p, k) for p in optional)]
    if missing:
        files = ", ".join(sorted({s.file for s in stored.values()}))
        raise CheckpointError(f"{folder} ({files}) has no values for {name}'s {_listed(missing)}")
    unexpected = _unexpected(module, stored, {s.key for s in where.values()}, dotted)
    if unexpected:
        listed = _listed([f"{stored[k].file}: {k}" for k in sorted(unexpected)])
        raise CheckpointError(f"{folder} holds tensors {name} has no place for: {listed}")
    wrong = [
        f"{folder / s.file}: {s.key} has shape {s.shape}, {name}'s {key} {shapes[key]}"
        for key, s in where.items()
        if s.shape != tuple(shapes[key])
    ]
    if wrong:
        raise CheckpointError(f"{folder} does not fit {name}: {'; '.join(wrong[:8])}")
    return where


def _unexpected(module: nn.Module, stored: dict[str, Stored], used: set[str], dotted: str) -> list[str]:
    """The folder's tensors that ``module`` has no place for, leaving out what ``transformers``
    leaves out: keys matching ``_keys_to_ignore_on_load_unexpected``, buffers the model makes
    itself (not persistent), and a head's tensors when a base model loads a head model's folder."""
    ignored = _patterns(module, "_keys_to_ignore_on_load_unexpected")
    made = {v for key, _ in module.named_buffers() for v in _variants(key, dotted)}
    head_dropped = (
        bool(dotted)
        and not any(k.startswith(dotted) for k, _ in module.named_parameters())
        and any(k.startswith(dotted) for k in stored)
    )
    return [
        k
        for k in stored
        if k not in used
        and k not in made
        and not any(re.search(p, k) for p in ignored)
        and not (head_dropped and not k.startswith(dotted))
    ]


def _rows_of(view: View) -> tuple[View, int]:
    """For a ZeRO piece (a flat range of a block): the rows of the block it lies in, as a view
    of their own, and where the range starts in them."""
    assert view.flat is not None
    start, end = view.flat
    row = math.prod(view.local_shape[1:])
    first, last = start // row, -(-end // row)
    rows = []
    for local, full, length in view.segments[0]:
        lo, hi = max(local, first), min(local + length, last)
        if lo < hi:
            rows.append((lo - first, full + lo - local, hi - lo))
    local_shape = (last - first, *view.local_shape[1:])
    return View(view.full_shape, local_shape, (tuple(rows), *view.segments[1:])), start - first * row


def read_view(part: Any, target: torch.Tensor, view: View) -> None:
    """Copy the elements ``view`` holds of a stored tensor (``part``: anything indexed by a tuple
    of slices of the full tensor, a safetensors slice) into ``target``: the view's block
    (padding zeroed) or, for a ZeRO piece, its flat range. Only the boxes where the block (or
    the piece's rows) meets the tensor are read."""
    with torch.no_grad():
        if view.flat is None:
            block, offset = view, 0
            into = target.view(view.local_shape)
        else:
            block, offset = _rows_of(view) if view.local_shape else (view.block, 0)
            into = torch.empty(block.local_shape, dtype=target.dtype, device=target.device)
        if block.valid_numel() < math.prod(block.local_shape):
            into.zero_()
        for src, dst in boxes(whole_view(view.full_shape), block):
            into[dst].copy_(part[src])
        if view.flat is not None:
            target.view(-1).copy_(into.view(-1)[offset : offset + view.numel])


class PretrainedWeights:
    """The values of a Hugging Face folder for ``module``'s tensors, read slice by slice (a
    :class:`tessera.init.materialise.ValueSource`: ``tessera.initialize(..., init=this)`` fills a
    model with them). The keys and shapes are matched and checked on construction
    (:func:`_match`); ``module`` may be a deferred model or a parallel one (its parameters' full
    shapes come from their placements)."""

    def __init__(self, path: str | Path, module: nn.Module, stored: dict[str, Stored] | None = None) -> None:
        self.folder = Path(path)
        self.where = _match(module, stored if stored is not None else read_folder(self.folder), self.folder)

    def holds(self, key: str) -> bool:
        return key in self.where

    def fill(self, key: str, targets: list[tuple[torch.Tensor, View]]) -> None:
        """Write the values of tensor ``key`` into each ``(tensor, view)`` of ``targets``."""
        from safetensors import safe_open

        stored = self.where.get(key)
        if stored is None:
            raise CheckpointError(f"{self.folder} has no values for {key}")
        path = self.folder / stored.file
        try:
            with safe_open(str(path), framework="pt") as handle:  # mapped only while this tensor is read
                part = handle.get_slice(stored.key)
                for tensor, view in targets:
                    read_view(part, tensor, view)
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors' own errors included
            raise CheckpointError(f"{path}: cannot read {stored.key} (for {key}): {exc}") from exc


# ---- loading ---------------------------------------------------------------------------------


def _model_class(transformers: Any, config: Any, model_class: Any) -> Any:
    if model_class is None:
        names = [n for n in (getattr(config, "architectures", None) or []) if hasattr(transformers, n)]
        return getattr(transformers, names[0]) if names else transformers.AutoModel
    if isinstance(model_class, str):
        if not hasattr(transformers, model_class):
            raise ValueError(f"model_class={model_class!r} is not a class of transformers")
        return getattr(transformers, model_class)
    return model_class


def _check_plain_format(model: Any) -> None:
    """Refuse a model whose checkpoints ``transformers`` converts on load (fused experts, say):
    tessera.hf reads and writes the keys and shapes the modules have."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # a transformers without weight conversions
        return
    conversions = get_model_conversion_mapping(model, add_legacy=False)
    if conversions:
        raise CheckpointError(
            f"{type(model).__name__}'s checkpoints are converted by transformers on load ({conversions[0]!r}"
            f"{', ...' if len(conversions) > 1 else ''}); tessera.hf reads and writes only checkpoints whose keys "
            "and shapes are the modules' own"
        )


def from_pretrained(
    path: str | Path,
    model_class: Any = None,
    *,
    dtype: torch.dtype | str | None = None,
    attn_implementation: str | None = None,
    **config_overrides: Any,
) -> nn.Module:
    """The model of the Hugging Face folder ``path``, built without memory: ``tessera.initialize``
    applies the layout to it and fills what each rank keeps from the folder (each rank reads
    only its blocks or pieces of each tensor; buffers that are not saved are made as the
    constructor makes them). Reads only the config and the files' headers here, on each rank,
    and fails (CheckpointError) naming the file and the tensors when the folder's keys or shapes
    do not fit the model.

    ``model_class``: a ``transformers`` class (``AutoModelForCausalLM``, ``LlamaModel``) or its
    name; default: the config's ``architectures[0]``, else ``AutoModel``. ``dtype``: of the
    parameters, default float32 (torch's default; ``"auto"``: the config's); tessera's mixed
    precision computes in bf16/fp16 from fp32 weights. ``attn_implementation`` and
    ``config_overrides`` change the config as in ``transformers``' ``from_pretrained``."""
    transformers = _transformers()
    folder = Path(path)
    if not (folder / CONFIG).is_file():
        raise CheckpointError(
            f"{folder} has no {CONFIG} (a Hugging Face checkpoint folder holds {CONFIG} and {WEIGHTS})"
        )
    stored = read_folder(folder)
    config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True, **config_overrides)
    cls = _model_class(transformers, config, model_class)
    kwargs: dict[str, Any] = {"dtype": torch.get_default_dtype() if dtype is None else dtype}
    if dtype == "auto":
        kwargs["dtype"] = getattr(config, "dtype", None) or torch.get_default_dtype()
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    build = cls.from_config if hasattr(cls, "from_config") else cls._from_config
    with deferred_init() as rec:
        model: nn.Module = build(config, **kwargs)
    try:
        _check_plain_format(model)
        rec.values = PretrainedWeights(folder, model, stored)
    except BaseException:
        forget(rec)  # the model is not handed out
        raise
    return model


def load_pretrained(engine: Any, path: str | Path) -> None:
    """Fill ``engine``'s model (any layout) with the values of the Hugging Face folder ``path``:
    each rank reads only the blocks or pieces it keeps, then the strategy's copies follow
    (fp32 masters, say). Collective. Optimizer states are left as they are; tensors the folder
    lacks that may be absent (buffers) keep their values."""
    strategy = engine.strategy
    weights = PretrainedWeights(path, strategy.module)
    with strategy.checkpoint_session():
        for held in strategy.checkpoint_tensors():
            if weights.holds(held.key):
                weights.fill(held.key, [(held.tensor, held.view)])
    strategy.checkpoint_loaded()


# ---- saving ----------------------------------------------------------------------------------


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
        for key in _patterns(sub, "_tied_weights_keys")
    ]
    dropped = set(_patterns(module, "_keys_to_ignore_on_save"))
    for names in _tied_key_groups(module, (e.key for e in entries)):
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
            if (stale.name in (WEIGHTS, INDEX) or _SHARD_NAME.fullmatch(stale.name)) and stale.name not in kept:
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
