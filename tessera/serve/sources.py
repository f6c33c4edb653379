"""What ``tessera serve`` and ``tessera generate`` can run, and how each rank builds it.

``SOURCE`` is one of:

- a Hugging Face folder (``config.json`` with a ``model_type``, safetensors weights; its
  tokenizer when the folder has one): any causal LM of the GPT-2 or LLaMA family;
- a ``tessera train`` run folder (its ``config.json``): its final ``model.safetensors`` for the
  GPT, or its ``hf/`` folder for a Hugging Face model;
- a config file (``.py``, ``.yaml``, ``.toml``, ``.json``): its ``model`` section, with
  ``model.init`` for the weights (random otherwise).

Every rank builds the model under ``tessera.deferred_init()`` and fills only its part.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from tessera.errors import ConfigError

HF_CONFIG = "config.json"
RUN_WEIGHTS = "model.safetensors"
RUN_HF = "hf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


@dataclass(frozen=True)
class ModelSource:
    """A model to serve: ``kind`` "gpt" (tessera's, from ``preset`` and ``options``) or "hf"
    (the folder ``path``); ``init`` the weights ("random", a full-state safetensors file or a
    tessera checkpoint folder); ``name`` what clients call it."""

    kind: str
    name: str
    path: str | None = None
    preset: str = "tiny"
    options: dict[str, Any] = field(default_factory=dict)
    init: str = "random"

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> ModelSource:
        return cls(**json.loads(text))


def resolve_source(arg: str) -> ModelSource:
    """The model ``arg`` names (see the module docstring); ConfigError says what is accepted."""
    path = Path(arg)
    if not path.exists():
        raise ConfigError(
            f"{arg} does not exist: give a Hugging Face folder, a tessera train run folder or a config file"
        )
    if path.is_dir():
        config = path / HF_CONFIG
        if not config.is_file():
            raise ConfigError(f"{arg} has no {HF_CONFIG}: give a Hugging Face folder or a tessera train run folder")
        data = json.loads(config.read_text())
        if "model_type" in data:
            return ModelSource("hf", name=path.resolve().name, path=str(path.resolve()))
        if "model" in data:
            return _from_model_section(data["model"], run_dir=path)
        raise ConfigError(f"{config} is neither a Hugging Face config (model_type) nor a tessera run's (model)")
    from tessera.config import load_config

    cfg = load_config(str(path))
    return _from_model_section(
        {"name": cfg.model.name, "preset": cfg.model.preset, "options": cfg.model.options, "init": cfg.model.init},
        run_dir=None,
    )


def _from_model_section(model: dict[str, Any], run_dir: Path | None) -> ModelSource:
    name = str(model.get("name", "gpt"))
    if name.startswith("hf:"):
        folder = run_dir / RUN_HF if run_dir is not None and (run_dir / RUN_HF).is_dir() else Path(name[3:])
        return resolve_source(str(folder))
    if name != "gpt":
        raise ConfigError(f"model.name={name!r}: tessera serves 'gpt' and 'hf:PATH' models")
    init = str(model.get("init", "random"))
    if run_dir is not None and (run_dir / RUN_WEIGHTS).is_file():
        init = str((run_dir / RUN_WEIGHTS).resolve())
    preset = str(model.get("preset", "tiny"))
    label = run_dir.resolve().name if run_dir is not None else f"gpt-{preset}"
    return ModelSource("gpt", name=label, preset=preset, options=dict(model.get("options") or {}), init=init)


def build_model(source: ModelSource) -> tuple[nn.Module, str]:
    """This rank's deferred model of ``source`` (built under the current context) and the
    ``init`` to fill it from."""
    import tessera
    from tessera.models.gpt import gpt

    if source.kind == "hf":
        assert source.path is not None
        return tessera.hf.from_pretrained(source.path), "random"  # "random": the folder's own values
    with tessera.deferred_init():
        model = gpt(source.preset, **source.options)
    return model, source.init


def load_tokenizer(source: ModelSource) -> Any:
    """The folder's tokenizer (``transformers.AutoTokenizer``, local files only), else bytes."""
    from tessera.inference.text import ByteTokenizer

    if source.kind == "hf" and source.path and any((Path(source.path) / f).is_file() for f in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source.path, local_files_only=True)
    return ByteTokenizer()
