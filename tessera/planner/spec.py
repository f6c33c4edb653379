"""What the planner plans for: a model's shape (:class:`ModelSpec`), the machines
(:class:`Cluster`) and the training step (:class:`Workload`).

A :class:`ModelSpec` describes a transformer by its sizes only, so that a 70B model is planned
without building it: from tessera's GPT and ViT presets (:func:`from_gpt_preset`,
:func:`from_vit_preset`), from a Hugging Face ``config.json`` (:func:`from_hf_config`), or
measured from a module (:func:`tessera.planner.traced.from_module`: sizes read off its parameters,
activations traced).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tessera.errors import ConfigError
from tessera.planner.lora_options import Adapters

Family = Literal["gpt", "llama", "vit", "bert"]


@dataclass(frozen=True)
class ModelSpec:
    """A transformer by its sizes. ``seq_len`` is the tokens of one sample (a ViT: patches + 1).

    ``gated_mlp``: a SwiGLU MLP (three matrices of ``d_model x ff_dim``, LLaMA) instead of two;
    ``norm``: "layernorm" (weight and bias) or "rmsnorm" (weight); ``learned_positions``: a
    position table of ``max_positions x d_model`` (GPT, BERT, ViT) rather than rotary ones."""

    name: str
    family: Family
    n_layers: int
    d_model: int
    n_heads: int
    ff_dim: int
    vocab_size: int
    seq_len: int
    n_kv_heads: int | None = None
    gated_mlp: bool = False
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    biases: bool = True
    tie_weights: bool = True
    learned_positions: bool = True
    max_positions: int | None = None
    num_classes: int = 0  # ViT: the head's outputs (vocab_size is 0)
    patch_dim: int = 0  # ViT: channels x patch x patch, the patch embedding's input
    #: saved-activation bytes per token of one block measured by ``traced.from_module`` (fp32,
    #: one rank); None: the formula of :mod:`tessera.planner.memory`
    traced_block_bytes_per_token: float | None = None
    #: LoRA adapters on a frozen base (the config's ``lora`` section; :mod:`tessera.planner.adapters`)
    adapters: Adapters | None = None

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "ff_dim", "seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model {self.name}: {name}={getattr(self, name)} must be at least 1")
        if self.d_model % self.n_heads:
            raise ConfigError(f"model {self.name}: d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.kv_heads < 1 or self.n_heads % self.kv_heads:
            raise ConfigError(f"model {self.name}: n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_dim(self) -> int:
        """Width of the keys (and of the values): ``kv_heads * head_dim``."""
        return self.kv_heads * self.head_dim

    # ---- parameters ------------------------------------------------------------------------

    def norm_params(self) -> int:
        return self.d_model * (2 if self.norm == "layernorm" else 1)

    def attention_matrix_params(self) -> int:
        """Elements of the attention's weight matrices: q, k, v and the output projection."""
        h = self.d_model
        return h * h + 2 * h * self.kv_dim + h * h

    def mlp_matrix_params(self) -> int:
        return (3 if self.gated_mlp else 2) * self.d_model * self.ff_dim

    def block_matrix_params(self) -> int:
        return self.attention_matrix_params() + self.mlp_matrix_params()

    def block_vector_params(self) -> int:
        """Elements of one block's biases and norms (what tensor parallelism may replicate)."""
        h = self.d_model
        biases = (h + 2 * self.kv_dim + h + (2 if self.gated_mlp else 1) * self.ff_dim + h) if self.biases else 0
        return biases + 2 * self.norm_params()

    def block_params(self) -> int:
        return self.block_matrix_params() + self.block_vector_params()

    def embedding_params(self) -> int:
        """The token embedding (a ViT: the patch projection and its bias, the class token) and the
        learned position table."""
        positions = (self.max_positions or self.seq_len) * self.d_model if self.learned_positions else 0
        if self.family == "vit":
            return self.patch_dim * self.d_model + self.d_model + self.d_model + positions
        return self.vocab_size * self.d_model + positions

    def head_params(self) -> int:
        """The final norm and the output layer (nothing more when it is tied to the embedding)."""
        if self.family == "vit":
            return self.norm_params() + self.d_model * self.num_classes + self.num_classes
        return self.norm_params() + (0 if self.tie_weights else self.vocab_size * self.d_model)

    def num_parameters(self) -> int:
        return self.embedding_params() + self.n_layers * self.block_params() + self.head_params()

    @property
    def outputs(self) -> int:
        """Width of the logits: the vocabulary, or a ViT's classes."""
        return self.num_classes if self.family == "vit" else self.vocab_size

    # ---- compute ---------------------------------------------------------------------------

    def block_forward_flops(self, tokens: int, seq_len: int | None = None) -> float:
        """Floating-point operations of one block's forward over ``tokens`` tokens in sequences of
        ``seq_len``: 2 per multiply-add of the matrices, and the attention's two products
        (scores and weighted values), halved when causal (the masked half is skipped)."""
        seq = seq_len or self.seq_len
        matmul = 2.0 * tokens * self.block_matrix_params()
        attention = 4.0 * tokens * seq * self.d_model * (0.5 if self.causal else 1.0)
        return matmul + attention

    def head_forward_flops(self, tokens: int) -> float:
        rows = tokens if self.family != "vit" else tokens / self.seq_len  # a ViT classifies one token a sample
        return 2.0 * rows * self.d_model * self.outputs

    @property
    def causal(self) -> bool:
        return self.family in ("gpt", "llama")

    def describe(self) -> str:
        return (
            f"{self.name}: {self.num_parameters() / 1e6:,.1f}M parameters, {self.n_layers} layers, "
            f"d_model {self.d_model}, {self.n_heads} heads, seq {self.seq_len}"
        )


