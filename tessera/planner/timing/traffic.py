"""Communication of one optimizer step on a rank (docs/planner.md, "Step time"): the tensor
modes' (:mod:`tessera.planner.timing.tensor`), the sequence axis's attention, the pipeline's
boundaries and the replicas' gradient averaging (DDP buckets, ZeRO chunks), as logical bytes
and calls per (op, axis), exactly as the comm ledger counts them.
``tests/dist/test_planner_timing.py`` holds these formulas to the ledger of real steps."""

from __future__ import annotations

import math

from tessera.planner import adapters as lora
from tessera.planner.layout import Layout
from tessera.planner.spec import ModelSpec, Workload
from tessera.planner.timing.counting import BUCKET_BYTES, P2P, Book, Shape, Traffic, micro_batch_shape
from tessera.planner.timing.partition import Stage, rank_split, stages
from tessera.planner.timing.tensor import block_tensor, embedding_tensor, head_tensor


def _pipeline_traffic(book: Book, m: ModelSpec, layout: Layout, sh: Shape, stage: Stage) -> None:
    """Activations forward and their gradients backward across each of the stage's boundaries,
    per micro-batch; the loss rides on the last gradient (8 bytes); a tied embedding's gradient
    is summed over the pipeline."""
    p, ends = layout.pipeline, stage.boundaries
    if p == 1:
        return
    act = sh.tokens * sh.width * sh.er
    book.times = layout.microbatches
    book.add("send", "pipeline", p, ends * act, ends)
    book.add("recv", "pipeline", p, ends * act, ends)
    book.times = 1
    book.add("send", "pipeline", p, 8 * stage.loss_sends, 0)  # the loss, on the last gradient
    book.add("recv", "pipeline", p, 8 * stage.loss_recvs, 0)
    if m.tie_weights and m.family != "vit":
        book.add("all_reduce", "pipeline", p, m.vocab_size * m.d_model / layout.splits[0] * sh.pe)


# ---- sequence and data axes ---------------------------------------------------------------------


