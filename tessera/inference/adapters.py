"""LoRA adapters served over one base: PEFT adapter folders read, checked against the model,
and put on this rank's layers as :class:`~tessera.lora.routing.RoutedLoraLinear`, every
adapter beside the one copy of the base, chosen per sequence by the step's routing.

Adapter ``i`` is ``folders[i]``; a sequence of the step names its adapter by that index (``-1``:
the base alone). Each rank reads the folders (adapters are small) and keeps its own block of
each factor, split as its base layer is (``B`` on ``out`` under a column-parallel base, ``A`` on
``in`` under a row-parallel one), on its own pipeline stage's layers only. Adapters may differ
in rank and in the layers they target; a layer's scaling is ``lora_alpha / r`` with that
layer's ``r`` (PEFT's, ``rank_pattern`` included).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tessera.context import ParallelContext
from tessera.errors import ConfigError
from tessera.hf.adapters import check_fit, read_adapters
from tessera.hf.policy import replace_module
from tessera.lora.apply import linear_layers
from tessera.lora.layers import TESSERA_LINEARS, linear_features, split_of
from tessera.lora.routing import SPLITS, AdapterRouting, RoutedLoraLinear
from tessera.parallel.tensor.common import ShardSpec, local_range, local_shard
from tessera.parallel.tensor.tp1d.functional import TENSOR

__all__ = ["install_adapters", "read_servable"]

_FACTORS = (".lora_A.weight", ".lora_B.weight")


def read_servable(folder: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A PEFT LoRA folder's config and weights (tessera's keys, as
    :func:`~tessera.hf.adapters.read_adapters` reads them), or ConfigError naming what tessera
    does not serve: DoRA, rsLoRA, ``alpha_pattern``, trained biases, ``modules_to_save``, adapted
    embeddings."""
    config, state = read_adapters(folder)
    found = []
    if config.get("use_dora"):
        found.append("use_dora (DoRA)")
    if config.get("use_rslora"):
        found.append("use_rslora (rsLoRA's alpha / sqrt(r) scaling)")
    if config.get("alpha_pattern"):
        found.append("alpha_pattern")
    if config.get("bias", "none") != "none":
        found.append(f"bias={config['bias']!r}")
    if config.get("modules_to_save"):
        found.append(f"modules_to_save={config['modules_to_save']}")
    for key in ("lora_bias", "layer_replication", "trainable_token_indices", "target_parameters"):
        if config.get(key):
            found.append(f"{key}={config[key]!r}")
    others = sorted(k for k in state if not k.endswith(_FACTORS))
    if others:
        found.append(f"weights other than lora_A/lora_B ({', '.join(others[:3])})")
    if found:
        raise ConfigError(
            f"{folder}: tessera serves plain LoRA adapters of linear layers; this folder has {'; '.join(found)}"
        )
    return config, state


def install_adapters(model: nn.Module, folders: Sequence[str | Path], ctx: ParallelContext) -> AdapterRouting:
    """Put the adapters of ``folders`` on ``model`` (laid out for ``ctx``, its weights made; before
    int8 quantization, which then quantizes the bases only) and return the routing that the
    runner sets for each step. ConfigError: a folder tessera does not serve, or one made for
    another base (naming the shapes that differ)."""
    routing = AdapterRouting(len(folders), ctx.device)
    bases = {name: model.get_submodule(name) for name in linear_layers(model)}
    dtype = next(p for p in model.parameters() if not p.is_meta).dtype
    routed: dict[str, RoutedLoraLinear] = {}
    for index, folder in enumerate(folders):
        config, state = read_servable(folder)
        ranks = {k.removesuffix(_FACTORS[0]): v.shape[0] for k, v in state.items() if k.endswith(_FACTORS[0])}
        expected: dict[str, tuple[int, ...]] = {}
        for name, base in bases.items():
            features = linear_features(base)
            assert features is not None
            rank = ranks.get(name, 0)
            expected[name + _FACTORS[0]] = (rank, features[0])
            expected[name + _FACTORS[1]] = (features[1], rank)
        check_fit(folder, model, state, expected)
        unpaired = sorted(k for k in state if k.endswith(_FACTORS[1]) and k.removesuffix(_FACTORS[1]) not in ranks)
        if unpaired:
            raise ConfigError(f"{folder}: {', '.join(unpaired[:3])} without its lora_A")
        alpha = float(config["lora_alpha"])
        for name, rank in ranks.items():
            base = bases[name]
            if _not_made(base):  # another pipeline stage's layer
                continue
            split, parts = _split_of(name, base)
            if name not in routed:
                routed[name] = RoutedLoraLinear(base, routing, split)
                replace_module(model, name, routed[name])
            layer = routed[name]
            a, b = _local_factors(split, parts, base, state[name + _FACTORS[0]], state[name + _FACTORS[1]], ctx)
            layer.add(index, _placed(a, dtype, ctx), _placed(b, dtype, ctx), alpha / rank)
    return routing


def _not_made(base: nn.Module) -> bool:
    weight = base._parameters.get("weight")
    return weight is not None and weight.is_meta


def _split_of(name: str, base: nn.Module) -> tuple[str, int]:
    """How the factors follow ``base`` (:func:`~tessera.lora.layers.split_of`), and its fused parts."""
    split, parts = split_of(base)
    if split not in SPLITS or type(base) in TESSERA_LINEARS:
        raise ConfigError(
            f"{name} is a {type(base).__name__}: served adapters follow nn.Linear, transformers' Conv1D and "
            "tessera.hf's 1D tensor-parallel layers"
        )
    return split, parts


def _local_factors(
    split: str, parts: int, base: Any, a: torch.Tensor, b: torch.Tensor, ctx: ParallelContext
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's blocks of the full factors ``a [r, in]`` and ``b [out, r]`` for ``base``."""
    rank = a.shape[0]
    if split == "column":  # B on out as the base (each of its fused ``parts`` on its own), A whole
        return a, local_shard(b, ShardSpec(tuple(b.shape), ((TENSOR,), ()), (parts, 1)), ctx)
    if split == "row":  # A on in as the base, cut to the valid (unpadded) columns the base hands over
        group = ctx.group(TENSOR)
        _, valid = local_range(base.in_features, group.size, group.rank)
        return local_shard(a, ShardSpec((rank, base.in_features), ((), (TENSOR,))), ctx)[:, :valid], b
    return a, b


def _placed(t: torch.Tensor, dtype: torch.dtype, ctx: ParallelContext) -> torch.Tensor:
    return t.to(device=ctx.device, dtype=dtype).contiguous()