# ---- model sources -------------------------------------------------------------------------


def from_gpt_preset(preset: str, seq_len: int | None = None, **overrides: Any) -> ModelSpec:
    """tessera's reference GPT (``tessera.models.gpt``'s presets, with field overrides)."""
    from tessera.models.gpt import preset_config

    cfg = preset_config(preset, **overrides)
    if cfg.num_experts:
        raise ConfigError(
            f"gpt:{preset} has mixture-of-experts blocks ({cfg.num_experts} experts), which the planner does not "
            "model yet: set the layout by hand (parallel.expert, docs/moe.md)"
        )
    return ModelSpec(
        name=f"gpt:{preset}",
        family="gpt",
        n_layers=cfg.n_layers,
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        ff_dim=cfg.ff_dim,
        vocab_size=cfg.vocab_size,
        seq_len=seq_len or cfg.max_seq_len,
        max_positions=cfg.max_seq_len,
        tie_weights=cfg.tie_weights,
    )


def from_vit_preset(preset: str, **overrides: Any) -> ModelSpec:
    """tessera's ViT (``tessera.models.vit``'s presets)."""
    from tessera.models.vit import PRESETS

    if preset not in PRESETS:
        raise ConfigError(f"unknown ViT preset {preset!r}; presets: {', '.join(PRESETS)}")
    cfg = dataclasses.replace(PRESETS[preset], **overrides)
    patches = (cfg.img_size // cfg.patch_size) ** 2
    return vit_spec(
        f"vit:{preset}",
        n_layers=cfg.n_layers,
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        ff_dim=cfg.ff_dim,
        patches=patches,
        patch_dim=cfg.in_chans * cfg.patch_size**2,
        num_classes=cfg.num_classes,
    )


def vit_spec(
    name: str, *, n_layers: int, d_model: int, n_heads: int, ff_dim: int, patches: int, patch_dim: int, num_classes: int
) -> ModelSpec:
    """A ViT of the given sizes: ``patches`` tokens and a class token per image."""
    return ModelSpec(
        name=name,
        family="vit",
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        ff_dim=ff_dim,
        vocab_size=0,
        seq_len=patches + 1,
        num_classes=num_classes,
        patch_dim=patch_dim,
        tie_weights=False,
    )


def llama_spec(
    name: str,
    *,
    n_layers: int,
    d_model: int,
    n_heads: int,
    ff_dim: int,
    vocab_size: int,
    seq_len: int,
    n_kv_heads: int | None = None,
) -> ModelSpec:
    """A LLaMA-shaped decoder: RMSNorm, rotary positions, SwiGLU MLP, no biases, untied head."""
    return ModelSpec(
        name=name,
        family="llama",
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ff_dim=ff_dim,
        vocab_size=vocab_size,
        seq_len=seq_len,
        gated_mlp=True,
        norm="rmsnorm",
        biases=False,
        tie_weights=False,
        learned_positions=False,
    )


#: well-known shapes to plan for without a config file (``tessera plan --model llama:70b``)
NAMED: dict[str, Any] = {
    "llama:7b": lambda: llama_spec(
        "llama:7b", n_layers=32, d_model=4096, n_heads=32, ff_dim=11008, vocab_size=32000, seq_len=4096
    ),
    "llama:13b": lambda: llama_spec(
        "llama:13b", n_layers=40, d_model=5120, n_heads=40, ff_dim=13824, vocab_size=32000, seq_len=4096
    ),
    "llama:70b": lambda: llama_spec(
        "llama:70b",
        n_layers=80,
        d_model=8192,
        n_heads=64,
        n_kv_heads=8,
        ff_dim=28672,
        vocab_size=32000,
        seq_len=4096,
    ),
    # GPT-3 175B (Brown et al. 2020), as in the Colossal-AI paper's GPT-3 runs
    "gpt3:175b": lambda: ModelSpec(
        name="gpt3:175b",
        family="gpt",
        n_layers=96,
        d_model=12288,
        n_heads=96,
        ff_dim=4 * 12288,
        vocab_size=50257,
        seq_len=2048,
        max_positions=2048,
    ),
}


def from_hf_config(source: str | Path | dict[str, Any], seq_len: int | None = None) -> ModelSpec:
    """A spec from a Hugging Face ``config.json`` (a path to it or its folder, or the dict):
    LLaMA-family decoders (llama, mistral, qwen2), GPT-2, BERT and ViT configs."""
    if isinstance(source, dict):
        raw, where = source, "the config"
    else:
        path = Path(source)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ConfigError(f"{source}: no Hugging Face config.json there")
        raw, where = json.loads(path.read_text()), str(path)
    kind = str(raw.get("model_type", ""))
    name = f"hf:{raw.get('_name_or_path') or kind or 'model'}"
    if kind == "gpt2":
        d = int(raw["n_embd"])
        return ModelSpec(
            name=name,
            family="gpt",
            n_layers=int(raw["n_layer"]),
            d_model=d,
            n_heads=int(raw["n_head"]),
            ff_dim=int(raw.get("n_inner") or 4 * d),
            vocab_size=int(raw["vocab_size"]),
            seq_len=seq_len or int(raw["n_positions"]),
            max_positions=int(raw["n_positions"]),
            tie_weights=bool(raw.get("tie_word_embeddings", True)),
        )
    if kind in ("llama", "mistral", "qwen2", "qwen3"):
        spec = llama_spec(
            name,
            n_layers=int(raw["num_hidden_layers"]),
            d_model=int(raw["hidden_size"]),
            n_heads=int(raw["num_attention_heads"]),
            n_kv_heads=raw.get("num_key_value_heads"),
            ff_dim=int(raw["intermediate_size"]),
            vocab_size=int(raw["vocab_size"]),
            seq_len=seq_len or min(int(raw.get("max_position_embeddings", 4096)), 4096),
        )
        return dataclasses.replace(spec, tie_weights=bool(raw.get("tie_word_embeddings", False)))
    if kind == "bert":
        d = int(raw["hidden_size"])
        return ModelSpec(
            name=name,
            family="bert",
            n_layers=int(raw["num_hidden_layers"]),
            d_model=d,
            n_heads=int(raw["num_attention_heads"]),
            ff_dim=int(raw["intermediate_size"]),
            vocab_size=int(raw["vocab_size"]),
            seq_len=seq_len or int(raw.get("max_position_embeddings", 512)),
            max_positions=int(raw.get("max_position_embeddings", 512)),
        )
    if kind == "vit":
        image, patch = int(raw["image_size"]), int(raw["patch_size"])
        return vit_spec(
            name,
            n_layers=int(raw["num_hidden_layers"]),
            d_model=int(raw["hidden_size"]),
            n_heads=int(raw["num_attention_heads"]),
            ff_dim=int(raw["intermediate_size"]),
            patches=(image // patch) ** 2,
            patch_dim=int(raw.get("num_channels", 3)) * patch * patch,
            num_classes=len(raw.get("id2label", {})) or 1000,
        )
    raise ConfigError(
        f"{where}: model_type {kind!r} is not one the planner knows (llama, mistral, qwen2, qwen3, gpt2, bert, vit)"
    )


def resolve_model(name: str, seq_len: int | None = None) -> ModelSpec:
    """A spec from a name: ``gpt:PRESET``, ``vit:PRESET``, one of :data:`NAMED` (``llama:70b``,
    ``gpt3:175b``), or ``hf:PATH`` (a Hugging Face config.json or its folder)."""
    if name in NAMED:
        spec: ModelSpec = NAMED[name]()
        return dataclasses.replace(spec, seq_len=seq_len) if seq_len else spec
    kind, _, rest = name.partition(":")
    if kind == "gpt" and rest:
        return from_gpt_preset(rest, seq_len)
    if kind == "vit" and rest:
        return from_vit_preset(rest)
    if kind == "hf" and rest:
        return from_hf_config(rest, seq_len)
    raise ConfigError(
        f"model {name!r}: give gpt:PRESET, vit:PRESET, hf:PATH (a config.json or its folder) or one of "
        f"{', '.join(NAMED)}"
    )


# ---- the machines and the step ---------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """One kind of connection: bandwidth in bytes/s per rank (what one rank can send while all
    send) and the fixed cost of one message or collective call in seconds."""

    bandwidth: float
    latency: float

    def time(self, nbytes: float, calls: float = 1.0) -> float:
        return calls * self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Cluster:
    """The devices: ``devices`` in all, ``devices_per_node`` per node, each with
    ``device_memory`` bytes; ``flops`` is one device's sustained rate on the model's matmuls
    (measured by calibration, or a share of the peak); ``intra``/``inter``: links within a node
    and between nodes. ``host_memory``: per device, for offloaded optimizer states."""

    devices: int
    device_memory: int
    flops: float
    intra: Link
    inter: Link
    devices_per_node: int = 8
    host_memory: int | None = None
    #: bytes/s of host <-> device copies (offload); None: intra-node bandwidth
    host_link: float | None = None
    #: per-axis links measured by calibration (axis name -> Link); they override intra/inter
    axis_links: dict[str, Link] = field(default_factory=dict)
    #: rate of the optimizer's elementwise update, bytes of parameters per second (None: flops/8)
    optimizer_rate: float | None = None
    #: ranks sharing one core (CPU ranks over fewer cores, measured by calibration); 1: each its own
    ranks_per_core: float = 1.0
    #: seconds one block's forward and backward cost beyond their flops (dispatch and launches,
    #: small ops), once per micro-batch; measured by calibration, 0 otherwise
    block_overhead: float = 0.0
    #: a block's time under activation checkpointing ("full", "selective") over its time without,
    #: measured by calibration; a mode left out costs its recomputed flops
    recompute_cost: dict[str, float] = field(default_factory=dict)
    name: str = "cluster"

    def __post_init__(self) -> None:
        if self.devices < 1 or self.devices_per_node < 1:
            raise ConfigError(f"cluster: devices={self.devices} and devices_per_node must be at least 1")
        if self.devices > self.devices_per_node and self.devices % self.devices_per_node:
            raise ConfigError(
                f"cluster: devices={self.devices} is not a whole number of nodes of {self.devices_per_node}"
            )
        if self.device_memory <= 0 or self.flops <= 0:
            raise ConfigError("cluster: device_memory and flops must be positive")

    @property
    def nodes(self) -> int:
        return max(1, self.devices // self.devices_per_node)


@dataclass(frozen=True)
class Workload:
    """One optimizer step: ``global_batch`` samples of ``seq_len`` tokens (None: the model's);
    ``dtype`` of compute ("fp32", "bf16", "fp16"; master weights stay fp32) and the optimizer
    (its states per parameter: Adam two, SGD with momentum one)."""

    global_batch: int
    seq_len: int | None = None
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    optimizer: Literal["adam", "adamw", "sgd", "lamb", "lars"] = "adamw"

    def __post_init__(self) -> None:
        if self.global_batch < 1:
            raise ConfigError(f"workload: global_batch={self.global_batch} must be at least 1")

    @property
    def element_bytes(self) -> int:
        return 4 if self.dtype == "fp32" else 2

    @property
    def optimizer_states(self) -> int:
        """fp32 values the optimizer keeps per parameter."""
        return 1 if self.optimizer in ("sgd", "lars") else 2
