"""LoRA adapters in the planner's model description (docs/planner.md, "LoRA in the planner").

With :class:`Adapters` on a :class:`~tessera.planner.spec.ModelSpec` (the config's ``lora``
section), the model is two kinds of parameters, as ``tessera.lora.apply`` makes it:

- **trainable**: each adapted layer's ``A [r, in]`` and ``B [out, r]`` (``r (in + out)`` elements
  with the layer's full sizes; a fused q/k/v layer counts its fused width) and the
  ``modules_to_save``. They get gradients, fp32 masters and optimizer states, sharded as the
  layout shards trainable state.
- **frozen**: every other parameter, weights only. tessera keeps them in the dtype they were
  built in (fp32: neither ZeRO nor mixed precision casts a parameter the optimizer does not
  hold) or, for the adapted layers' weights, quantized (``lora.quantize``):
  :func:`quantized_bytes`. ZeRO 1-3 and Gemini leave them out of their chunks
  (``optimizer_entries(..., trainable=True)``): each rank of a data group holds the frozen base
  whole, as tensor and pipeline parallelism split it.

Layers are named as the model that a spec describes names them (tessera's GPT, Hugging Face's
LLaMA and GPT-2), and ``targets`` match them by PEFT's rule, as ``tessera.lora.apply`` does.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

from tessera.errors import ConfigError
from tessera.planner.lora_options import Adapters

if TYPE_CHECKING:
    from tessera.planner.layout import Layout
    from tessera.planner.spec import ModelSpec

#: bytes per frozen element: tessera builds (and loads) a model in fp32 and casts only what the
#: optimizer holds
FROZEN_BYTES = 4
NF4_BLOCK = 64  # elements per NF4 absmax (tessera.lora.quant)
ABSMAX_GROUP = 256  # double quantization: absmaxes per fp32 scale
COLUMN_ROLES = ("q", "k", "v", "qkv", "gate", "up")  # the others (out, down) are row-parallel

#: per naming scheme: a block's name (``{i}`` its index), its linear layers (path, role), and
#: the modules outside the blocks by part (what ``modules_to_save`` may name)
SCHEMES: dict[str, tuple[str, tuple[tuple[str, str], ...], dict[str, str]]] = {
    "tessera": (
        "blocks.{i}",
        (("attn.qkv", "qkv"), ("attn.out", "out"), ("mlp.fc", "up"), ("mlp.proj", "down")),
        {"tok_emb": "table", "pos_emb": "positions", "ln_f": "norm", "lm_head": "head"},
    ),
    "gpt2": (
        "transformer.h.{i}",
        (("attn.c_attn", "qkv"), ("attn.c_proj", "out"), ("mlp.c_fc", "up"), ("mlp.c_proj", "down")),
        {"transformer.wte": "table", "transformer.wpe": "positions", "transformer.ln_f": "norm", "lm_head": "head"},
    ),
    "llama": (
        "model.layers.{i}",
        (
            ("self_attn.q_proj", "q"),
            ("self_attn.k_proj", "k"),
            ("self_attn.v_proj", "v"),
            ("self_attn.o_proj", "out"),
            ("mlp.gate_proj", "gate"),
            ("mlp.up_proj", "up"),
            ("mlp.down_proj", "down"),
        ),
        {"model.embed_tokens": "table", "model.norm": "norm", "lm_head": "head"},
    ),
}


# ---- which layers ----------------------------------------------------------------------------------


def scheme(model: ModelSpec) -> str:
    """The naming of the model the spec describes: Hugging Face's LLaMA or GPT-2, or tessera's GPT."""
    if model.family == "llama":
        return "llama"
    if model.family == "gpt":
        return "gpt2" if model.name.startswith("hf:") or "GPT2" in model.name else "tessera"
    raise ConfigError(
        f"{model.name}: the planner describes LoRA adapters on GPT and LLaMA decoders, not {model.family}"
    )


def _matches(name: str, targets: tuple[str, ...]) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


def _sizes(model: ModelSpec, role: str) -> tuple[int, int]:
    """``(in, out)`` of a block's layer by its role (its full sizes)."""
    h, kv, ff = model.d_model, model.kv_dim, model.ff_dim
    return {"q": (h, h), "k": (h, kv), "v": (h, kv), "qkv": (h, h + 2 * kv), "out": (h, h),
            "gate": (h, ff), "up": (h, ff), "down": (ff, h)}[role]  # fmt: skip


