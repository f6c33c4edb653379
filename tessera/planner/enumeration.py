"""The search space of the planner: what it may choose (:class:`Limits`) and the candidate layouts
of a model on a cluster, each shape (data, tensor with its mode, sequence with its mode, pipeline)
and its schedules and micro-batch sizes, with why a layout is outside the space
(:func:`layout_problems`). A combination the layout rules refuse (``tessera.context.rules``) is
never enumerated, and is refused with the rules' words."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tessera.context.rules import Combination, refusals
from tessera.planner.adapters import tensor_refusal
from tessera.planner.layout import Checkpointing, Layout, Schedule, SequenceMode, TensorMode
from tessera.planner.spec import Cluster, ModelSpec, Workload

SCHEDULES: tuple[Schedule, ...] = ("gpipe", "1f1b", "interleaved", "zero_bubble")
#: lightest recomputation first: each next one keeps less and recomputes more
CHECKPOINTING: tuple[Checkpointing, ...] = ("none", "selective", "full")
TENSOR_MODES: tuple[TensorMode, ...] = ("1d", "2d", "2.5d", "3d")
SEQUENCE_MODES: tuple[SequenceMode, ...] = ("ring", "ring_qk", "all_to_all")
#: ring_qk moves what ring moves and keeps whole score rows besides: searched only when asked
DEFAULT_SEQUENCE_MODES: tuple[SequenceMode, ...] = ("ring", "all_to_all")


@dataclass(frozen=True)
class Limits:
    """What the search may choose; the defaults allow everything tessera runs.

    ``tensor_within_node``: tensor groups stay inside a node unless no such layout fits.
    ``exhaustive``: estimate every layout that fits (no dominance pruning; slower).
    ``pins``: fields every layout must have, e.g. ``{"pipeline": 1, "zero": 3}``."""

    tensor_modes: tuple[TensorMode, ...] = TENSOR_MODES
    schedules: tuple[Schedule, ...] = SCHEDULES
    sequence_modes: tuple[SequenceMode, ...] = DEFAULT_SEQUENCE_MODES
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    checkpointing: tuple[Checkpointing, ...] = CHECKPOINTING
    offload: bool = True
    max_sequence: int = 8
    max_micro_batch: int | None = None
    interleaved_chunks: int = 2
    tensor_within_node: bool = True
    exhaustive: bool = False
    pins: dict[str, Any] = field(default_factory=dict)


@functools.lru_cache(maxsize=256)
def divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def tensor_variants(model: ModelSpec, t: int, modes: Sequence[TensorMode]) -> Iterator[tuple[TensorMode, int, bool]]:
    """(mode, depth, sequence_parallel) of ``t`` tensor ranks that the layout rules allow and whose
    split divides the model: 1d needs the heads (query and key/value), hidden and MLP widths to
    divide by t; the grid modes the same by q (3d: the hidden widths by q^2, its activation
    split), on grids of more than one rank a side; none with LoRA adapters that tensor parallelism
    does not split yet (:func:`tessera.planner.adapters.tensor_refusal`)."""
    heads, kv, h, ff = model.n_heads, model.kv_heads, model.d_model, model.ff_dim

    def splits(q: int, width_split: int) -> bool:
        return heads % q == 0 and kv % q == 0 and h % width_split == 0 and ff % width_split == 0

    if t == 1:
        yield "1d", 1, False
        return
    if tensor_refusal(model):
        return
    candidates: list[tuple[TensorMode, int]] = [("1d", 1), ("2d", 1)]
    candidates += [("2.5d", depth) for depth in divisors(t)[1:]] + [("3d", 1)]
    for mode, depth in candidates:
        if mode not in modes:
            continue
        for sp in (False, True):
            tensor = Combination(tensor=t, tensor_mode=mode, tensor_depth=depth, sequence_parallel=sp)
            if refusals(tensor, ("tensor",)):
                continue  # e.g. a size that is not the grid's, or sequence-parallel regions outside 1d
            q = Layout(tensor=t, tensor_mode=mode, depth=depth).grid
            if (mode == "1d" or q > 1) and splits(q, q * q if mode == "3d" else q):
                yield mode, depth, sp


def sequence_fits(model: ModelSpec, seq: int, s: int, mode: SequenceMode, tensor: int) -> bool:
    """Whether ``s`` sequence ranks split this model's sequence: ring attention splits it into 2s
    zigzag halves, ring_qk into s; all_to_all exchanges heads (query and key/value) over them."""
    if mode == "ring":
        return seq % (2 * s) == 0
    if mode == "ring_qk":
        return seq % s == 0
    return seq % s == 0 and model.n_heads % (tensor * s) == 0 and model.kv_heads % (tensor * s) == 0


def shapes(
    model: ModelSpec, cluster: Cluster, workload: Workload, limits: Limits, *, within_node: bool
) -> Iterator[Layout]:
    """Every (data, tensor + mode, sequence + mode, pipeline) of the cluster's devices that the
    model's sizes and the global batch divide; the other fields at their defaults."""
    world, per_node = cluster.devices, min(cluster.devices_per_node, cluster.devices)
    seq = workload.seq_len or model.seq_len
    for t in divisors(world):
        if within_node and per_node % t:
            continue  # a tensor group that spans nodes: only when nothing else fits
        for mode, depth, sp in tensor_variants(model, t, limits.tensor_modes):
            if sp and seq % t:
                continue  # sequence-parallel regions split the tokens t ways
            for s in divisors(world // t):
                if s > limits.max_sequence:
                    break
                axes = Combination(tensor=t, tensor_mode=mode, tensor_depth=depth, sequence_parallel=sp, sequence=s)
                if refusals(axes, ("axes",)):  # its tensor part passed in tensor_variants
                    continue  # e.g. a sequence axis beside a 2d grid
                for seq_mode in limits.sequence_modes if s > 1 else ("ring",):
                    if s > 1 and not sequence_fits(model, seq, s, seq_mode, t):
                        continue
                    for p in divisors(world // (t * s)):
                        if p > model.n_layers:
                            break
                        d = world // (t * s * p)
                        if workload.global_batch % d:
                            continue
                        yield Layout(data=d, tensor=t, tensor_mode=mode, depth=depth, sequence_parallel=sp,
                                     pipeline=p, sequence=s, sequence_mode=seq_mode)  # fmt: skip


def batch_parts(layout: Layout) -> int:
    """How many ways the tensor mode splits a micro-batch's samples (2d: q rows, 2.5d: depth x q,
    3d: q); a micro-batch that does not divide would be padded."""
    return {"2d": layout.grid, "2.5d": layout.depth * layout.grid, "3d": layout.grid}.get(layout.tensor_mode, 1)


def schedules_of(model: ModelSpec, shape: Layout, limits: Limits) -> list[tuple[Schedule, int]]:
    """(schedule, chunks) choices of a shape: one without a pipeline, else each schedule whose
    parts (stages x chunks) the model's layers can fill."""
    if shape.pipeline == 1:
        return [("1f1b", 1)]
    out: list[tuple[Schedule, int]] = []
    for schedule in limits.schedules:
        chunks = limits.interleaved_chunks if schedule == "interleaved" else 1
        if schedule == "interleaved" and (chunks < 2 or shape.pipeline * chunks > model.n_layers):
            continue
        out.append((schedule, chunks))
    return out


def micro_batches(per_replica: int, shape: Layout, schedule: Schedule, limits: Limits, chunks: int = 1) -> list[int]:
    """Micro-batch sizes of a replica's ``per_replica`` samples a step: divisors that the tensor
    mode's batch split divides and whose count of micro-batches the layout rules allow with the
    schedule and its ``chunks`` (enough of them for the stages; interleaved: in groups of p)."""
    parts = batch_parts(shape)
    out = []
    for mb in divisors(per_replica):
        if limits.max_micro_batch is not None and mb > limits.max_micro_batch:
            break
        if mb % parts:
            continue
        pipeline = Combination(
            pipeline=shape.pipeline, schedule=schedule, microbatches=per_replica // mb, chunks=chunks
        )
        if not refusals(pipeline, ("pipeline",)):
            out.append(mb)
    return out


def layout_problems(model: ModelSpec, layout: Layout, workload: Workload) -> list[str]:
    """Why the search leaves ``layout`` out (empty when it is in its space): it cannot run
    (:meth:`Layout.problems`: the layout rules' words; the model's sizes and the batch), or it is a ZeRO stage with no data
    axis to shard over (only stage 1 with offload is kept there: the optimizer on the host)."""
    out = layout.problems()
    if out:
        return out
    if layout.zero and layout.data == 1 and not (layout.zero == 1 and layout.offload):
        out.append("ZeRO shards over the data axis, which has one rank here")
    seq = workload.seq_len or model.seq_len
    refusal = tensor_refusal(model) if layout.tensor > 1 else None
    if refusal:
        out.append(refusal)
    elif (layout.tensor_mode, layout.depth, layout.sequence_parallel) not in set(
        tensor_variants(model, layout.tensor, TENSOR_MODES)
    ):
        out.append(f"the model's heads and widths do not split {layout.tensor} ways in {layout.tensor_mode}")
    if layout.sequence > 1 and not sequence_fits(model, seq, layout.sequence, layout.sequence_mode, layout.tensor):
        out.append(f"the sequence of {seq} tokens does not split {layout.sequence} ways ({layout.sequence_mode})")
    if layout.sequence_parallel and seq % layout.tensor:
        out.append(f"sequence-parallel regions need the {seq} tokens to divide by {layout.tensor}")
    if layout.pipeline * layout.chunks > model.n_layers:
        out.append(f"{layout.pipeline * layout.chunks} pipeline parts for {model.n_layers} layers")
    if layout.micro_batch % batch_parts(layout):
        out.append(f"micro-batch {layout.micro_batch} does not split {batch_parts(layout)} ways ({layout.tensor_mode})")
    if layout.global_batch != workload.global_batch:
        out.append(f"global batch {layout.global_batch}, not the workload's {workload.global_batch}")
    return out
