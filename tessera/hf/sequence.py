"""Sequence parallelism (the ``sequence`` axis: ring self-attention, ring attention, all-to-all)
for unmodified causal decoders from ``transformers`` (LLaMA, Qwen2, Mistral).

The engine already hands each rank its tokens of every sequence (and of the targets, and of an
attention mask in a dict batch) in the mode's layout (zigzag for ``ring``). What the model
needs besides (:func:`apply_sequence`):

- positions: at the model's entry, position ids default to the global positions of this rank's
  tokens (:func:`~tessera.parallel.sequence.tokens.token_positions`), so rotary embeddings see
  what they would in one process;
- attention over the whole sequence: the model's config is pointed at the attention function
  ``"tessera_sequence"`` (registered with transformers' ``AttentionInterface``), which runs
  :func:`~tessera.parallel.sequence.sequence_attention` causally on this rank's queries, keys
  and values (grouped key/value heads repeated as transformers does), with the key-padding
  mask from the batch's attention mask. transformers makes no mask for an attention function
  it does not know, so no ``[s, s]`` mask is built for the local tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera.comm import AxisGroup
from tessera.context import ParallelContext
from tessera.hf.decoder import Layout, has_submodule
from tessera.parallel.sequence import sequence_attention
from tessera.parallel.sequence.tokens import model_layout, token_positions

__all__ = ["ATTENTION", "apply_sequence"]

ATTENTION = "tessera_sequence"  # the name of tessera's attention function in transformers' registry


class _Sequence:
    """What the attention function needs: the group, the mode, and the current forward's key
    mask (this rank's tokens; None: every key real)."""

    def __init__(self, group: AxisGroup, mode: str) -> None:
        self.group, self.mode = group, mode
        self.key_keep: torch.Tensor | None = None


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over tessera's sequence attention: q, k, v
    ``[b, heads, s_local, d]`` -> ``[b, s_local, heads, d]``."""
    seq: _Sequence | None = getattr(module, "tessera_sequence", None)
    if seq is None:
        raise RuntimeError(f"{type(module).__name__} uses {ATTENTION!r} without tessera's sequence axis")
    if dropout:
        raise ValueError("attention dropout is not supported under sequence parallelism (set attention_dropout=0)")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    layout = model_layout(seq.mode, query.shape[2] * seq.group.size, seq.group.size)
    out = sequence_attention(query, key, value, seq.group, layout, seq.mode, True, seq.key_keep, scaling)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention)


def apply_sequence(model: Any, ctx: ParallelContext, layout: Layout) -> None:
    """Make ``model`` (a causal decoder laid out as ``layout``; its first block is attention)
    attend over the sequence axis of ``ctx``."""
    _register()
    group, mode = ctx.group("sequence"), ctx.dims.sequence_mode
    seq = _Sequence(group, mode)
    has_head = has_submodule(model, layout.head)
    body = model.get_submodule(layout.body) if has_head and layout.body else model
    for layer in body.get_submodule(layout.layers):
        object.__setattr__(layer.get_submodule(layout.blocks[0].region), "tessera_sequence", seq)
    model.config._attn_implementation = ATTENTION

    def enter(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if not isinstance(ids, torch.Tensor):
            raise ValueError("sequence parallelism needs the model's input_ids (or inputs_embeds) as a tensor")
        mask = kwargs.get("attention_mask")
        seq.key_keep = None if mask is None or bool(mask.all()) else mask.bool()
        if kwargs.get("position_ids") is None:
            kwargs = {**kwargs, "position_ids": token_positions(ids.shape[1], group, mode, ids.device)[None]}
        return args, kwargs

    body.register_forward_pre_hook(enter, with_kwargs=True)
