"""Reading a Hugging Face checkpoint folder into any tessera layout: the folder's tensors from
the safetensors headers (:func:`read_folder`), each model key matched to its stored tensor and
checked as ``transformers`` matches them, and :class:`PretrainedWeights`, which copies into each
of a rank's tensors only the boxes of the stored tensor its view holds (:func:`read_view`)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tessera.checkpoint.format import CheckpointError, read_header, read_json
from tessera.context.placement import placement_of
from tessera.context.views import View, boxes, whole_view
from tessera.hf.folder import CONFIG, INDEX, PICKLED, WEIGHTS, key_patterns, tied_key_groups

__all__ = ["PretrainedWeights", "Stored", "read_folder", "read_view"]


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
        pickled = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLED)
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
    aliases = {key: group for group in tied_key_groups(module, shapes) for key in group}
    where: dict[str, Stored] = {}
    for key in shapes:
        names = [key] + [k for k in aliases.get(key, []) if k != key]
        found = next((stored[v] for name in names for v in _variants(name, dotted) if v in stored), None)
        if found is not None:
            where[key] = found
    name = type(module).__name__
    optional = key_patterns(module, "_keys_to_ignore_on_load_missing")
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
    ignored = key_patterns(module, "_keys_to_ignore_on_load_unexpected")
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
        self.module = module
        self._derived: tuple[str, dict[str, torch.Tensor]] | None = None  # one layer's quantized values

    def holds(self, key: str) -> bool:
        return self._stored(key) is not None or self._quantizing(key) is not None

    def _quantizing(self, key: str) -> tuple[Any, str] | None:
        """``(layer, its weight's key)`` when ``key`` is a buffer of a layer quantized while
        loading (a deferred LoRA base, ``tessera.lora.quant``): its values derive from the
        stored weight."""
        prefix, _, name = key.rpartition(".")
        try:
            layer = self.module.get_submodule(prefix)
        except AttributeError:
            return None
        weight_key = f"{prefix}.weight"
        frozen: tuple[str, ...] = getattr(layer, "frozen_buffers", ())
        if not hasattr(layer, "values_from") or name not in frozen or self._stored(weight_key) is None:
            return None
        return layer, weight_key

    def _quantized(self, key: str) -> torch.Tensor:
        """The whole value of quantized buffer ``key``: its layer's stored weight read whole (one
        layer at a time, never the model) and quantized; kept while the layer's buffers are asked."""
        found = self._quantizing(key)
        assert found is not None
        layer, weight_key = found
        prefix = weight_key.rpartition(".")[0]
        if self._derived is None or self._derived[0] != prefix:
            self._derived = None  # the last layer's values go before this one's are made
            stored = self._stored(weight_key)
            assert stored is not None
            weight = torch.empty(stored.shape, dtype=torch.float32)
            self.fill(weight_key, [(weight, whole_view(stored.shape))])
            self._derived = (prefix, layer.values_from(weight))
        return self._derived[1][key.rpartition(".")[2]]

    def _stored(self, key: str) -> Stored | None:
        """Where ``key``'s values are; a LoRA adapter's frozen base layer (PEFT's name,
        ``q_proj.base_layer.weight``) has the plain layer's (``q_proj.weight``)."""
        return self.where.get(key) or self.where.get(key.replace(".base_layer.", "."))

    def fill(self, key: str, targets: list[tuple[torch.Tensor, View]]) -> None:
        """Write the values of tensor ``key`` into each ``(tensor, view)`` of ``targets``."""
        from safetensors import safe_open

        stored = self._stored(key)
        if stored is None and self._quantizing(key) is not None:
            value = self._quantized(key)
            for tensor, view in targets:
                read_view(value, tensor, view)
            return
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
