"""Peak memory per rank of a layout, from the model's shape alone.

The prediction walks one training step on the rank that needs the most:

* **Model states** as the memory ledger counts them (``tessera.memory.model_state_bytes``):
  this rank's parameters (its pipeline stage's layers, split by the tensor mode: matrices
  ``1/t`` in 1d, ``1/q^2`` in 2d and 2.5d, ``1/q^3`` in 3d), their gradients, and the
  optimizer's states (fp32 moments; with bf16/fp16 under ZeRO, fp32 master weights too),
  divided over the data axis by the ZeRO stage (1: states, 2: + gradients, 3: + parameters).
* **Activations** kept for the backward pass: per block and token, what tessera's blocks save
  in each tensor mode (:func:`block_activation_elements`, the saved-tensor hooks' count), times
  the tokens of a micro-batch, times the micro-batches a pipeline schedule keeps in flight on
  the rank (:func:`in_flight`), less what activation checkpointing recomputes.
* **Transients** alive at the peak: the backward of the largest block's MLP and of the loss, a
  recomputed block, ZeRO-3's gathered layers, ZeRO-2's gradient bucket, the optimizer's
  temporaries.

The step's peak is the larger of its two fullest points: the start of the (last) backward pass,
where every activation is alive beside the states (gradients too when micro-batches accumulate),
and the optimizer step, where the gradients and the update's temporaries are alive instead.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from tessera.planner import adapters as lora
from tessera.planner.layout import Layout
from tessera.planner.results import MemoryEstimate
from tessera.planner.spec import ModelSpec, Workload
from tessera.planner.timing import Stage, stages
from tessera.planner.timing.partition import rank_split

MIB = 2**20
#: ZeRO's default chunk, the unit of a gradient reduction (``zero.chunk_mb``)
ZERO_BUCKET_BYTES = 25 * MIB


@dataclass(frozen=True)
class StateBytes:
    """Bytes of model state on one rank."""

    parameters: int
    gradients: int
    optimizer: int  # moments and fp32 masters, on the device
    host: int  # offloaded to host memory
    gathered_layer: int  # ZeRO-3: one layer's full parameters, gathered for its use
    frozen: int = 0  # a frozen base's weights (LoRA): never sharded over the data axis


# ---- activations -------------------------------------------------------------------------------


def _mlp_saved(model: ModelSpec) -> int:
    """Elements per token the MLP's hidden side keeps: GELU's input and output (two of ff), or
    SwiGLU's gate, up, activation and product (four)."""
    return (4 if model.gated_mlp else 2) * model.ff_dim


def block_activation_elements(model: ModelSpec, layout: Layout, tokens_seq: int | None = None) -> float:
    """Elements one block keeps for its backward per token of this rank's micro-batch (tokens of
    the whole data replica: the tensor group's split of the batch is inside the formula).

    1d keeps the norms' inputs and outputs whole (``R = 4h``) and the rest split ``1/t``
    (``S``: the q/k/v projections, the attention's output, the MLP's hidden side); with
    sequence-parallel regions the norms' inputs are split and the column layers keep their
    all-gathered inputs (``2h``). 2d and 2.5d keep everything in blocks (``(R + S + 2h)/q^2``,
    the norms their normalised values); 3d keeps the norms' inputs, q/k/v and the MLP's
    pre-activation in blocks (``1/q^3``), each Linear's input gathered along one cube axis
    (``1/q^2``), and the attention's probabilities (``heads x seq / q^3``). A sequence axis splits the tokens and keeps the exchanged
    keys and values (``h``); ``ring_qk`` keeps whole score rows (heads x sequence)."""
    h, t = model.d_model, layout.tensor
    split = (h + 2 * model.kv_dim) + h + _mlp_saved(model)
    heads_t = model.n_heads / t
    if layout.checkpoint == "full":  # each block keeps its input only (1d: whole unless in sequence regions)
        whole_input = layout.tensor_mode == "1d" and not layout.sequence_parallel
        return (h if whole_input else h / _token_hidden_split(layout)) / layout.sequence
    if layout.checkpoint == "selective":
        split = (h + 2 * model.kv_dim) + h + (2 if model.gated_mlp else 1) * model.ff_dim
        whole = 2 * h
    else:
        whole = 4 * h
    elems: float
    if layout.tensor_mode == "1d":
        if layout.sequence_parallel:
            elems = 2 * h + (whole / 2 + split) / t if layout.checkpoint == "none" else (whole + split) / t
        else:
            elems = whole + split / t
        elems += heads_t + 4  # the attention's log-sum-exp per head, the norms' statistics
    elif layout.tensor_mode == "3d":
        q = layout.grid
        # blocks: the norms' inputs, q/k/v, the MLP's pre-activation; gathered along one cube axis:
        # each Linear's input; and the attention's probabilities (3d attends with explicit scores)
        mlp_local = (3 if model.gated_mlp else 1) * model.ff_dim
        kept = (whole / 2 + h + 2 * model.kv_dim + mlp_local) / q**3 + (3 * h + model.ff_dim) / q**2
        elems = kept + model.n_heads * (tokens_seq or model.seq_len) / q**3
    else:
        elems = (whole + split + 2 * h) / _token_hidden_split(layout)
    if layout.sequence > 1:
        extra: float = h  # the keys and values received (ring) or exchanged (all-to-all)
        if layout.sequence_mode == "ring_qk":
            extra = 2 * heads_t * (tokens_seq or model.seq_len)  # whole score rows and their softmax, fp32
        elems = (elems + extra) / layout.sequence
    return elems