def _block_sequence(book: Book, m: ModelSpec, layout: Layout, sh: Shape) -> None:
    """One block's attention over the sequence axis (N ranks, this rank's heads): ring sends
    the key/value blocks N-1 hops forward, again backward with their fp32 gradient sums;
    ring_qk keys and values apart (4 (N-1) hops backward); all_to_all four each way."""
    n = layout.sequence
    if n == 1:
        return
    local = sh.b * (sh.s // n)
    kv, h = local * m.kv_dim / layout.tensor, local * m.d_model / layout.tensor  # elements of one block
    hops = n - 1
    if layout.sequence_mode == "ring":
        for op in P2P:
            book.add(op, "sequence", n, hops * 2 * kv * sh.e, hops, fwd=True)
            book.add(op, "sequence", n, hops * 2 * kv * (sh.e + 4), 2 * hops)
    elif layout.sequence_mode == "ring_qk":
        for op in P2P:
            book.add(op, "sequence", n, 2 * hops * kv * sh.e, 2 * hops, fwd=True)
            book.add(op, "sequence", n, 4 * hops * kv * sh.e, 4 * hops)
    else:
        book.add("all_to_all", "sequence", n, (2 * h + 2 * kv) * sh.e, 4, fwd=True)
        book.add("all_to_all", "sequence", n, (2 * h + 2 * kv) * sh.e, 4)


def replica_axis(layout: Layout) -> tuple[str, int]:
    """The group that averages gradients and that ZeRO shards over: ``data``, or ``data+sequence``
    when the sequence is split (its ranks hold the same parameters)."""
    return ("data+sequence" if layout.sequence > 1 else "data"), layout.data * layout.sequence


def shard_ranks(layout: Layout, per_node: int) -> int:
    """The replicas ZeRO shards over: all of them, or with ``shard="host"`` those of one replica
    group on one node of ``per_node`` consecutive ranks (0: nodes unknown, one node). Equal to
    all replicas when the group lies on one node (hybrid sharding is then plain sharding)."""
    n = layout.data * layout.sequence
    if layout.shard != "host" or per_node <= 0:
        return n
    t, s, p = layout.tensor, layout.sequence, layout.pipeline
    members = [j * t * s * p + i * t for j in range(layout.data) for i in range(s)]  # rank 0's group
    return max(1, sum(1 for r in members if r < per_node))


def zero_chunks(model: ModelSpec, layout: Layout, stage: Stage, element: int) -> int:
    """ZeRO chunks (and DDP buckets) of a stage: one per layer at least, none over the bucket size
    (with LoRA adapters: of what trains, the adapters and any saved module)."""
    mat, vec = layout.splits
    if model.adapters is not None:
        block = lora.adapter_local(model, layout) * element
        saved = lora.saved_parts(model)
        ends = ("table" in saved) * stage.embedding + ("positions" in saved) * stage.embedding
        ends += bool(saved & {"norm", "head"}) * stage.head
    else:
        block = (model.block_matrix_params() / mat + model.block_vector_params() / vec) * element
        ends = (2 if model.learned_positions else 1) * stage.embedding + stage.head
    per_block = math.ceil(block / BUCKET_BYTES)
    return stage.blocks * per_block + ends


def _hybrid_traffic(book: Book, layout: Layout, axis: str, n: int, g: int, grads: float, chunks: int) -> None:
    """Hybrid sharding (``zero.shard="host"``, tessera/zero/hybrid.py) over ``n`` replicas, ``g``
    on each node: the reduce-scatters and all-gathers inside the node (``<axis>.host``), and each
    chunk's shard, ``grads / g``, all-reduced across the ``n / g`` nodes (``<axis>.across``) when
    it is reduced (stage 1: once, at the step; stages 2, 3: every micro-step)."""
    inside, across, micro = f"{axis}.host", f"{axis}.across", layout.accumulation
    reductions = 1 if layout.zero == 1 else micro
    book.add("reduce_scatter", inside, g, reductions * grads, reductions * chunks)
    book.add("all_reduce", across, n // g, reductions * grads / g, reductions * chunks)
    gathers = 2 * micro if layout.zero == 3 else 1
    book.add("all_gather", inside, g, gathers * grads, gathers * chunks)


def _data_traffic(book: Book, m: ModelSpec, layout: Layout, st: Stage, sh: Shape, per_node: int = 0) -> None:
    """Gradient averaging over the replicas: DDP's bucket all-reduce (a pipeline's one flat
    all-reduce), ZeRO's reduce-scatter and all-gather of the chunks (stage 2 reduces, stage 3
    also gathers, every micro-step), or hybrid sharding's (with nodes of ``per_node`` ranks), and
    the step's loss (4 bytes)."""
    axis, n = replica_axis(layout)
    if n == 1:
        return
    grads = rank_split(m, layout, st)[0] * sh.pe  # what trains (LoRA: adapters, saved modules)
    chunks = zero_chunks(m, layout, st, sh.pe)
    micro = layout.accumulation
    g = shard_ranks(layout, per_node)
    if layout.zero and g < n:
        _hybrid_traffic(book, layout, axis, n, g, grads, chunks)
    elif layout.zero == 0:
        calls = 1 if layout.pipeline > 1 else max(1, math.ceil((grads - 2**20) / BUCKET_BYTES) + 1)
        book.add("all_reduce", axis, n, grads, calls)
    elif layout.zero == 1:
        book.add("reduce_scatter", axis, n, grads, chunks)
        if layout.pipeline > 1:  # every stage's optimizer holds the whole model's chunks and gathers them all
            whole = Stage(m.n_layers, True, True)
            grads, chunks = rank_split(m, layout, whole)[0] * sh.pe, zero_chunks(m, layout, whole, sh.pe)
        book.add("all_gather", axis, n, grads, chunks)
    else:
        book.add("reduce_scatter", axis, n, micro * grads, micro * chunks)
        gathers = 1 if layout.zero == 2 else 2 * micro
        book.add("all_gather", axis, n, gathers * grads, gathers * chunks)
    book.add("all_reduce", axis, n, 4)


def _adapter_tensor(book: Book, m: ModelSpec, layout: Layout, sh: Shape) -> None:
    """1d LoRA: each adapted layer's whole factor's gradient (a column layer's ``A``, a row
    layer's ``B``) summed over the tensor group once per backward (``tessera.lora.layers``)."""
    if m.adapters is None or layout.tensor == 1 or layout.tensor_mode != "1d":
        return
    r = m.adapters.rank
    for role, fan_in, fan_out in lora.adapted_layers(m):
        whole = r * fan_in if role in lora.COLUMN_ROLES else r * fan_out
        book.add("all_reduce", "tensor", layout.tensor, whole * sh.pe, 1)


def stage_traffic(
    model: ModelSpec, layout: Layout, workload: Workload, stage: Stage, per_node: int = 0
) -> dict[tuple[str, str], Traffic]:
    """Logical bytes and calls per (op, axis) of one optimizer step on a rank of ``stage``, as
    tessera's comm ledger counts them; ``per_node``: ranks a node (hybrid sharding's groups
    follow the nodes; 0: one node)."""
    sh = micro_batch_shape(model, layout, workload)
    book = Book()
    book.times = stage.blocks * layout.microbatches
    # selective recomputation reruns the collectives between the kept matmul outputs, as full does
    book.recompute = 0.0 if layout.checkpoint == "none" else 1.0
    block_tensor(book, model, layout, sh)
    _block_sequence(book, model, layout, sh)
    book.recompute, book.times = 0.0, layout.microbatches
    if stage.embedding:
        embedding_tensor(book, model, layout, sh)
    if stage.head:
        head_tensor(book, model, layout, sh)
    _pipeline_traffic(book, model, layout, sh, stage)
    book.times = stage.blocks * layout.microbatches
    _adapter_tensor(book, model, layout, sh)
    book.times = 1
    _data_traffic(book, model, layout, stage, sh, per_node)
    return book.traffic()


def step_traffic(
    model: ModelSpec, layout: Layout, workload: Workload, per_node: int = 0
) -> dict[tuple[str, str], Traffic]:
    """:func:`stage_traffic` of every pipeline stage, the most of them per (op, axis): what the
    comm ledger shows on the rank that moves the most on each."""
    out: dict[tuple[str, str], Traffic] = {}
    for stage in set(stages(model, layout.pipeline, layout.chunks)):
        for key, t in stage_traffic(model, layout, workload, stage, per_node).items():
            if key not in out or t.bytes > out[key].bytes:
                out[key] = t
    return out
