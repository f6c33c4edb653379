"""LoRA adapters in PEFT's folder format, from and into any layout, and merged into a plain
Hugging Face folder.

A PEFT adapter folder holds ``adapter_config.json`` (``peft_type: "LORA"``, ``r``,
``lora_alpha``, ``target_modules``, ...) and ``adapter_model.safetensors`` whose keys are the
adapted layers' under ``base_model.model.`` with the adapter's name dropped
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``). tessera's adapters keep
PEFT's layer names (:mod:`tessera.lora`), so the keys map one to one. Adapted MoE experts of
tessera's models (:mod:`tessera.lora.experts`) are saved, loaded and merged under their stacked
keys (``...mlp.experts.lora_A.w_in.weight [experts, r, in]``), which only tessera reads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tessera.checkpoint.full import full_state_dict, load_full_state_dict, save_weights
from tessera.context import get_context, has_context
from tessera.errors import ConfigError
from tessera.files import write_atomically
from tessera.lora import LoraOptions, adapters, apply
from tessera.lora.experts import adapted_experts
from tessera.lora.quant import QuantizedLinear

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PREFIX = "base_model.model."


def _is_adapter_key(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def _module_of(source: Any) -> nn.Module:
    module = getattr(source, "module", source)  # an engine's user module, or the model
    return module.module if hasattr(module, "module") and isinstance(module.module, nn.Module) else module


def save_adapters(source: Any, folder: str | Path, base_model: str | None = None) -> Path:
    """Write ``source``'s adapters (an engine's or a model's, in any layout) as a PEFT folder;
    collective (every rank gathers its adapters' splits), rank 0 writes. Returns the folder."""
    module = _module_of(source)
    layers, experts = adapters(module), adapted_experts(module)
    if not layers and not experts:
        raise ConfigError("the model has no LoRA adapters to save (tessera.lora.apply puts them on)")
    state = full_state_dict(source, select=_is_adapter_key)
    folder = Path(folder)
    if not has_context() or get_context().rank == 0:  # one process, or rank 0 writes
        first: Any = layers[0][1] if layers else experts[0][1]
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": first.rank,
            "lora_alpha": first.alpha,
            "lora_dropout": float(getattr(first.lora_dropout, "p", 0.0)),
            "target_modules": sorted(name for name, _ in [*layers, *experts]),
            "fan_in_fan_out": any(layer.transposed for _, layer in layers),
            "bias": "none",
            "modules_to_save": None,
            "init_lora_weights": True,
            "inference_mode": True,
            "base_model_name_or_path": base_model,
        }  # fmt: skip
        folder.mkdir(parents=True, exist_ok=True)
        save_weights({_PREFIX + key: value.contiguous() for key, value in state.items()}, folder / WEIGHTS)
        write_atomically(folder / CONFIG, json.dumps(config, indent=2) + "\n")
    return folder