def _token_hidden_split(layout: Layout) -> int:
    """How many ways a grid mode splits an activation (batch and hidden): q^2, q^2 d, q^3."""
    q = layout.grid
    return {"2d": q * q, "2.5d": q * q * layout.depth, "3d": q**3}.get(layout.tensor_mode, layout.tensor)


def activation_split(layout: Layout) -> tuple[int, int]:
    """How the tensor mode splits the MLP's hidden activations: (tokens, hidden) ways."""
    q = layout.grid
    return {
        "1d": (1, layout.tensor),
        "2d": (q, q),
        "2.5d": (q * layout.depth, q),
        "3d": (q, q * q),
    }[layout.tensor_mode]


def head_activation_elements(model: ModelSpec, layout: Layout) -> float:
    """Elements per token the final norm, the output layer and the loss keep."""
    h, v = model.d_model, model.outputs
    if model.family == "vit":
        return 2 * h / max(1, _token_hidden_split(layout)) / model.seq_len + 0.0
    if layout.tensor_mode == "1d":
        t = layout.tensor
        elems = (h / t + h + v / t) if layout.sequence_parallel else (2 * h + v / t)
    else:
        elems = (2 * h + 2 * v) / _token_hidden_split(layout)
    return elems / layout.sequence


def in_flight(schedule: str, p: int, m: int, v: int, waiting_w: float = 1.0) -> tuple[tuple[float, float], ...]:
    """Per rank, the most micro-batches' activations alive at once under the schedule, before its
    first weight gradient is made and after (when the gradients are alive beside them); a chunk's
    micro-batch counts ``1/v`` (the rank's layers are its ``v`` chunks). Zero-bubble's
    micro-batches between their B and their W count ``waiting_w``: the graph is kept for W, and W's
    output gradients beside it."""
    return _in_flight(schedule, p, m, v, round(waiting_w, 3))


@functools.lru_cache(maxsize=4096)
def _in_flight(schedule: str, p: int, m: int, v: int, waiting_w: float) -> tuple[tuple[float, float], ...]:
    if p == 1:  # micro-batches one after another: the later ones beside the earlier ones' gradients
        return ((1.0, 1.0 if m > 1 else 0.0),)
    if schedule == "gpipe":  # every forward, then every backward
        return tuple((float(m), float(m - 1)) for _ in range(p))
    if m > 3 * p:  # the steady state repeats: the counts no longer change past 3p micro-batches
        m = 3 * p
    return _walk_orders(schedule, p, m, v, waiting_w)


