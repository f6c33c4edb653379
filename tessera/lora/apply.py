"""Putting adapters on a model: which layers, what stays trainable, and switching them off."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from tessera.errors import ConfigError
from tessera.lora.experts import LoraExperts, is_adapter_target
from tessera.lora.layers import LoraLinear, linear_features


@dataclass(frozen=True)
class LoraOptions:
    """``rank`` and ``alpha`` (the update is scaled by ``alpha / rank``), ``dropout`` on the
    adapters' input, ``targets``: the linear layers to adapt, by name (a layer matches a target
    equal to its name or to the end of it after a dot, PEFT's rule: ``"q_proj"`` matches
    ``model.layers.0.self_attn.q_proj``), or ``("all-linear",)`` for every linear layer except
    the output head; ``modules_to_save``: modules trained whole beside the adapters (a new
    classifier head), by the same rule; ``init``: see :class:`~tessera.lora.layers.LoraLinear`."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("all-linear",)
    modules_to_save: tuple[str, ...] = ()
    init: str = "default"


def _matches(name: str, targets: tuple[str, ...]) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


def linear_layers(model: nn.Module) -> list[str]:
    """The names of ``model``'s linear-like layers (what ``targets`` can name): linear layers
    (tessera's tensor-parallel ones and transformers' ``Conv1D`` included) and mixtures of
    experts' stacked experts (``tessera.nn.MoE``'s ``experts``: every projection of each)."""
    return [
        name for name, m in model.named_modules() if name and (linear_features(m) is not None or is_adapter_target(m))
    ]


def _unfollowed(model: nn.Module, targets: tuple[str, ...]) -> list[str]:
    """``name (class)`` of the modules of tessera's tensor-parallel layers that ``targets`` name
    but adapters do not follow (an output head, an embedding)."""
    return [
        f"{name} ({type(m).__name__})"
        for name, m in model.named_modules()
        if name and _matches(name, targets) and type(m).__module__.startswith("tessera.parallel.tensor.")
    ]


def _output_heads(model: nn.Module) -> set[str]:
    """The output head: the Hugging Face model's output embeddings, or a layer named ``lm_head``
    or ``head`` (tessera's models)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return {
        name for name, m in model.named_modules() if (head is not None and m is head) or name in ("lm_head", "head")
    }


def apply(model: nn.Module, options: LoraOptions | None = None, **settings: Any) -> nn.Module:
    """Put adapters on ``model``'s target layers (in place; also returned) and freeze every
    parameter but the adapters' and ``modules_to_save``'s. ``settings`` override ``options``'
    fields (``tessera.lora.apply(model, rank=16, targets=("q_proj", "v_proj"))``). Raises
    ConfigError when a target matches no layer (naming the model's linear layers) or a rank
    does not fit a layer."""
    options = replace(options or LoraOptions(), **settings)
    if isinstance(options.targets, str):
        options = replace(options, targets=(options.targets,))
    if any(isinstance(m, (LoraLinear, LoraExperts)) for m in model.modules()):
        raise ConfigError("the model already has LoRA adapters")
    linears = linear_layers(model)
    if options.targets == ("all-linear",):
        heads = _output_heads(model)
        chosen = [n for n in linears if n not in heads]
    else:
        chosen = [n for n in linears if _matches(n, options.targets)]
        missing = [t for t in options.targets if not any(_matches(n, (t,)) for n in chosen)]
        unfollowed = _unfollowed(model, tuple(missing))
        if unfollowed:
            raise ConfigError(
                f"lora.targets {missing}: LoRA adapters do not follow {', '.join(unfollowed)}; they follow linear "
                "layers (tessera's 1D column- and row-parallel and 2D/2.5D/3D grid linears included) and MoE experts"
            )
        if missing:
            suffixes = sorted({n.rsplit(".", 1)[-1] for n in linears})
            raise ConfigError(
                f"lora.targets {missing} match no linear layer of {type(model).__name__}; its linear layers "
                f"are named {', '.join(suffixes)} (for example {linears[0] if linears else 'none'})"
            )
    for p in model.parameters():
        p.requires_grad_(False)
    for name in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = getattr(parent, child)
        kind = LoraExperts if is_adapter_target(layer) else LoraLinear
        try:
            adapted = kind(layer, options.rank, options.alpha, options.dropout, options.init)
        except ValueError as error:
            raise ConfigError(f"{name}: {error}") from None
        setattr(parent, child, adapted)
    saved = [n for n, _ in model.named_modules() if n and _matches(n, options.modules_to_save)]
    missing = [t for t in options.modules_to_save if not any(_matches(n, (t,)) for n in saved)]
    if missing:
        raise ConfigError(f"lora.modules_to_save {missing} match no module of {type(model).__name__}")
    for name in saved:
        for p in model.get_submodule(name).parameters():
            p.requires_grad_(True)
    return model


def adapters(model: nn.Module) -> list[tuple[str, LoraLinear]]:
    """``(name, layer)`` for every adapted linear layer of ``model`` (adapted experts are
    :class:`~tessera.lora.experts.LoraExperts`)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLinear)]


@contextmanager
def disabled(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` with its adapters off inside the block: the frozen base alone (a reference model
    that shares the base's memory)."""
    layers: list[Any] = [m for m in model.modules() if isinstance(m, (LoraLinear, LoraExperts))]
    before = [m.enabled for m in layers]
    for m in layers:
        m.enabled = False
    try:
        yield model
    finally:
        for m, was in zip(layers, before):
            m.enabled = was


__all__ = ["LoraOptions", "adapters", "apply", "disabled", "linear_layers"]