@functools.lru_cache(maxsize=256)
def adapted_layers(model: ModelSpec) -> tuple[tuple[str, int, int], ...]:
    """``(role, in, out)`` of each adapted layer of a block (every block alike). ConfigError for a
    target that matches no layer, a rank over a layer's smaller side, the output head as a target,
    or targets that adapt blocks differently (which the planner does not describe)."""
    adapters = model.adapters
    if adapters is None:
        return ()
    prefix, layers, _ = SCHEMES[scheme(model)]
    targets = adapters.targets
    if targets == ("all-linear",):
        chosen = tuple(role for _, role in layers)
    else:
        per_block = {
            tuple(role for path, role in layers if _matches(f"{prefix.format(i=i)}.{path}", targets))
            for i in range(model.n_layers)
        }
        if len(per_block) > 1:
            raise ConfigError(f"lora.targets {list(targets)} adapt the blocks differently; the planner needs every "
                              "block adapted alike (name layers, not blocks)")  # fmt: skip
        chosen = per_block.pop()
        head = [t for t in targets if _matches("lm_head", (t,))]
        if head:
            raise ConfigError(f"lora.targets {head}: adapters on the output head are not in the planner yet")
        names = [f"{prefix.format(i=0)}.{path}" for path, _ in layers] + ["lm_head"]
        missing = [t for t in targets if not any(_matches(n, (t,)) for n in names)]
        if missing:
            suffixes = ", ".join(dict.fromkeys(path.rsplit(".", 1)[-1] for path, _ in layers))
            raise ConfigError(
                f"lora.targets {missing} match no linear layer of {model.name}; its layers are {suffixes}"
            )
    out = tuple((role, *_sizes(model, role)) for role in chosen)
    for role, fan_in, fan_out in out:
        if adapters.rank > min(fan_in, fan_out):
            raise ConfigError(f"lora.rank={adapters.rank} is over the smaller side of {role} ({fan_in} x {fan_out})")
    return out


@functools.lru_cache(maxsize=256)
def saved_parts(model: ModelSpec) -> frozenset[str]:
    """The parts outside the blocks that ``modules_to_save`` trains (``table``, ``positions``,
    ``norm``, ``head``; a tied table and head are one tensor: both or neither)."""
    adapters = model.adapters
    if adapters is None or not adapters.modules_to_save:
        return frozenset()
    ends = SCHEMES[scheme(model)][2]
    parts = {part for name, part in ends.items() if _matches(name, adapters.modules_to_save)}
    missing = [t for t in adapters.modules_to_save if not any(_matches(n, (t,)) for n in ends)]
    if missing:
        raise ConfigError(f"lora.modules_to_save {missing}: the planner describes saving {', '.join(ends)}")
    if model.tie_weights and parts & {"table", "head"}:
        parts |= {"table", "head"}
    return frozenset(parts)


# ---- counts for the whole model -----------------------------------------------------------------------


def adapter_block_params(model: ModelSpec) -> int:
    """Adapter elements of one block: ``r (in + out)`` for each adapted layer."""
    r = model.adapters.rank if model.adapters else 0
    return sum(r * (fan_in + fan_out) for _, fan_in, fan_out in adapted_layers(model))


def trainable_block_params(model: ModelSpec) -> int:
    """Elements of one block that train: its adapters, or every parameter without adapters."""
    return adapter_block_params(model) if model.adapters else model.block_params()


def _end_elements(model: ModelSpec) -> dict[str, int]:
    """Elements of the parts outside the blocks (a tied head counted once, in ``table``)."""
    table = model.vocab_size * model.d_model
    head = 0 if model.tie_weights else model.vocab_size * model.d_model
    return {"table": table, "positions": model.embedding_params() - table, "norm": model.norm_params(), "head": head}


def trainable_parameters(model: ModelSpec) -> int:
    """Elements that train: the adapters and ``modules_to_save`` (everything without adapters)."""
    if model.adapters is None:
        return model.num_parameters()
    ends = _end_elements(model)
    return model.n_layers * adapter_block_params(model) + sum(ends[p] for p in saved_parts(model))


def frozen_parameters(model: ModelSpec) -> int:
    """Elements of the frozen base (the model's own parameters that do not train)."""
    if model.adapters is None:
        return 0
    return model.num_parameters() - sum(_end_elements(model)[p] for p in saved_parts(model))