def _walk_orders(schedule: str, p: int, m: int, v: int, waiting_w: float) -> tuple[tuple[float, float], ...]:
    """Walk each rank's compute order (transfers do not reorder computes)."""
    out = []
    for before_points, after_points in _order_points(schedule, p, m, v):
        before = max((a + waiting_w * b for a, b in before_points), default=0.0)
        after = max((a + waiting_w * b for a, b in after_points), default=0.0)
        out.append((max(before, 0.0) / v, max(after, 0.0) / v))
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def _order_points(schedule: str, p: int, m: int, v: int) -> tuple[tuple[frozenset, frozenset], ...]:
    """Per rank, the micro-batches alive after each compute of its order as ``a + waiting_w * b``:
    the distinct ``(a, b)`` before the first weight gradient and after it. A schedule's orders
    are built once, whatever ``waiting_w`` the models ask about (the search asks many)."""
    from tessera.parallel.pipeline.actions import Kind
    from tessera.parallel.pipeline.schedules import interleaved_order, one_f_one_b_order, zero_bubble_h1_order

    if schedule == "interleaved":
        orders = interleaved_order(p, m, v)
    elif schedule == "zero_bubble":
        orders = zero_bubble_h1_order(p, m)
    else:
        orders = one_f_one_b_order(p, m)
    out = []
    for actions in orders:
        a = b = 0  # alive = a + waiting_w * b
        started = False
        before: set[tuple[int, int]] = set()
        after: set[tuple[int, int]] = set()
        for action in actions:
            if action.kind is Kind.FORWARD:
                a += 1
            elif action.kind is Kind.BACKWARD_INPUT:
                a, b = a - 1, b + 1
            elif action.kind is Kind.BACKWARD:
                a -= 1
                started = True
            elif action.kind is Kind.BACKWARD_WEIGHT:
                b -= 1
                started = True
            (after if started else before).add((a, b))
        out.append((frozenset(before), frozenset(after)))
    return tuple(out)


def _waiting_w(model: ModelSpec, layout: Layout) -> float:
    """What a zero-bubble micro-batch holds between its B and its W, in units of its activations:
    the saved tensors (the graph is kept for W) and the gradients of every Linear's output."""
    if layout.schedule != "zero_bubble":
        return 1.0
    h = model.d_model
    t = layout.tensor if layout.tensor_mode == "1d" else _token_hidden_split(layout)
    full = layout.tensor_mode == "1d" and not layout.sequence_parallel
    outputs = (h + 2 * model.kv_dim + (2 if model.gated_mlp else 1) * model.ff_dim) / t + (2 * h if full else 2 * h / t)
    return 1.0 + outputs / block_activation_elements(model, Layout(**{**layout.__dict__, "checkpoint": "none"}))


# ---- states ------------------------------------------------------------------------------------


def state_bytes(
    model: ModelSpec, layout: Layout, workload: Workload, elements: float, frozen: float = 0.0
) -> StateBytes:
    """Model-state bytes of a rank holding ``elements`` trainable parameter elements (its tensor
    shard) and ``frozen`` bytes of a frozen base (LoRA: weights only; whole on every data rank
    under ZeRO 0-2, sharded over them and gathered a layer at a time under ZeRO-3, as
    ``tessera.zero.frozen`` does)."""
    mixed_zero = workload.dtype != "fp32" and layout.zero > 0
    p_bytes = 2 if mixed_zero else 4
    opt = 4 * workload.optimizer_states + (4 if mixed_zero else 0)  # moments (+ fp32 masters)
    n = layout.data
    params = elements * p_bytes / (n if layout.zero >= 3 else 1)
    grads = elements * p_bytes / (n if layout.zero >= 2 else 1)
    states = elements * opt / (n if layout.zero >= 1 else 1)
    host = 0.0
    if layout.offload:
        host, states = states, 0.0
    block = lora.trainable_block_params(model) / layout.splits[0] * p_bytes  # what ZeRO-3 chunks
    gathered = 2 * block if layout.zero >= 3 else 0.0  # the layer in use and the next, prefetched
    if layout.zero >= 3 and frozen:
        gathered += 2 * frozen / max(1, model.n_layers / layout.pipeline)  # about a block's frozen share
        frozen /= n
    return StateBytes(int(params), int(grads), int(states), int(host), int(gathered), int(frozen))


