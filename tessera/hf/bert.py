"""The BERT policy (``BertModel``, ``BertForMaskedLM``, ``BertForSequenceClassification``,
``BertForTokenClassification``): tensor parallelism in every mode (1D described here; the grid
modes follow the same layout through :mod:`tessera.hf.grid`) and pipeline stages (the
embeddings on the first stage; the masked-LM head, or the pooler and the classifier, on the
last, whose :class:`~tessera.hf.stages.Exit` runs the model's own head and loss).

BERT's layers are post-norm encoder blocks. Per layer: ``attention.self.query``, ``key`` and
``value`` column-parallel (each rank keeps ``num_attention_heads / P`` heads; the attention
reads its head count from the projections' widths, and ``num_attention_heads`` and
``all_head_size`` follow), ``attention.output.dense`` row-parallel; ``intermediate.dense``
column- and ``output.dense`` row-parallel. The attention region starts at ``attention.self``,
not ``attention``: ``attention.output`` adds the attention's input back, and with
sequence-parallel regions that residual must stay this rank's ``[b, s/P, h]``. The norms after
the residual adds (``attention.output.LayerNorm``, ``output.LayerNorm``) run on the rank's part
of the sequence, which is gathered after the last layer (there is no final norm).

``word_embeddings`` is split on the vocabulary; the position and token-type tables and the
embedding LayerNorm stay whole. The masked-LM decoder ``cls.predictions.decoder`` is split on
the vocabulary with the word embedding it is tied to, its bias split too (``cls.predictions.bias``
stays that same parameter); the transform before it, the pooler and the classifiers stay whole.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import nn

from tessera.context import ParallelContext
from tessera.hf.decoder import Block, Layout, has_submodule
from tessera.hf.plans import MODES, apply_layout, cross_attention_rule, heads_rule
from tessera.hf.policy import Policy, register_policy
from tessera.hf.stages import pipeline_layers

__all__ = ["CLASSIFIER_LAYOUT", "LAYOUT", "POLICY", "layout_of"]


def _heads(layer: Any, size: int) -> None:
    """Each rank keeps ``num_attention_heads / P`` heads (the views use -1; the counts follow)."""
    attention = layer.attention.self
    attention.num_attention_heads //= size
    attention.all_head_size //= size


LAYOUT = Layout(
    body="bert",
    embedding="embeddings.word_embeddings",
    layers="encoder.layer",
    blocks=(
        Block(
            "attention.self",
            {"attention.self.query": 1, "attention.self.key": 1, "attention.self.value": 1},
            "attention.output.dense",
        ),
        Block("intermediate", {"intermediate.dense": 1}, "output.dense"),
    ),
    norms=("attention.output.LayerNorm", "output.LayerNorm"),
    final_norm=None,
    head="cls.predictions.decoder",
    replicated=("embeddings.position_embeddings", "embeddings.token_type_embeddings"),
    per_layer=_heads,
)
"""The masked-LM layout (and the base model's: a ``BertModel`` has no head)."""

CLASSIFIER_LAYOUT = replace(LAYOUT, head="classifier", vocab_head=False)
"""Sequence and token classification: the same body under a few classes left whole."""


def layout_of(model: Any) -> Layout:
    """The layout of ``model``: its head is the masked-LM decoder or a classifier."""
    return CLASSIFIER_LAYOUT if has_submodule(model, CLASSIFIER_LAYOUT.head) else LAYOUT


def check(model: Any, ctx: ParallelContext) -> list[str]:
    config = model.config
    broken = heads_rule(ctx, num_attention_heads=config.num_attention_heads)
    return broken + cross_attention_rule(config)


def apply(model: Any, ctx: ParallelContext) -> dict[int, nn.Parameter]:
    return apply_layout(model, ctx, layout_of(model))


POLICY = Policy(
    name="bert",
    classes=("BertModel", "BertForMaskedLM", "BertForSequenceClassification", "BertForTokenClassification"),
    modes=MODES,
    check=check,
    apply=apply,
    notes="every tensor mode; sequence-parallel regions in 1D; pipeline stages",
    pipeline=lambda model: pipeline_layers(model, layout_of(model)),
)
register_policy(POLICY)