def quantized_bytes(fan_out: int, fan_in: int, fmt: str, double_quant: bool = False) -> int:
    """Bytes of a ``[out, in]`` weight quantized as ``tessera.lora.quant`` stores it: int8 codes and
    an fp32 scale per output row; NF4 codes two to a byte and an fp32 absmax per 64 elements, or
    with ``double_quant`` int8 absmax codes, an fp32 scale per 256 of them and their fp32 mean."""
    n = fan_out * fan_in
    if fmt == "int8":
        return n + 4 * fan_out
    if fmt != "nf4":
        return n * FROZEN_BYTES
    blocks = math.ceil(n / NF4_BLOCK)
    absmax = blocks + 4 * math.ceil(blocks / ABSMAX_GROUP) + 4 if double_quant else 4 * blocks
    return math.ceil(n / 2) + absmax


def adapted_weights_per_block(model: ModelSpec) -> int:
    """Weight elements of one block's adapted layers (what quantization stores as codes)."""
    return sum(fan_in * fan_out for _, fan_in, fan_out in adapted_layers(model))


def quantized_block_bytes(model: ModelSpec) -> int:
    """Bytes of one block's adapted weights as stored (quantized, or fp32 without ``quantize``)."""
    a = model.adapters
    if a is None:
        return 0
    return sum(quantized_bytes(o, i, a.quantize, a.double_quant) for _, i, o in adapted_layers(model))


def frozen_bytes(model: ModelSpec) -> int:
    """Bytes of the whole frozen base: fp32, the adapted weights as :func:`quantized_block_bytes`."""
    if model.adapters is None:
        return 0
    adapted = model.n_layers * adapted_weights_per_block(model)
    return (frozen_parameters(model) - adapted) * FROZEN_BYTES + model.n_layers * quantized_block_bytes(model)


# ---- one rank ---------------------------------------------------------------------------------------------


def adapter_local(model: ModelSpec, layout: Layout) -> float:
    """Adapter elements of one block on a tensor rank: under 1d a column layer's ``B`` is split on
    ``out`` (``A`` whole), a row layer's ``A`` on ``in`` (``B`` whole); in the grid modes both
    factors are the mode's linears (split as its matrices)."""
    r, t = (model.adapters.rank if model.adapters else 0), layout.tensor
    if layout.tensor_mode != "1d":
        return adapter_block_params(model) / layout.splits[0]
    total = 0.0
    for role, fan_in, fan_out in adapted_layers(model):
        total += r * fan_in + r * fan_out / t if role in COLUMN_ROLES else r * fan_in / t + r * fan_out
    return total


def tensor_refusal(model: ModelSpec) -> str | None:
    """Why adapters on this model cannot be split by tensor parallelism today, or None."""
    a = model.adapters
    if a is None:
        return None
    if a.quantize != "none":
        return "a quantized frozen base cannot be split by tensor parallelism (lora.quantize needs tensor size 1)"
    if scheme(model) == "tessera":
        return "LoRA adapters do not yet follow tessera's own tensor-parallel layers (tensor size 1 for gpt: presets)"
    return None


def describe(model: ModelSpec) -> str:
    """One line: the adapters, trainable and frozen parameters, the frozen base's bytes."""
    a = model.adapters
    if a is None:
        return ""
    roles = ", ".join(role for role, _, _ in adapted_layers(model))
    trainable, frozen = trainable_parameters(model), frozen_parameters(model)
    share = 100 * trainable / max(1, trainable + frozen)
    base = frozen_bytes(model)
    line = (
        f"lora: rank {a.rank} on {roles} in each of {model.n_layers} blocks; trainable {_count(trainable)} "
        f"parameters ({share:.2f}%); frozen {_count(frozen)} parameters, {_gib(base)} (weights only)"
    )
    if a.quantize != "none":
        weights = model.n_layers * adapted_weights_per_block(model)
        kind = a.quantize + (" double-quantized" if a.double_quant else "")
        line += (
            f"; quantized base {_count(weights)} weights in {kind}: {_gib(model.n_layers * quantized_block_bytes(model))}"
            f" of {_gib(weights * FROZEN_BYTES)} in fp32"
        )
    return line


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:,.2f}{unit}"
    return f"{n:,.0f}"


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**29 else f"{n / 2**20:,.1f} MiB"


__all__ = [
    "Adapters",  # tessera.planner.lora_options.Adapters, here beside what counts from it
    "adapted_layers",
    "describe",
    "frozen_bytes",
    "frozen_parameters",
    "quantized_bytes",
    "trainable_parameters",
]