def read_adapters(folder: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A PEFT LoRA folder's config and its weights under tessera's keys."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / CONFIG).is_file() or not (folder / WEIGHTS).is_file():
        raise ConfigError(f"{folder} is not a PEFT adapter folder: it needs {CONFIG} and {WEIGHTS}")
    config = json.loads((folder / CONFIG).read_text())
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"{folder}: peft_type {config.get('peft_type')!r} is not LORA")
    weights = load_file(str(folder / WEIGHTS))
    state = {}
    for key, value in weights.items():
        name = key.removeprefix(_PREFIX)
        state[name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")] = value
    return config, state


def load_adapters(model: nn.Module, folder: str | Path) -> nn.Module:
    """Put a PEFT LoRA folder's adapters on ``model``: a model without adapters gets them first
    as the folder's config says (before ``tessera.initialize``); a model with adapters (in any
    layout) takes their values. Raises ConfigError naming the adapters whose shapes do not fit
    this base (a folder saved from another model)."""
    config, state = read_adapters(folder)
    module = _module_of(model)
    if not adapters(module) and not adapted_experts(module):
        targets = config.get("target_modules") or ()
        targets = (targets,) if isinstance(targets, str) else tuple(targets)
        apply(module, LoraOptions(rank=int(config["r"]), alpha=float(config["lora_alpha"]), targets=targets))
    expected: dict[str, tuple[int, ...]] = {}
    for name, layer in adapters(module):
        expected[f"{name}.lora_A.weight"] = (layer.rank, layer.in_features)
        expected[f"{name}.lora_B.weight"] = (layer.out_features, layer.rank)
    for name, experts in adapted_experts(module):
        expected.update({f"{name}.{key}": shape for key, shape in experts.factor_shapes().items()})
    check_fit(folder, module, state, expected)
    load_full_state_dict(module, state, partial=True)
    return module


def check_fit(
    folder: str | Path, model: nn.Module, state: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]]
) -> None:
    """ConfigError unless every tensor of ``state`` (an adapter folder's, tessera's keys) has the
    shape ``expected`` gives its key, naming the tensors whose shapes differ and those ``model``
    has no place for (a folder saved from another base)."""
    wrong = [f"{k}: {tuple(v.shape)} in the folder, {expected[k]} here" for k, v in state.items()
             if k in expected and tuple(v.shape) != expected[k]]  # fmt: skip
    unknown = sorted(set(state) - set(expected))
    if wrong or unknown:
        details = "; ".join(wrong + [f"{k}: no such adapter here" for k in unknown[:5]])
        raise ConfigError(f"the adapters in {folder} do not fit this model ({type(model).__name__}): {details}")


def merged_state_dict(source: Any) -> dict[str, torch.Tensor]:
    """The full state dict of ``source``'s model with every adapter folded into its base
    (``W + B A * alpha / r``) under the plain model's keys: what ``merge_and_unload`` gives.
    A quantized base (:mod:`tessera.lora.quant`) is dequantized first: its weight is then
    float32, in its layer's own shape. Collective."""
    module = _module_of(source)
    layers, experts = dict(adapters(module)), dict(adapted_experts(module))
    state = full_state_dict(source)
    merged: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if _is_adapter_key(key):
            continue
        name, _, leaf = key.rpartition(".")
        owner = name.removesuffix(".base_layer")
        layer = layers.get(owner) if name.endswith(".base_layer") else None
        quantized = layer is not None and isinstance(layer.base_layer, QuantizedLinear)
        if quantized and leaf != "bias":  # its codes and scales: the dequantized weight, once
            if leaf == "codes":
                merged[f"{owner}.weight"] = _merged_quantized(layer, state, owner)
            continue
        if layer is not None and leaf == "weight":
            delta = _delta(layer, state, owner)  # [out, in]; a Conv1D's weight is [in, out]
            value = (value.float() + (delta.t() if layer.transposed else delta)).to(value.dtype)
        elif name.endswith(".base_layer") and owner in experts:  # a stacked projection, [experts, in, out]
            a, b = state[f"{owner}.lora_A.{leaf}.weight"].float(), state[f"{owner}.lora_B.{leaf}.weight"].float()
            value = (value.float() + experts[owner].delta(leaf, a, b)).to(value.dtype)
        merged[key.replace(".base_layer.", ".")] = value
    return merged


def _delta(layer: Any, state: dict[str, torch.Tensor], owner: str) -> torch.Tensor:
    a, b = state[f"{owner}.lora_A.weight"].float(), state[f"{owner}.lora_B.weight"].float()
    return (b @ a) * layer.scaling


def _merged_quantized(layer: Any, state: dict[str, torch.Tensor], owner: str) -> torch.Tensor:
    """A quantized base's dequantized ``[out, in]`` weight plus its adapter, in its layer's shape
    (a Conv1D's ``[in, out]``), from the full state's codes (whole there whatever the layout)."""
    base: QuantizedLinear = layer.base_layer
    codes = {name: state[f"{owner}.base_layer.{name}"] for name, _ in base.named_buffers()}
    weight = base.weight_value(torch.float32, codes).cpu() + _delta(layer, state, owner)
    return weight.t().contiguous() if base.from_conv1d else weight


__all__ = ["check_fit", "load_adapters", "merged_state_dict", "read_adapters", "save_adapters"]
