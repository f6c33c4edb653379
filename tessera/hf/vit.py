"""The ViT policy (``ViTModel``, ``ViTForImageClassification``): tensor parallelism in every mode
(1D described here; the grid modes follow the same layout through :mod:`tessera.hf.grid`) and
pipeline stages (the embeddings on the first stage, the final norm and the classifier on the
class token on the last).

ViT's layers are pre-norm encoder blocks (transformers 5.x names them ``layers.N`` with
``attention.{q,k,v,o}_proj`` and ``mlp.fc1``/``fc2``). Per layer: ``attention.q_proj``, ``k_proj``
and ``v_proj`` column-parallel (each rank keeps ``num_attention_heads / P`` heads; the attention
reads its head count from the projections' widths), ``attention.o_proj`` row-parallel;
``mlp.fc1`` column- and ``mlp.fc2`` row-parallel. There is no word embedding: the patch
embedding, the class token and the position table (``embeddings``) stay whole, and so do the
pooler and the classifier. With sequence-parallel regions the sequence (the class token and
the patches, ``1 + (image_size / patch_size)^2`` tokens, which the tensor size must divide) is
split before the first layer and gathered after the final ``layernorm``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tessera.context import ParallelContext
from tessera.hf.decoder import Block, Layout
from tessera.hf.plans import MODES, apply_layout, heads_rule
from tessera.hf.policy import Policy, divides, register_policy
from tessera.hf.stages import pipeline_layers

__all__ = ["LAYOUT", "POLICY", "sequence_length"]


def _heads(layer: Any, size: int) -> None:
    """Each rank keeps ``num_attention_heads / P`` heads (the views use -1; the count follows)."""
    layer.attention.num_attention_heads //= size


LAYOUT = Layout(
    body="vit",
    embedding=None,
    layers="layers",
    blocks=(
        Block(
            "attention",
            {"attention.q_proj": 1, "attention.k_proj": 1, "attention.v_proj": 1},
            "attention.o_proj",
        ),
        Block("mlp", {"mlp.fc1": 1}, "mlp.fc2"),
    ),
    norms=("layernorm_before", "layernorm_after"),
    final_norm="layernorm",
    head="classifier",
    vocab_head=False,
    replicated=("embeddings",),
    per_layer=_heads,
)


def sequence_length(config: Any) -> int:
    """Tokens per image: the class token and one per patch."""
    image, patch = config.image_size, config.patch_size
    height, width = (image, image) if isinstance(image, int) else image
    step_h, step_w = (patch, patch) if isinstance(patch, int) else patch
    return 1 + (height // step_h) * (width // step_w)


def check(model: Any, ctx: ParallelContext) -> list[str]:
    config = model.config
    size = ctx.size("tensor")
    broken = heads_rule(ctx, num_attention_heads=config.num_attention_heads)
    if ctx.dims.sequence_parallel:
        tokens = sequence_length(config)
        broken += divides("with sequence-parallel regions the sequence (1 + patches per image)", tokens, size)
    return broken


def apply(model: Any, ctx: ParallelContext) -> dict[int, nn.Parameter]:
    return apply_layout(model, ctx, LAYOUT)


def stages(model: Any) -> list[nn.Module]:
    """Pipeline layers; the hidden states entering the first layer are ``[images, tokens, h]``."""
    tokens = sequence_length(model.config)
    return pipeline_layers(model, LAYOUT, entry_shape=lambda inputs: (inputs["pixel_values"].shape[0], tokens))


POLICY = Policy(
    name="vit",
    classes=("ViTModel", "ViTForImageClassification"),
    modes=MODES,
    check=check,
    apply=apply,
    notes="every tensor mode; sequence-parallel regions in 1D; pipeline stages",
    pipeline=stages,
)
register_policy(POLICY)
