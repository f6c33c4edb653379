"""What a Hugging Face checkpoint folder is: the names of its files (as ``transformers``'
``save_pretrained`` writes them) and the key conventions of its models (tied keys, the key
patterns a model lists), shared by :mod:`tessera.hf.reading` and :mod:`tessera.hf.writing`."""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch import nn

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD = "model-{:05d}-of-{:05d}.safetensors"
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def key_patterns(module: nn.Module, attribute: str) -> list[str]:
    """The key patterns a ``transformers`` model lists in ``attribute`` (a list, set or dict)."""
    found = getattr(module, attribute, None) or ()
    return [str(p) for p in found]


def tied_key_groups(module: nn.Module, keys: Iterable[str]) -> list[list[str]]:
    """The state-dict keys of each parameter, in the module's order (a tied one has several)."""
    wanted = set(keys)
    groups: dict[int, list[str]] = {}
    for key, param in module.named_parameters(remove_duplicate=False):
        if key in wanted:
            groups.setdefault(id(param), []).append(key)
    return list(groups.values())