# ---- the peak -----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=65536)
def predict_memory(model: ModelSpec, layout: Layout, workload: Workload) -> MemoryEstimate:
    """Peak bytes per rank of one training step of ``model`` under ``layout`` (see the module
    docstring); the rank with the highest peak."""
    cut, flights, whole = _stage_inputs(model, layout)
    # a rank's peak is a maximum of terms each rising with one of its two in-flight counts: among
    # ranks holding alike stages, the one with the most before and the one with the most after
    # reach the highest peak (long pipelines have many alike middle stages)
    alike: dict[Stage, list[tuple[float, float]]] = {}
    for stage, flight in zip(cut, flights):
        alike.setdefault(stage, []).append(flight)
    ranks = []
    for stage, seen in alike.items():
        for flight in dict.fromkeys((max(seen), max(seen, key=lambda f: (f[1], f[0])))):
            ranks.append(_rank_peak(model, layout, workload, stage, whole, flight))
    return max(ranks, key=lambda e: e.peak)


def _stage_inputs(model: ModelSpec, layout: Layout) -> tuple[tuple[Stage, ...], tuple[tuple[float, float], ...], float]:
    cut = stages(model, layout.pipeline, layout.chunks)
    flights = in_flight(layout.schedule, layout.pipeline, layout.microbatches, layout.chunks, _waiting_w(model, layout))
    whole = sum(rank_split(model, layout, stage)[0] for stage in cut)
    return cut, flights, whole


def predict_stage_memory(model: ModelSpec, layout: Layout, workload: Workload) -> list[MemoryEstimate]:
    """:func:`predict_memory` for each pipeline rank (one entry without a pipeline): the stages
    and this rank's parameter elements as :mod:`tessera.planner.timing` cuts and counts them."""
    cut, flights, whole = _stage_inputs(model, layout)
    done: dict[tuple[Stage, tuple[float, float]], MemoryEstimate] = {}
    out = []
    for stage, flight in zip(cut, flights):
        if (stage, flight) not in done:  # many ranks of a long pipeline are alike
            done[stage, flight] = _rank_peak(model, layout, workload, stage, whole, flight)
        out.append(done[stage, flight])
    return out


def _rank_peak(
    model: ModelSpec,
    layout: Layout,
    workload: Workload,
    stage: Stage,
    whole: float,
    flight: tuple[float, float],
) -> MemoryEstimate:
    """The peak of a rank holding ``stage``; ``whole``: the trainable elements of every stage (on
    this rank's tensor split)."""
    seq = workload.seq_len or model.seq_len
    e = workload.element_bytes
    tokens = layout.micro_batch * seq  # one micro-batch of this data replica
    blocks, has_head = stage.blocks, stage.head
    elements, frozen = rank_split(model, layout, stage)
    per_block = block_activation_elements(model, layout, seq) * tokens * e * _traced_scale(model, seq)
    per_block += adapter_activation_elements(model, layout, e) * tokens * e
    head = head_activation_elements(model, layout) * tokens * 4 if has_head else 0.0  # logits stay fp32
    one = blocks * per_block + head  # one micro-batch's activations on this rank
    if layout.pipeline > 1:  # the stage's input received (and its gradient) and its output kept for the backward
        one += 3 * tokens * model.d_model / _token_hidden_split(layout) * e
    before, after = flight
    activations = max(before, after) * one
    states = state_bytes(model, layout, workload, elements, frozen)
    if layout.pipeline > 1 and layout.zero:
        # tessera packs every parameter the optimizer holds into ZeRO's chunks, other stages'
        # too (docs/planner.md, limits): the whole model's parameters on every stage
        states = dataclasses.replace(states, parameters=int(whole * states.parameters / max(elements, 1)))
    start, middle = _transient(model, layout, workload, tokens, has_head)
    fixed = states.parameters + states.frozen + states.optimizer + states.gathered_layer
    backward = fixed + start + max(before * one, after * one + states.gradients)
    if layout.checkpoint != "none":  # mid-backward: a block recomputed beside the gradients made so far
        made = (
            states.gradients
            if layout.zero < 2
            else states.gradients + 2 * _block_gradient_bytes(model, layout, workload)
        )
        backward = max(backward, fixed + middle + max(activations, made))
    step = fixed - states.gathered_layer + states.gradients + _step_temporaries(layout, states)
    peak = max(backward, step)
    return MemoryEstimate(
        parameters=states.parameters,
        gradients=states.gradients,
        optimizer_states=states.optimizer,
        activations=int(activations),
        transient=int(max(0.0, peak - fixed + states.gathered_layer - states.gradients - activations)),
        peak=int(peak),
        host=states.host,
        frozen=states.frozen,
    )


