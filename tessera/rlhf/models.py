"""The models alignment needs beyond a causal LM: value models (the reward model and PPO's
critic) and the token log-probabilities of a policy whose logits are split over the vocabulary.

A :class:`ValueModel` is a transformer with a scalar head: ``input_ids [B, T] -> values [B, T]``,
one value per position (float32). The reward of a sequence is the value at its last real token
(:func:`sequence_values` with a batch's ``last_index``); PPO's critic uses every position. Two
backbones:

* tessera's GPT (:class:`GPTValueModel`): the GPT's embeddings, blocks and final LayerNorm, its
  LM head dropped. Built under a layout (any tensor mode), the GPT is split by itself; the
  final hidden states are gathered whole on every rank of the tensor group (1D already has them
  whole), so the head is a plain replicated ``nn.Linear(d_model, 1)``: every rank computes the
  same values and the same loss, and the head's gradient is whole on every rank, as tessera's
  strategies expect of a parameter that is not split.
* a Hugging Face causal LM or base model (:class:`HFValueModel`): its base model
  (``model.base_model``, kept under the model's ``base_model_prefix``, so its state-dict keys are
  the causal LM's) run with the attention mask, its last hidden states, and the head. The
  wrapper has no tessera policy of its own: built under a layout with a tensor, sequence or
  expert axis, it hands its base model to :func:`tessera.hf.apply.prepare` (``GPT2Model``,
  ``LlamaModel``, ... have policies), so ``tessera.initialize`` finds it split already.

The head ``score`` (``nn.Linear(d, 1)``; HF and TRL call a reward head ``score``) starts as
``N(0, 1 / sqrt(d + 1))`` with a zero bias, the reward head of Ziegler et al. (2019) and OpenAI's
lm-human-preferences; ``head_std=0`` gives a zero head (a critic whose first values are 0). It is
drawn whole from a generator seeded with ``head_seed``, not from the global stream: every rank,
in every layout, gets the same head, whatever was drawn before it.

Log-probabilities: tessera's GPT under 1D tensor parallelism returns its rank's block of the
vocabulary (``[B, T, V/P]``, ``tessera.nn.VocabParallelClassifier``); the log-softmax then needs a
log-sum-exp over the tensor group: :func:`vocab_parallel_token_logprobs`.
:func:`token_logprobs_fn` picks the function a model's logits need (Hugging Face models under
tessera's policies gather their logits whole: :func:`~tessera.rlhf.tokens.token_logprobs`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import partial
from typing import Any, cast

import torch
from torch import nn

from tessera import nn as tnn
from tessera.checkpoint import load_full_state_dict
from tessera.comm import AxisGroup
from tessera.context import ParallelContext
from tessera.context.placement import placement_of, round_up
from tessera.errors import ConfigError, NotAvailableError
from tessera.hf.apply import is_hf_model, prepare
from tessera.models.gpt import GPT, gpt
from tessera.parallel.tensor.common import class_parallel_cross_entropy, local_range
from tessera.parallel.tensor.tp1d.layers import VocabParallelClassifier1D
from tessera.rlhf.tokens import (
    LogprobsFn,
    check_logits_and_tokens,
    check_per_sequence,
    check_right_padded,
    shape_of,
    token_logprobs,
)

__all__ = [
    "GPTValueModel",
    "HFValueModel",
    "ValueModel",
    "sequence_values",
    "token_logprobs_fn",
    "value_head",
    "value_model",
    "vocab_parallel_token_logprobs",
]

#: ``fn(logits [B, T, V or V/P], tokens [B, T]) -> log-probs [B, T]``


# ---- the head -----------------------------------------------------------------------------------


def value_head(
    hidden_size: int,
    *,
    std: float | None = None,
    seed: int = 0,
    bias: bool = True,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> nn.Linear:
    """``nn.Linear(hidden_size, 1)``: weight ``N(0, std^2)`` (``std`` None: ``1 / sqrt(hidden_size
    + 1)``; 0: zeros), bias 0. Drawn in float32 on the CPU from a generator seeded with ``seed``,
    so the same on every rank and in every layout, then cast to ``dtype`` and moved to ``device``."""
    if std is None:
        std = 1.0 / math.sqrt(hidden_size + 1)
    if std < 0:
        raise ValueError(f"value_head: std must be >= 0 (0: a zero head), got {std}")
    head = nn.Linear(hidden_size, 1, bias=bias, dtype=dtype, device=device)
    weight = torch.randn((1, hidden_size), generator=torch.Generator().manual_seed(seed)).mul_(std)
    with torch.no_grad():
        head.weight.copy_(weight)
        if head.bias is not None:
            head.bias.zero_()
    return head


class ValueModel(nn.Module):
    """A transformer backbone with a scalar head ``score``: ``input_ids [B, T]`` (and
    ``attention_mask [B, T]``, 1 on real tokens) -> ``values [B, T]`` float32, a value per
    position, whole on every rank. The head runs outside autocast, in its parameters' dtype
    (float32 masters under mixed precision). Values at padded positions are whatever the head
    gives there (causal attention keeps them out of the real positions); the losses mask them.

    Subclasses give :meth:`hidden_states`; build them with :func:`value_model`."""

    score: nn.Linear

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The last layer's (normalised) hidden states ``[B, T, d]``, whole on every rank."""
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids [B, T]`` int64, ``attention_mask [B, T]`` (None: every token real) ->
        ``values [B, T]`` float32."""
        if input_ids.dim() != 2:
            raise ValueError(f"{type(self).__name__}: input_ids must be [B, T] (2-D), got shape {shape_of(input_ids)}")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"{type(self).__name__}: attention_mask has shape {shape_of(attention_mask)} but input_ids "
                f"has shape {shape_of(input_ids)}; they must match"
            )
        hidden = self.hidden_states(input_ids, attention_mask)
        with torch.autocast(hidden.device.type, enabled=False):  # the head in its own (master) dtype
            values = self.score(hidden.to(self.score.weight.dtype)).squeeze(-1)
        return values.float()

    def load_backbone(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load the backbone from a full state dict of the causal LM it was built on (single-process
        keys: ``tessera.checkpoint.full_state_dict(sft_model)``, a checkpoint's, Hugging Face's)
        into any layout, keeping the head: a reward model or critic from the SFT model. Keys the
        value model does not have (the LM head's) are left out; a backbone key missing from
        ``state`` raises KeyError. Call it before ``tessera.initialize``."""
        keys = set(self.state_dict())
        head = {f"score.{name}": p.detach() for name, p in self.score.named_parameters()}
        backbone = {k: v for k, v in state.items() if k in keys and k not in head}
        load_full_state_dict(self, backbone | head)


