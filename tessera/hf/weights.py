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

The folder's names are in :mod:`tessera.hf.folder`, reading it in :mod:`tessera.hf.reading`,
writing it in :mod:`tessera.hf.writing`; this module builds and fills models from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from tessera.checkpoint.format import CheckpointError
from tessera.hf.folder import CONFIG, INDEX, WEIGHTS
from tessera.hf.reading import PretrainedWeights, read_folder, read_view
from tessera.hf.writing import save_pretrained
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


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError("tessera.hf needs transformers: pip install 'tessera[hf]'") from None
    return transformers


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
