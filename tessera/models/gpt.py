"""A GPT-style decoder, the reference model that the parallel strategies split.

Pre-norm transformer blocks (LayerNorm -> causal self-attention -> residual, LayerNorm -> MLP ->
residual), learned position embeddings, GPT-2 initialisation and an output head tied to the
token embedding. The ``gpt2*`` presets match the published GPT-2 sizes parameter for parameter.
With ``num_experts`` the blocks' MLPs are mixtures of experts (``tessera.nn.MoE``; the ``*-moe``
presets: Mixtral-style top-2 of 8 SwiGLU experts), spread over the ``expert`` axis.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
from torch import nn

from tessera import nn as tnn
from tessera.context.placement import full_numel
from tessera.engine.flops import matmul_parameters, transformer_flops_per_token
from tessera.errors import ConfigError
from tessera.models.transformer import Block, StagePart, gpt2_rule, reset_in_full


def _field(default: Any, doc: str) -> Any:
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = _field(256, "Number of token ids; 256 for byte-level text.")
    max_seq_len: int = _field(128, "Longest sequence the position embedding covers.")
    d_model: int = _field(128, "Width of the residual stream.")
    n_layers: int = _field(4, "Number of transformer blocks.")
    n_heads: int = _field(4, "Attention heads per block; must divide d_model.")
    d_ff: int | None = _field(None, "Hidden width of the MLP; None means 4 * d_model (see `ff_dim`).")
    dropout: float = _field(0.0, "Dropout on embeddings, attention weights and residual branches (training only).")
    attention_dropout: float | None = _field(
        None, "Dropout on the attention weights alone; None: `dropout` (sequence parallelism needs 0)."
    )
    tie_weights: bool = _field(True, "Share one matrix between the token embedding and the output head.")
    layer_norm_eps: float = _field(1e-5, "Epsilon of every LayerNorm.")
    num_experts: int = _field(
        0,
        "0: a dense MLP in every block; N > 0: mixture-of-experts MLPs of N experts, each `ff_dim` wide (docs/moe.md).",
    )
    moe_top_k: int = _field(2, "MoE: experts each token is routed to (1: Switch, 2: Mixtral).")
    moe_capacity_factor: float | None = _field(
        1.25, "MoE: slots per expert as a multiple of an even share of the assignments; None: no token dropped."
    )
    moe_activation: Literal["gelu", "swiglu"] = _field("swiglu", "MoE: the experts' MLP (swiglu: Mixtral's).")
    moe_every: int = _field(1, "MoE: every k-th block has the MoE MLP (blocks k-1, 2k-1, ...); the others dense.")
    moe_aux_loss_weight: float = _field(1e-2, "MoE: weight of the load-balancing loss.")
    moe_z_loss_weight: float = _field(1e-3, "MoE: weight of the router z-loss.")

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_seq_len", "d_model", "n_layers", "n_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)} must be at least 1")
        if self.d_ff is not None and self.d_ff < 1:
            raise ValueError(f"GPTConfig.d_ff={self.d_ff} must be at least 1 (or None for 4 * d_model)")
        if self.d_model % self.n_heads:
            raise ValueError(f"GPTConfig.d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout} must be in [0, 1)")
        if self.attention_dropout is not None and not 0.0 <= self.attention_dropout < 1.0:
            raise ValueError(f"GPTConfig.attention_dropout={self.attention_dropout} must be in [0, 1)")
        if self.layer_norm_eps <= 0:
            raise ValueError(f"GPTConfig.layer_norm_eps={self.layer_norm_eps} must be positive")
        if self.num_experts < 0 or self.moe_every < 1:
            raise ValueError(
                f"GPTConfig.num_experts={self.num_experts} must be >= 0 and moe_every={self.moe_every} >= 1"
            )
        if self.num_experts and not 1 <= self.moe_top_k <= self.num_experts:
            raise ValueError(
                f"GPTConfig.moe_top_k={self.moe_top_k} must be between 1 and num_experts={self.num_experts}"
            )

    def is_moe_block(self, index: int) -> bool:
        """Whether block ``index`` has the mixture-of-experts MLP."""
        return self.num_experts > 0 and (index + 1) % self.moe_every == 0

    @property
    def ff_dim(self) -> int:
        """The MLP hidden width: ``d_ff``, or ``4 * d_model`` when ``d_ff`` is None.

        Resolved here rather than stored so that overriding ``d_model`` also rescales the MLP."""
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


PRESETS: dict[str, GPTConfig] = {
    # Byte-level sizes that train in seconds on a laptop CPU.
    "tiny": GPTConfig(vocab_size=256, max_seq_len=128, d_model=128, n_layers=4, n_heads=4),
    "small": GPTConfig(vocab_size=256, max_seq_len=256, d_model=256, n_layers=6, n_heads=8),
    # The GPT-2 family (Radford et al. 2019): 124M, 355M, 774M and 1.5B parameters.
    "gpt2": GPTConfig(vocab_size=50257, max_seq_len=1024, d_model=768, n_layers=12, n_heads=12),
    "gpt2-medium": GPTConfig(vocab_size=50257, max_seq_len=1024, d_model=1024, n_layers=24, n_heads=16),
    "gpt2-large": GPTConfig(vocab_size=50257, max_seq_len=1024, d_model=1280, n_layers=36, n_heads=20),
    "gpt2-xl": GPTConfig(vocab_size=50257, max_seq_len=1024, d_model=1600, n_layers=48, n_heads=25),
    # Mixtral-style blocks: 8 SwiGLU experts, each token routed to 2 (active MLP: 2 x 3 x d x ff).
    "tiny-moe": GPTConfig(vocab_size=256, max_seq_len=128, d_model=128, n_layers=4, n_heads=4, d_ff=256, num_experts=8),
    "small-moe": GPTConfig(
        vocab_size=256, max_seq_len=256, d_model=256, n_layers=6, n_heads=8, d_ff=512, num_experts=8
    ),
}


class GPT(nn.Module):
    """Decoder-only language model: token ids [batch, seq] -> next-token logits [batch, seq, vocab].

    Built from ``tessera.nn`` layers, so the same definition runs in every tensor-parallel mode;
    there the logits are this rank's piece (split over the vocabulary and as the mode's layout
    splits the batch), to be fed to ``tessera.nn.VocabParallelCrossEntropyLoss``. The initial
    weights depend on the seed only, not on the layout.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = tnn.VocabParallelEmbedding(config.vocab_size, config.d_model)
        self.pos_emb = tnn.Embedding(config.max_seq_len, config.d_model)
        self.dropout = tnn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            Block(
                config.d_model,
                config.n_heads,
                config.ff_dim,
                config.dropout,
                config.layer_norm_eps,
                causal=True,
                attention_dropout=config.attention_dropout,
                mlp=self._moe(config) if config.is_moe_block(i) else None,
            )
            for i in range(config.n_layers)
        )
        self.ln_f = tnn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        tied = self.tok_emb.weight if config.tie_weights else None
        assert tied is None or isinstance(tied, nn.Parameter)
        self.lm_head = tnn.VocabParallelClassifier(config.d_model, config.vocab_size, bias=False, weight=tied)
        self.reset_parameters()

    @staticmethod
    def _moe(config: GPTConfig) -> nn.Module:
        return tnn.MoE(
            config.d_model,
            config.ff_dim,
            config.num_experts,
            top_k=config.moe_top_k,
            capacity_factor=config.moe_capacity_factor,
            activation=config.moe_activation,
            aux_loss_weight=config.moe_aux_loss_weight,
            z_loss_weight=config.moe_z_loss_weight,
        )

    def reset_parameters(self) -> None:
        """GPT-2 initialisation, drawn in full and sharded, so every layout starts alike."""
        reset_in_full(self, gpt2_rule(self.config.n_layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids [batch, seq] (int64, seq <= max_seq_len) -> logits [batch, seq, vocab_size]."""
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def embed(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids -> the first block's input (token plus position embeddings). ``positions``
        [batch, seq]: each token's position (generation, after cached tokens); default: the
        tokens are a sequence's first ``seq``."""
        batch, seq = idx.shape  # this rank's tokens under sequence parallelism: global positions
        if positions is None:
            positions = tnn.positions(seq, idx.device).expand(batch, seq)
        # reading the largest position would break a compiled graph: there the embedding's own
        # index check fails instead
        if not torch.compiler.is_compiling() and int(positions.max()) >= self.config.max_seq_len:
            raise ValueError(
                f"sequence length {int(positions.max()) + 1} exceeds max_seq_len={self.config.max_seq_len}"
            )
        return self.dropout(tnn.enter_sequence_parallel(self.tok_emb(idx) + self.pos_emb(positions)))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The last block's output -> logits."""
        return self.lm_head(tnn.exit_sequence_parallel(self.ln_f(x)))

    def pipeline_layers(self) -> list[nn.Module]:
        """The model as layers for pipeline stages: embeddings, each block, head (the head's
        weight stays tied to the embedding across stages)."""
        embed = StagePart(self.embed, tok_emb=self.tok_emb, pos_emb=self.pos_emb, dropout=self.dropout)
        head = StagePart(self.head, ln_f=self.ln_f, lm_head=self.lm_head)
        return [embed, *self.blocks, head]

    def num_parameters(self) -> int:
        """Number of parameter elements of the full model, counting a tied (shared) weight once."""
        unique = {id(p): p for p in self.parameters()}
        return sum(full_numel(p) for p in unique.values())

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward and backward) at sequences of ``seq_len`` tokens
        (default ``max_seq_len``): ``6 N + 4 F + 12 L d s`` (:func:`tessera.engine.flops.
        transformer_flops_per_token`). N: every trained parameter but the position embedding (a
        lookup) and, untied, the token embedding (a lookup too; tied, it is the head's product
        and counts once); MoE experts at ``moe_top_k / num_experts``; F: frozen ones (a LoRA base)."""
        tables = [self.pos_emb] if self.config.tie_weights else [self.pos_emb, self.tok_emb]
        counts = matmul_parameters(self, [cast(torch.Tensor, table.weight) for table in tables])
        seq = seq_len if seq_len is not None else self.config.max_seq_len
        return transformer_flops_per_token(
            counts.trained, self.config.n_layers, self.config.d_model, seq, frozen_params=counts.frozen
        )


def pipeline_layer_count(preset: str = "tiny", overrides: dict[str, Any] | None = None) -> int:
    """How many layers ``GPT.pipeline_layers()`` gives for this preset: embedding, blocks, head."""
    if preset not in PRESETS:
        raise ConfigError(f"model.preset={preset!r} is not a GPT preset; presets: {', '.join(PRESETS)}")
    n_layers = (overrides or {}).get("n_layers", PRESETS[preset].n_layers)
    return int(n_layers) + 2


def preset_config(preset: str, **overrides: Any) -> GPTConfig:
    """The config of a preset with fields replaced by ``overrides``; unknown presets and unknown
    fields raise ConfigError (a ValueError) naming them."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown GPT preset {preset!r}; presets: {', '.join(PRESETS)}")
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ConfigError(f"unknown GPTConfig field(s) {', '.join(unknown)}; fields: {', '.join(sorted(fields))}")
    return dataclasses.replace(PRESETS[preset], **overrides)


def gpt(preset: str = "tiny", **overrides: Any) -> GPT:
    """Build a GPT from a preset name, replacing config fields with ``overrides``.

    ``gpt("tiny", n_layers=2)``; unknown presets and unknown fields raise ValueError naming them."""
    return GPT(preset_config(preset, **overrides))