def _traced_scale(model: ModelSpec, seq: int) -> float:
    """A traced model's measured activation bytes per token of a block over the formula's for the
    unsplit block (:func:`tessera.planner.traced.from_module`); 1 for a described one."""
    traced = model.traced_block_bytes_per_token
    if not traced:
        return 1.0
    return traced / (block_activation_elements(model, Layout(), seq) * 4)


def _transient(
    model: ModelSpec, layout: Layout, workload: Workload, tokens: int, has_head: bool
) -> tuple[float, float]:
    """Bytes alive only inside the backward pass: at its start (the MLP's backward temporaries,
    three of its hidden width, and the loss's gradient and softmax of the logits) and, with
    activation checkpointing, in its middle (the MLP's temporaries and a recomputed block)."""
    e = workload.element_bytes
    token_split, hidden_split = activation_split(layout)
    mlp = 3.0 * tokens / layout.sequence / token_split * model.ff_dim / hidden_split * e
    loss = 2.0 * tokens / layout.sequence * model.outputs / layout.splits[0] * 4 if has_head else 0.0
    middle = 0.0
    if layout.checkpoint != "none":
        whole = Layout(**{**layout.__dict__, "checkpoint": "none"})
        scale = _traced_scale(model, workload.seq_len or model.seq_len)
        adapters = adapter_activation_elements(model, whole, e)
        middle = mlp + (block_activation_elements(model, whole) * scale + adapters) * tokens * e
    return mlp + loss, middle


def _block_gradient_bytes(model: ModelSpec, layout: Layout, workload: Workload) -> float:
    """One block's gradients in full over the data axis (ZeRO-2/3 reduce-scatter them as the
    block's backward ends; two are alive: one reducing, one being made)."""
    p_bytes = 2 if workload.dtype != "fp32" and layout.zero > 0 else 4
    return lora.trainable_block_params(model) / layout.splits[0] * p_bytes


def _step_temporaries(layout: Layout, states: StateBytes) -> float:
    """The optimizer's temporaries during the update: one tensor the size of the parameters it
    steps (torch's foreach Adam), on the device unless the update runs on the host."""
    if layout.offload:
        return 0.0
    stepped = states.optimizer / 2  # fp32 elements the update walks, in bytes
    return stepped


def describe(estimate: MemoryEstimate) -> str:
    parts = ("parameters", "gradients", "optimizer_states", "activations", "transient", "peak")
    return ", ".join(f"{name} {getattr(estimate, name) / MIB:,.1f} MiB" for name in parts)


__all__ = ["block_activation_elements", "describe", "in_flight", "predict_memory", "predict_stage_memory"]


def adapter_activation_elements(model: ModelSpec, layout: Layout, element_bytes: int) -> float:
    """Elements per token one block's adapters keep for the backward (beyond the base's): each
    adapted layer's ``A x`` (r wide, kept by ``B``), and with dropout the dropped input (kept by
    ``A``) and its mask (a byte an element); split as the layout splits the layer's activations.
    Nothing under full checkpointing (the block keeps its input only)."""
    if model.adapters is None or layout.checkpoint == "full":
        return 0.0
    a = model.adapters
    grid = layout.tensor_mode != "1d" and layout.tensor > 1
    split = _token_hidden_split(layout) if grid else 1
    total = 0.0
    for role, fan_in, _ in lora.adapted_layers(model):
        total += a.rank / split
        if a.dropout > 0:
            width = fan_in / (split if grid else layout.tensor if role not in lora.COLUMN_ROLES else 1)
            total += width * (1 + 1 / element_bytes)
    return total / layout.sequence