class GPTValueModel(ValueModel):
    """A value model on tessera's GPT: the GPT's ``tok_emb``, ``pos_emb``, ``dropout``, ``blocks``
    and ``ln_f`` (taken, not copied: build a GPT for the value model alone, or load the policy's
    weights into one, when the policy trains on), and a new head ``score``; the GPT's
    ``lm_head`` is left out. Parameter names are the GPT's, so a GPT's (full) state dict, less
    ``lm_head.*``, loads into the backbone as it is: a reward model from the SFT model.

    ``attention_mask`` may be given (batches carry one) but the GPT needs none: the rows must be
    right-padded (checked when it is given), and causal attention then keeps the padding out of
    the real positions. ``head_std``, ``head_seed``: :func:`value_head`."""

    def __init__(self, model: GPT, *, head_std: float | None = None, head_seed: int = 0) -> None:
        super().__init__()
        if not isinstance(model, GPT):
            raise TypeError(f"GPTValueModel takes a tessera GPT, got {type(model).__name__}")
        self.config = model.config
        self.tok_emb = model.tok_emb
        self.pos_emb = model.pos_emb
        self.dropout = model.dropout
        self.blocks = model.blocks
        self.ln_f = model.ln_f
        like = next(model.ln_f.parameters())
        self.score = value_head(self.config.d_model, std=head_std, seed=head_seed, dtype=like.dtype, device=like.device)

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        if attention_mask is not None:
            check_right_padded(type(self).__name__, attention_mask != 0)
        # the GPT's own embedding code, on the same modules (config, tok_emb, pos_emb, dropout)
        x = GPT.embed(cast(GPT, self), input_ids)
        for block in self.blocks:
            x = block(x)
        x = tnn.exit_sequence_parallel(self.ln_f(x))  # [b, s, d] as the GPT's head takes it
        full = (input_ids.shape[0], input_ids.shape[1], self.config.d_model)
        return tnn.gather_activation(x, full_shape=full)  # whole (1D: it is already)

    def pipeline_layers(self) -> list[nn.Module]:
        """Pipeline stages are not available for value models yet (the engine would cut the model
        by its ``blocks`` and pass on ``[B, T]`` values): refused, naming the layouts that work."""
        raise NotAvailableError(
            "parallel.pipeline.size > 1 with a value model: pipeline stages are not available for value "
            "models yet; use data, tensor (any mode) or sequence parallelism, ZeRO or Gemini"
        )


