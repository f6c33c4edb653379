"""The model cut into pipeline stages as tessera cuts it, and what one rank of a stage holds
(its parameter elements) and computes (floating-point operations per micro-batch)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from tessera.planner.layout import Layout
from tessera.planner.spec import ModelSpec, Workload
from tessera.planner.timing.counting import block_linears, round_up

# ---- pipeline stages ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """What a pipeline rank holds: ``blocks`` transformer blocks, the embedding (first chunk) and
    the head (last chunk); ``boundaries``: its chunks' ends that another rank's chunk meets (an
    activation and a gradient cross each per micro-batch); ``loss_sends``, ``loss_recvs``: its
    chunks that pass the loss on (after the first) and take it (before the last)."""

    blocks: int
    embedding: bool
    head: bool
    boundaries: int = 0
    loss_sends: int = 0
    loss_recvs: int = 0


@lru_cache(maxsize=4096)
def stages(model: ModelSpec, pipeline: int, chunks: int = 1) -> tuple[Stage, ...]:
    """The model cut into ``pipeline * chunks`` parts as tessera cuts it by default (balanced
    parameter counts over embedding, blocks, head; a tied head counts in the embedding), rank
    ``r`` holding parts ``r, r + p, ...``; one :class:`Stage` per rank."""
    from tessera.parallel.pipeline.partition import partition_by_cost

    layers = [float(model.embedding_params())] + [float(model.block_params())] * model.n_layers
    layers.append(float(model.head_params()))
    parts = pipeline * chunks
    bounds = [0, *partition_by_cost(layers, parts), len(layers)] if parts > 1 else [0, len(layers)]
    out = []
    for r in range(pipeline):
        mine = range(r, parts, pipeline)
        held = [i for c in mine for i in range(bounds[c], bounds[c + 1])]
        blocks = sum(1 for i in held if 0 < i <= model.n_layers)
        sends, recvs = sum(c > 0 for c in mine), sum(c < parts - 1 for c in mine)
        ends = sends + recvs if parts > 1 else 0
        out.append(Stage(blocks, 0 in held, len(layers) - 1 in held, ends, sends, recvs))
    return tuple(out)


def local_parameters(model: ModelSpec, layout: Layout, stage: Stage) -> float:
    """Parameter elements this rank holds for ``stage`` (before ZeRO shards them): matrices and
    vectors as the tensor mode splits them (``Layout.splits``), the vocabulary table as a matrix,
    a learned position table as the mode's embedding does, a tied head's table on both end stages."""
    return block_parameters(model, layout, stage.blocks) + sum(end_parameters(model, layout, stage).values())


def block_parameters(model: ModelSpec, layout: Layout, blocks: int) -> float:
    """Elements of ``blocks`` transformer blocks on one rank, split by the tensor mode."""
    mat, vec = layout.splits
    t = layout.tensor
    block_vectors = float(model.block_vector_params())
    if layout.tensor_mode == "1d" and model.biases and t > 1:  # the column layers' biases are split
        column = block_linears(model)[0][1] + block_linears(model)[2][1]
        block_vectors -= column - column / t
    return blocks * (model.block_matrix_params() / mat + block_vectors / vec)


def end_parameters(model: ModelSpec, layout: Layout, stage: Stage) -> dict[str, float]:
    """Elements of the parts outside the blocks that this rank holds for ``stage``, by part:
    ``table`` (the vocabulary table, a ViT's patch projection), ``positions`` (a learned position
    table; a ViT's class token and patch bias too), ``norm`` (the final norm) and ``head`` (the
    output matrix; a tied head's copy of the table on a last stage without the embedding)."""
    mat, vec = layout.splits
    t, h = layout.tensor, model.d_model
    out: dict[str, float] = {}
    table = model.vocab_size * h if model.family != "vit" else model.patch_dim * h
    positions = model.embedding_params() - table
    if stage.embedding:
        pos_split = t if layout.tensor_mode == "1d" else vec if layout.tensor_mode == "3d" else mat
        out["table"], out["positions"] = table / mat, positions / pos_split
    if stage.head:
        out["norm"] = model.norm_params() / vec
        out["head"] = (model.head_params() - model.norm_params()) / mat
        if model.tie_weights and not stage.embedding and model.family != "vit":
            out["head"] += table / mat  # the head's copy of the tied table
    return out


# ---- compute ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageWork:
    """Per micro-batch on one rank of a stage, in floating-point operations: ``forward``,
    ``backward`` (input and weight gradients, twice the forward), ``recompute`` (activation
    checkpointing's extra forward) and ``attention`` (the score and value products of all three)."""

    forward: float
    backward: float
    recompute: float
    attention: float
    block: float = 0.0  # one block's forward

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.recompute


def stage_work(model: ModelSpec, layout: Layout, workload: Workload, stage: Stage) -> StageWork:
    """The floating-point work of one micro-batch on a rank of ``stage``: its share of the blocks
    (tensor split; tokens of its sequence part; the grid modes' batch padded to their blocks)
    and of the head; embeddings are lookups. With LoRA adapters the blocks' frozen weights make
    no weight gradient (the backward still makes their inputs' gradients) and each adapter adds
    its two products."""
    from tessera.planner import adapters as lora

    s = workload.seq_len or model.seq_len
    q, mode = layout.grid, layout.tensor_mode
    batch = layout.micro_batch
    if layout.tensor > 1 and mode in ("2d", "2.5d"):
        batch = round_up(batch, layout.depth * q)
    elif layout.tensor > 1 and mode == "3d":
        batch = round_up(batch, q)
    tokens = batch * s // layout.sequence
    matmuls = 2.0 * tokens * model.block_matrix_params() / layout.tensor
    block = model.block_forward_flops(tokens, s) / layout.tensor
    attention = block - matmuls
    head = model.head_forward_flops(tokens) / layout.tensor if stage.head else 0.0
    adapters = 2.0 * tokens * lora.adapter_block_params(model) / layout.tensor
    block += adapters
    forward = stage.blocks * block + head
    backward = 2 * forward
    if model.adapters is not None:  # no weight gradient of the frozen matrices (the head unless saved)
        backward -= stage.blocks * matmuls + (0.0 if "head" in lora.saved_parts(model) else head)
    extra = {"none": 0.0, "full": block, "selective": attention}[layout.checkpoint]
    recompute = stage.blocks * extra
    attended = stage.blocks * attention * (3 + (layout.checkpoint != "none"))
    return StageWork(forward, backward, recompute, attended, block)


def rank_split(model: ModelSpec, layout: Layout, stage: Stage) -> tuple[float, float]:
    """``(trainable elements, frozen bytes)`` this rank holds for ``stage`` before ZeRO shards
    the trainable ones (ZeRO-3 shards the frozen base too: ``memory.state_bytes``)."""
    from tessera.planner import adapters as lora

    ends = end_parameters(model, layout, stage)
    if model.adapters is None:
        return block_parameters(model, layout, stage.blocks) + sum(ends.values()), 0.0
    saved = lora.saved_parts(model)
    trainable = stage.blocks * lora.adapter_local(model, layout) + sum(v for k, v in ends.items() if k in saved)
    frozen = block_parameters(model, layout, stage.blocks) + sum(v for k, v in ends.items() if k not in saved)
    if model.adapters.quantize != "none":  # tensor size 1 (refused otherwise): the blocks' weights whole
        frozen -= stage.blocks * lora.adapted_weights_per_block(model)
        return trainable, frozen * lora.FROZEN_BYTES + stage.blocks * lora.quantized_block_bytes(model)
    return trainable, frozen * lora.FROZEN_BYTES