class HFValueModel(ValueModel):
    """A value model on a Hugging Face causal LM or base model (GPT-2, the LLaMA family, ...): its
    base model (``model.base_model``), registered under ``model.base_model_prefix`` (``transformer``
    for GPT-2, ``model`` for LLaMA: the causal LM's state-dict keys), and a new head ``score``;
    the LM head is dropped. ``forward`` runs the base model with ``attention_mask`` and puts the
    head on its last hidden states.

    Under a layout (``ctx``, default: the current context) with more than one tensor, sequence
    or expert rank, the base model is split here by its tessera policy
    (:func:`tessera.hf.apply.prepare`): build the optimizer afterwards. The base model must come
    unsplit (not through ``tessera.initialize`` already); pipeline stages are refused."""

    def __init__(
        self,
        model: nn.Module,
        *,
        head_std: float | None = None,
        head_seed: int = 0,
        ctx: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        if not is_hf_model(model):
            raise TypeError(f"HFValueModel takes a transformers model, got {type(model).__name__}")
        base = cast(nn.Module, getattr(model, "base_model", model))
        self.base_model_prefix: str = getattr(model, "base_model_prefix", "") or "model"
        self.add_module(self.base_model_prefix, base)
        self.config = getattr(base, "config", None)
        hidden_size = int(getattr(self.config, "hidden_size", 0))
        if hidden_size < 1:
            raise ValueError(f"HFValueModel: {type(model).__name__}'s config has no hidden_size")
        _split_base(base, tnn.resolve_context(ctx))  # ctx, else the current one, else None
        like = next(base.parameters())
        self.score = value_head(hidden_size, std=head_std, seed=head_seed, dtype=like.dtype, device=like.device)

    @property
    def backbone(self) -> nn.Module:
        """The Hugging Face base model."""
        return cast(nn.Module, getattr(self, self.base_model_prefix))

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        output = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        hidden = getattr(output, "last_hidden_state", None)
        return cast(torch.Tensor, output[0] if hidden is None else hidden)


def _split_base(base: nn.Module, ctx: ParallelContext | None) -> None:
    """Split the Hugging Face base model ``base`` for ``ctx`` by its policy (nothing to do with
    one tensor, sequence and expert rank); refuse pipeline stages and a model split already."""
    if ctx is None:
        return
    name = type(base).__name__
    if ctx.size("pipeline") > 1:
        raise NotAvailableError(
            f"parallel.pipeline.size={ctx.size('pipeline')}: pipeline stages are not available for value "
            f"models on {name} yet; use data, tensor or sequence parallelism, ZeRO or Gemini"
        )
    if not any(ctx.size(axis) > 1 for axis in ("tensor", "sequence", "expert")):
        return
    if any(placement_of(p).shard is not None for p in base.parameters()):
        raise ConfigError(
            f"HFValueModel: {name} is split for tensor parallelism already; pass the model as built "
            "(the value model splits its base model itself), not one through tessera.initialize"
        )
    prepare(base, None, ctx)


def value_model(
    source: GPT | str | nn.Module,
    *,
    head_std: float | None = None,
    head_seed: int = 0,
    ctx: ParallelContext | None = None,
    **overrides: Any,
) -> ValueModel:
    """A value model on ``source``: a GPT preset name (``value_model("tiny", n_layers=2)``: a new
    GPT, ``overrides`` its config fields), a tessera GPT (:class:`GPTValueModel`, which takes its
    modules), or a Hugging Face causal LM or base model (:class:`HFValueModel`, split for ``ctx``
    or the current layout). ``head_std``, ``head_seed``: :func:`value_head`."""
    if isinstance(source, str):
        source = gpt(source, **overrides)
    elif overrides:
        raise TypeError(f"value_model: config overrides {sorted(overrides)} apply to a preset name only")
    if isinstance(source, GPT):
        return GPTValueModel(source, head_std=head_std, head_seed=head_seed)
    if is_hf_model(source):
        return HFValueModel(source, head_std=head_std, head_seed=head_seed, ctx=ctx)
    raise TypeError(
        f"value_model: expected a GPT preset name, a tessera GPT or a transformers model, got {type(source).__name__}"
    )


def sequence_values(values: torch.Tensor, last_index: torch.Tensor) -> torch.Tensor:
    """Each row's value at its last real token: ``values [B, T]``, ``last_index [B]`` (a batch's
    ``last_index``: positions in ``input_ids``) -> ``[B]``. A reward model's rewards."""
    if values.dim() != 2:
        raise ValueError(f"sequence_values: values must be [B, T] (2-D), got shape {shape_of(values)}")
    check_per_sequence("sequence_values", "last_index", last_index, values.shape[0])
    if last_index.dtype.is_floating_point or last_index.dtype == torch.bool:
        raise ValueError(f"sequence_values: last_index must be an integer tensor, got {last_index.dtype}")
    length = values.shape[1]
    if last_index.numel() and bool(((last_index < 0) | (last_index >= length)).any()):
        raise ValueError(
            f"sequence_values: last_index must lie in [0, {length}) (positions of values [B, T]), "
            f"got {last_index.tolist()}"
        )
    return values.gather(1, last_index.long().unsqueeze(1)).squeeze(1)


# ---- token log-probabilities ------------------------------------------------------------------


def vocab_parallel_token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, group: AxisGroup, vocab_size: int
) -> torch.Tensor:
    """:func:`~tessera.rlhf.tokens.token_logprobs` of logits split over the vocabulary: ``logits
    [B, T, ceil(V/P)]`` (this rank's block of the ``vocab_size`` classes over ``group``, padded
    entries of the last block ignored), full ``tokens [B, T]`` -> ``[B, T]`` float32, the same on
    every rank of ``group``. The max, the sum of exps and each token's logit are all-reduced over
    the group; the backward gives each rank the gradient of its block. With one rank it is
    ``token_logprobs(logits[..., :vocab_size], tokens)``.

    It is the vocabulary-parallel cross-entropy of the tensor modes, negated, so it keeps the
    float32 softmax of this rank's block for the backward (not the blocked log-sum-exp of
    ``token_logprobs``)."""
    where = "vocab_parallel_token_logprobs"
    check_logits_and_tokens(where, logits, tokens, vocab="V/P")
    if group.size == 1:
        return token_logprobs(logits[..., :vocab_size], tokens)
    local = round_up(vocab_size, group.size) // group.size
    if logits.shape[-1] != local:
        raise ValueError(
            f"{where}: {logits.shape[-1]} logits per rank do not fit a vocabulary of {vocab_size} split "
            f"{group.size} ways ({local} per rank)"
        )
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise ValueError(f"{where}: tokens must be an integer tensor of token ids, got {tokens.dtype}")
    if tokens.numel() and bool(((tokens < 0) | (tokens >= vocab_size)).any()):
        raise ValueError(
            f"{where}: token ids must lie in [0, {vocab_size}) (the vocabulary size), got ids from "
            f"{int(tokens.min())} to {int(tokens.max())} (a -100 ignore label in a padded slot? replace it with 0)"
        )
    start, valid = local_range(vocab_size, group.size, group.rank)
    losses = class_parallel_cross_entropy(logits.flatten(0, 1), tokens.flatten().long(), (group,), start, valid)
    return -losses.view(tokens.shape)


def token_logprobs_fn(model: nn.Module) -> LogprobsFn:
    """How to take token log-probs from ``model``'s logits (``model``: the user's model, e.g.
    ``engine.module``): :func:`vocab_parallel_token_logprobs` over its head's tensor group when
    its LM head returns a block of the vocabulary (tessera's GPT under 1D tensor parallelism),
    else :func:`~tessera.rlhf.tokens.token_logprobs` (one rank, Hugging Face models, whose
    policies gather the logits). Raises NotAvailableError for a GPT under a grid tensor mode
    (2D, 2.5D, 3D), whose logits are split over the batch too."""
    for module in model.modules():
        if isinstance(module, VocabParallelClassifier1D):
            group = module.ctx.group("tensor")
            if group.size == 1:
                return token_logprobs
            return partial(vocab_parallel_token_logprobs, group=group, vocab_size=module.num_classes)
        name = type(module).__name__
        if name.startswith("VocabParallelClassifier") and type(module).__module__.startswith("tessera."):
            raise NotAvailableError(
                f"token log-probs of {type(model).__name__} with {name}: logits split by a grid tensor mode "
                "(2D, 2.5D, 3D) are not available yet; use tensor mode '1d', or data parallelism, ZeRO or Gemini"
            )
    return token_logprobs
