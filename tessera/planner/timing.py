"""Step time of a layout: compute, communication per mesh axis, their overlap, the pipeline
bubble and the optimizer (docs/planner.md, "Step time").

Communication is counted first, without the cluster (:func:`step_traffic`): logical bytes and
calls per (op, axis) of one optimizer step on the busiest rank, exactly as the comm ledger
(``tessera.comm.ledger``) counts them. The formulas are the strategies' own
(docs/tensor-parallel.md "Costs", docs/zero.md, docs/sequence-parallel.md, docs/pipeline.md);
``tests/dist/test_planner_timing.py`` holds them to the ledger of real steps. Then each entry
becomes seconds over the link its group runs on (:func:`axis_link`), and :func:`predict_time`
decides what overlaps with compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from tessera.planner.layout import Layout
from tessera.planner.results import TimeEstimate
from tessera.planner.spec import Cluster, Link, ModelSpec, Workload

#: op -> k in "k (P-1)/P x payload" (the ledger's ring factors); send and recv count the payload
_RING = {
    "all_reduce": 2.0,
    "all_gather": 1.0,
    "reduce_scatter": 1.0,
    "broadcast": 1.0,
    "reduce": 1.0,
    "all_to_all": 1.0,
}
_P2P = ("send", "recv")
#: ZeRO's chunk size and DDP's bucket size (tessera's and torch's defaults), bytes
BUCKET_BYTES = 25 * 2**20
#: host Adam rate (bytes of fp32 parameters per second and device) when the cluster gives none
DEFAULT_HOST_OPTIMIZER_RATE = 2e9
BASE_AXES = ("data", "tensor", "pipeline", "sequence")


@dataclass(frozen=True)
class Traffic:
    """One (op, axis) of a step on one rank: ``bytes`` as the ledger counts them (logical bytes),
    ``calls`` collective calls, ``group`` ranks in the group."""

    op: str
    axis: str
    group: int
    bytes: float
    calls: float


class _Book:
    """Accumulates traffic. Every add is scaled by ``times`` (layers x micro-batches); forward
    work by ``1 + recompute`` as well (activation checkpointing runs it again)."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, str], list[float]] = {}
        self.times = 1.0
        self.recompute = 0.0

    def add(self, op: str, axis: str, group: int, payload: float, calls: float = 1.0, fwd: bool = False) -> None:
        """``calls`` calls moving ``payload`` bytes in all (each call's tensor summed)."""
        if group <= 1 or payload <= 0:
            return
        scale = self.times * (1.0 + self.recompute if fwd else 1.0)
        logical = payload if op in _P2P else _RING[op] * (group - 1) / group * payload
        entry = self.entries.setdefault((op, axis), [float(group), 0.0, 0.0])
        entry[1] += scale * logical
        entry[2] += scale * calls

    def traffic(self) -> dict[tuple[str, str], Traffic]:
        return {key: Traffic(key[0], key[1], int(g), b, c) for key, (g, b, c) in self.entries.items()}


def _up(n: float, k: int) -> int:
    """``n`` rounded up to a multiple of ``k``."""
    return int(math.ceil(n / k) * k)


def _blocks(full: int, parts: int, groups: int = 1) -> int:
    """Units per rank of a dimension of ``groups`` fused parts, each padded and split ``parts`` ways."""
    return groups * math.ceil(full // groups / parts)


# ---- the model as layers ---------------------------------------------------------------------


def _linears(m: ModelSpec) -> list[tuple[int, int, int]]:
    """(in, out, fused parts) of a block's Linears in order: qkv, attention out, MLP in, MLP out.
    Fused as Megatron fuses them (q, k, v in one; a gated MLP's gate and up in one)."""
    h, kv, ff = m.d_model, m.kv_dim, m.ff_dim
    qkv = (h, h + 2 * kv, 3 if kv == h else 1)
    mlp_in = (h, 2 * ff, 2) if m.gated_mlp else (h, ff, 1)
    return [qkv, (h, h, 1), mlp_in, (ff, h, 1)]


@dataclass(frozen=True)
class _Shape:
    """One micro-batch on one rank: ``b`` samples of ``s`` tokens (the whole sequence), ``tokens``
    this rank's (after the sequence and the tensor mode's batch split, padded), ``width`` its
    hidden block; bytes of an element: ``e`` of the matmuls' operands and outputs, ``er`` of the
    residual stream (embeddings, norms: fp32 under autocast), ``pe`` of parameter gradients."""

    b: int
    s: int
    tokens: int
    width: int
    e: int
    er: int
    pe: int


def _shape(m: ModelSpec, layout: Layout, workload: Workload) -> _Shape:
    b, s = layout.micro_batch, workload.seq_len or m.seq_len
    local = s // layout.sequence
    q, mode = layout.grid, layout.tensor_mode
    if layout.tensor == 1 or mode == "1d":
        parts = layout.tensor if layout.sequence_parallel else 1
        tokens, width = b * local // parts, m.d_model
    elif mode == "3d":
        tokens, width = _up(b, q) // q * local, _blocks(m.d_model, q * q)
    else:
        tokens, width = _up(b, layout.depth * q) // (layout.depth * q) * local, _blocks(m.d_model, q)
    e = workload.element_bytes
    # without ZeRO, low precision is autocast over fp32 parameters; ZeRO keeps them in the dtype
    wide = 4 if layout.zero == 0 else e
    return _Shape(b, s, tokens, width, e, wide, wide)


# ---- tensor parallelism: one block -------------------------------------------------------------


def _block_1d(book: _Book, m: ModelSpec, layout: Layout, sh: _Shape) -> None:
    """Megatron 1D: each column layer all-reduces its input gradient, each row layer its output
    ([T, h] each); with sequence-parallel regions all-gathers and reduce-scatters instead, plus
    the replicated LayerNorm parameters' and row biases' gradients."""
    p, h = layout.tensor, m.d_model
    out = sh.b * (sh.s // layout.sequence) * h * sh.e  # [b, s/sp, h]: a row layer's output
    res = out // sh.e * sh.er  # a column layer's input (a norm's output)
    # a recompute stops at the last tensor the backward needs: the MLP output's collective is not repeated
    if not layout.sequence_parallel:
        book.add("all_reduce", "tensor", p, out, fwd=True)  # the row layers' outputs
        book.add("all_reduce", "tensor", p, out)
        book.add("all_reduce", "tensor", p, 2 * res, 2)  # the column layers' input gradients
        return
    book.add("all_gather", "tensor", p, 2 * res, 2, fwd=True)
    book.add("reduce_scatter", "tensor", p, out, fwd=True)
    book.add("reduce_scatter", "tensor", p, out)
    book.add("reduce_scatter", "tensor", p, 2 * res, 2)
    book.add("all_gather", "tensor", p, 2 * out, 2)
    vectors = 2 * (2 if m.norm == "layernorm" else 1) + (2 if m.biases else 0)
    book.add("all_reduce", "tensor", p, 2 * m.norm_params() * sh.pe + (2 * h * sh.pe if m.biases else 0), vectors)


def _summa_axes(layout: Layout) -> tuple[str, str, str | None]:
    return ("2d_row", "2d_col", None) if layout.tensor_mode == "2d" else ("2.5d_row", "2.5d_col", "2.5d_dep")


def _summa_linear(book: _Book, layout: Layout, sh: _Shape, fin: int, fout: int, groups: int, bias: bool,
                  form: str | None = None) -> None:  # fmt: skip
    """A SUMMA Linear, forward and backward (tp2d/functional.py's table; keep_blocks off): W
    blocks broadcast twice and reduced once along the column; "ab" moves X along the row the
    same way, "abt" reduces Y and broadcasts dY; bias (and 2.5D's depth) gradients all-reduced.
    A recompute runs all of its forward again (its output is made inside the product)."""
    row, col, dep = _summa_axes(layout)
    q, d = layout.grid, layout.depth
    bin_, bout = _blocks(fin, q), _blocks(fout, q, groups)
    form = form or ("abt" if bout < bin_ else "ab")
    x, y, w = sh.tokens * bin_ * sh.e, sh.tokens * bout * sh.e, bin_ * bout * sh.e
    book.add("broadcast", col, q, q * w, q, fwd=True)
    book.add("broadcast", col, q, q * w, q)
    book.add("reduce", col, q, q * w, q)
    if form == "ab":
        book.add("broadcast", row, q, q * x, q, fwd=True)
        book.add("broadcast", row, q, q * x, q)
        book.add("reduce", row, q, q * x, q)
    else:
        book.add("reduce", row, q, q * y, q, fwd=True)
        book.add("broadcast", row, q, q * y, q)
    if bias:
        book.add("all_reduce", col, q, bout * sh.pe)
    if dep is not None:
        book.add("all_reduce", dep, d, bin_ * bout * sh.pe + (bout * sh.pe if bias else 0), 2 if bias else 1)


def _summa_norm(book: _Book, m: ModelSpec, layout: Layout, sh: _Shape) -> None:
    """SUMMA LayerNorm: mean and variance all-reduced along the row forward and backward; the
    weight and bias gradients over the column (and 2.5D's depth)."""
    row, col, dep = _summa_axes(layout)
    q, vectors = layout.grid, 2 if m.norm == "layernorm" else 1
    book.add("all_reduce", row, q, 2 * sh.tokens * sh.er, 2, fwd=True)
    book.add("all_reduce", row, q, 2 * sh.tokens * sh.er, 2)
    book.add("all_reduce", col, q, vectors * sh.width * sh.pe, vectors)
    if dep is not None:
        book.add("all_reduce", dep, layout.depth, vectors * sh.width * sh.pe, vectors)


def _cube_linear(book: _Book, layout: Layout, sh: _Shape, fin: int, fout: int, groups: int, bias: bool,
                 again: bool = True) -> None:  # fmt: skip
    """Agarwal's 3D Linear (tp3d/functional.py): the input gathered along 3d_input, the weight
    along 3d_weight (again in backward), the output reduce-scattered along 3d_output, and back.
    ``again``: a recompute reduces the output again too (not a block's last Linear: the
    recompute stops at the last tensor the backward needs)."""
    q = layout.grid
    f_in, f_out = _blocks(fin, q * q), _blocks(fout, q * q, groups)
    x_o, w_o, y_o = sh.tokens * q * f_in * sh.e, q * f_out * q * f_in * sh.e, sh.tokens * q * f_out * sh.e
    book.add("all_gather", "3d_input", q, x_o, fwd=True)
    book.add("reduce_scatter", "3d_input", q, x_o)
    book.add("all_gather", "3d_weight", q, w_o, fwd=True)
    book.add("all_gather", "3d_weight", q, w_o)
    book.add("reduce_scatter", "3d_weight", q, w_o)
    book.add("reduce_scatter", "3d_output", q, y_o, fwd=again)
    book.add("all_gather", "3d_output", q, y_o)
    if bias:
        book.add("all_reduce", "3d_weight", q, f_out * sh.pe)


def _cube_norm(book: _Book, m: ModelSpec, layout: Layout, sh: _Shape) -> None:
    """3D LayerNorm: mean and variance (forward) and the two gradient sums (backward) over both
    hidden axes; the parameters' gradients over 3d_weight."""
    q, vectors = layout.grid, 2 if m.norm == "layernorm" else 1
    for axis in ("3d_input", "3d_output"):
        book.add("all_reduce", axis, q, 2 * sh.tokens * sh.er, 2, fwd=True)
        book.add("all_reduce", axis, q, 2 * sh.tokens * sh.er, 1)
    book.add("all_reduce", "3d_weight", q, vectors * sh.width * sh.pe, vectors)


def _block_tensor(book: _Book, m: ModelSpec, layout: Layout, sh: _Shape) -> None:
    """One block's tensor-parallel traffic, forward and backward."""
    mode = layout.tensor_mode
    if layout.tensor == 1:
        return
    if mode == "1d":
        _block_1d(book, m, layout, sh)
        return
    for i, (fin, fout, groups) in enumerate(_linears(m)):
        if mode == "3d":
            _cube_linear(book, layout, sh, fin, fout, groups, m.biases, again=i < 3)
        else:
            _summa_linear(book, layout, sh, fin, fout, groups, m.biases)
    for _ in range(2):
        (_cube_norm if mode == "3d" else _summa_norm)(book, m, layout, sh)


# ---- embeddings, head and loss ---------------------------------------------------------------


def _embedding_tensor(book: _Book, m: ModelSpec, layout: Layout, sh: _Shape) -> None:
    """The first stage's vocabulary-parallel lookup and learned positions (the GPT's layers in
    each mode); a ViT's patch embedding is counted as a position table."""
    q, mode, tokens = layout.grid, layout.tensor_mode, sh.tokens
    positions = m.max_positions or m.seq_len
    vocab = m.family != "vit"
    if mode == "1d":
        full = sh.b * (sh.s // layout.sequence) * m.d_model * sh.er
        book.add("all_reduce", "tensor", q, full if vocab else 0)
        book.add("all_gather", "tensor", q, full if m.learned_positions else 0)
        book.add("all_gather", "tensor", q, full if layout.sequence_parallel else 0)  # into the regions: backward
    elif mode == "3d":
        rows = sh.tokens * q  # B' s: the cube's batch
        if vocab:
            book.add("reduce_scatter", "3d_input", q, rows * q * sh.width * sh.er)
            book.add("all_gather", "3d_input", q, rows * q * sh.width * sh.er)
            book.add("reduce_scatter", "3d_weight", q, rows * sh.width * sh.er)
            book.add("all_gather", "3d_weight", q, rows * sh.width * sh.er)
        if m.learned_positions:
            book.add("all_reduce", "3d_weight", q, positions * sh.width * sh.pe)
    else:
        row, col, dep = _summa_axes(layout)
        if vocab:
            book.add("reduce_scatter", row, q, q * tokens * sh.width * sh.er)
            book.add("all_gather", row, q, q * tokens * sh.width * sh.er)
            book.add("send", "tensor", q, 2 * tokens * sh.width * sh.er, 2)  # the grid transpose, off the diagonal
            book.add("recv", "tensor", q, 2 * tokens * sh.width * sh.er, 2)
            if dep is not None:
                book.add("all_reduce", dep, layout.depth, _blocks(m.vocab_size, q) * sh.width * sh.pe)
        if m.learned_positions:
            table = _blocks(positions, q) * sh.width * sh.pe
            book.add("all_gather", col, q, q * table)
            book.add("reduce_scatter", col, q, q * table)
            if dep is not None:
                book.add("all_reduce", dep, layout.depth, table)


def _head_tensor(book: _Book, m: ModelSpec, layout: Layout, sh: _Shape) -> None:
    """The last stage's final norm, vocabulary-parallel classifier and cross entropy (its max
    and sums in fp32 over the class-splitting groups, the mean over the batch blocks)."""
    q, mode = layout.grid, layout.tensor_mode
    if m.family == "vit":
        return
    if mode == "1d":
        full = sh.b * (sh.s // layout.sequence) * m.d_model * sh.er
        if layout.sequence_parallel:
            vectors = 2 if m.norm == "layernorm" else 1
            book.add("all_reduce", "tensor", q, m.norm_params() * sh.pe, vectors)
            book.add("all_gather", "tensor", q, full)  # out of the regions, forward
        book.add("all_reduce", "tensor", q, full)  # the classifier's input gradient
        book.add("all_reduce", "tensor", q, 3 * sh.b * (sh.s // layout.sequence) * 4, 2)
    elif mode == "3d":
        _cube_norm(book, m, layout, sh)
        _cube_linear(book, layout, sh, m.d_model, m.vocab_size, 1, False)
        for axis in ("3d_input", "3d_output"):
            book.add("all_reduce", axis, q, 3 * sh.tokens * 4, 2)
        book.add("all_reduce", "3d_weight", q, 8, 2)
    else:
        row, col, dep = _summa_axes(layout)
        _summa_norm(book, m, layout, sh)
        _summa_linear(book, layout, sh, m.d_model, m.vocab_size, 1, False, "ab" if m.tie_weights else None)
        book.add("all_reduce", row, q, 3 * sh.tokens * 4, 2)
        book.add("all_reduce", col, q, 8, 2)
        if dep is not None:
            book.add("all_reduce", dep, layout.depth, 8, 2)


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
    mat, vec = layout.splits
    t, h = layout.tensor, model.d_model
    block_vectors = float(model.block_vector_params())
    if layout.tensor_mode == "1d" and model.biases and t > 1:  # the column layers' biases are split
        column = _linears(model)[0][1] + _linears(model)[2][1]
        block_vectors -= column - column / t
    total = stage.blocks * (model.block_matrix_params() / mat + block_vectors / vec)
    table = model.vocab_size * h if model.family != "vit" else model.patch_dim * h
    positions = model.embedding_params() - table
    if stage.embedding:
        pos_split = t if layout.tensor_mode == "1d" else vec if layout.tensor_mode == "3d" else mat
        total += table / mat + positions / pos_split
    if stage.head:
        total += model.norm_params() / vec + (model.head_params() - model.norm_params()) / mat
        if model.tie_weights and not stage.embedding and model.family != "vit":
            total += table / mat  # the head's copy of the tied table
    return total


def _pipeline_traffic(book: _Book, m: ModelSpec, layout: Layout, sh: _Shape, stage: Stage) -> None:
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


def _block_sequence(book: _Book, m: ModelSpec, layout: Layout, sh: _Shape) -> None:
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
        for op in _P2P:
            book.add(op, "sequence", n, hops * 2 * kv * sh.e, hops, fwd=True)
            book.add(op, "sequence", n, hops * 2 * kv * (sh.e + 4), 2 * hops)
    elif layout.sequence_mode == "ring_qk":
        for op in _P2P:
            book.add(op, "sequence", n, 2 * hops * kv * sh.e, 2 * hops, fwd=True)
            book.add(op, "sequence", n, 4 * hops * kv * sh.e, 4 * hops)
    else:
        book.add("all_to_all", "sequence", n, (2 * h + 2 * kv) * sh.e, 4, fwd=True)
        book.add("all_to_all", "sequence", n, (2 * h + 2 * kv) * sh.e, 4)


def replica_axis(layout: Layout) -> tuple[str, int]:
    """The group that averages gradients and that ZeRO shards over: ``data``, or ``data+sequence``
    when the sequence is split (its ranks hold the same parameters)."""
    return ("data+sequence" if layout.sequence > 1 else "data"), layout.data * layout.sequence


def zero_chunks(model: ModelSpec, layout: Layout, stage: Stage, element: int) -> int:
    """ZeRO chunks (and DDP buckets) of a stage: one per layer at least, none over the bucket size."""
    mat, vec = layout.splits
    block = (model.block_matrix_params() / mat + model.block_vector_params() / vec) * element
    per_block = math.ceil(block / BUCKET_BYTES)
    ends = (2 if model.learned_positions else 1) * stage.embedding + stage.head
    return stage.blocks * per_block + ends


def _data_traffic(book: _Book, m: ModelSpec, layout: Layout, st: Stage, sh: _Shape) -> None:
    """Gradient averaging over the replicas: DDP's bucket all-reduce (a pipeline's one flat
    all-reduce), ZeRO's reduce-scatter and all-gather of the chunks (stage 2 reduces, stage 3
    also gathers, every micro-step), and the step's loss (4 bytes)."""
    axis, n = replica_axis(layout)
    if n == 1:
        return
    grads = local_parameters(m, layout, st) * sh.pe
    chunks = zero_chunks(m, layout, st, sh.pe)
    micro = layout.accumulation
    if layout.zero == 0:
        calls = 1 if layout.pipeline > 1 else max(1, math.ceil((grads - 2**20) / BUCKET_BYTES) + 1)
        book.add("all_reduce", axis, n, grads, calls)
    elif layout.zero == 1:
        book.add("reduce_scatter", axis, n, grads, chunks)
        if layout.pipeline > 1:  # every stage's optimizer holds the whole model's chunks and gathers them all
            whole = Stage(m.n_layers, True, True)
            grads, chunks = local_parameters(m, layout, whole) * sh.pe, zero_chunks(m, layout, whole, sh.pe)
        book.add("all_gather", axis, n, grads, chunks)
    else:
        book.add("reduce_scatter", axis, n, micro * grads, micro * chunks)
        gathers = 1 if layout.zero == 2 else 2 * micro
        book.add("all_gather", axis, n, gathers * grads, gathers * chunks)
    book.add("all_reduce", axis, n, 4)


def stage_traffic(model: ModelSpec, layout: Layout, workload: Workload, stage: Stage) -> dict[tuple[str, str], Traffic]:
    """Logical bytes and calls per (op, axis) of one optimizer step on a rank of ``stage``, as
    tessera's comm ledger counts them."""
    sh = _shape(model, layout, workload)
    book = _Book()
    book.times = stage.blocks * layout.microbatches
    # selective recomputation reruns the collectives between the kept matmul outputs, as full does
    book.recompute = 0.0 if layout.checkpoint == "none" else 1.0
    _block_tensor(book, model, layout, sh)
    _block_sequence(book, model, layout, sh)
    book.recompute, book.times = 0.0, layout.microbatches
    if stage.embedding:
        _embedding_tensor(book, model, layout, sh)
    if stage.head:
        _head_tensor(book, model, layout, sh)
    _pipeline_traffic(book, model, layout, sh, stage)
    book.times = 1
    _data_traffic(book, model, layout, stage, sh)
    return book.traffic()


def step_traffic(model: ModelSpec, layout: Layout, workload: Workload) -> dict[tuple[str, str], Traffic]:
    """:func:`stage_traffic` of every pipeline stage, the most of them per (op, axis): what the
    comm ledger shows on the rank that moves the most on each."""
    out: dict[tuple[str, str], Traffic] = {}
    for stage in set(stages(model, layout.pipeline, layout.chunks)):
        for key, t in stage_traffic(model, layout, workload, stage).items():
            if key not in out or t.bytes > out[key].bytes:
                out[key] = t
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
    and of the head; embeddings are lookups."""
    s = workload.seq_len or model.seq_len
    q, mode = layout.grid, layout.tensor_mode
    batch = layout.micro_batch
    if layout.tensor > 1 and mode in ("2d", "2.5d"):
        batch = _up(batch, layout.depth * q)
    elif layout.tensor > 1 and mode == "3d":
        batch = _up(batch, q)
    tokens = batch * s // layout.sequence
    block = model.block_forward_flops(tokens, s) / layout.tensor
    attention = block - 2.0 * tokens * model.block_matrix_params() / layout.tensor
    head = model.head_forward_flops(tokens) / layout.tensor if stage.head else 0.0
    forward = stage.blocks * block + head
    extra = {"none": 0.0, "full": block, "selective": attention}[layout.checkpoint]
    recompute = stage.blocks * extra
    attended = stage.blocks * attention * (3 + (layout.checkpoint != "none"))
    return StageWork(forward, 2 * forward, recompute, attended, block)


# ---- links -------------------------------------------------------------------------------------------


def axis_span(layout: Layout, axis: str) -> int:
    """Consecutive ranks one group of ``axis`` spans (the axis and every axis inside it, tensor
    innermost, then sequence, pipeline, data): its ranks share a node when this fits in one."""
    q = layout.grid
    if axis in ("2d_row", "2.5d_row", "3d_output"):
        return q
    if axis in ("2d_col", "2.5d_col", "3d_input"):
        return q * q
    if axis in ("tensor", "2.5d_dep", "3d_weight"):
        return layout.tensor
    if axis == "sequence":
        return layout.tensor * layout.sequence
    if axis == "pipeline":
        return layout.tensor * layout.sequence * layout.pipeline
    return layout.world


def base_axis(axis: str) -> str:
    """The mesh axis a ledger axis belongs to: a tensor mode's sub-axes are ``tensor``'s,
    ``data+sequence`` (the replicas) is ``data``'s."""
    if axis.startswith(("2d_", "2.5d_", "3d_")):
        return "tensor"
    return "data" if axis == "data+sequence" else axis


def _measured(links: dict[str, Link], op: str, group: int) -> Link | None:
    """Calibration's link of ``op`` for the measured group size nearest to ``group``."""
    kind = "p2p" if op in _P2P else op
    sizes = [int(k.split(":")[1]) for k in links if k.startswith(kind + ":")]
    if not sizes:
        return None
    nearest = min(sizes, key=lambda n: (abs(math.log2(n) - math.log2(max(group, 1))), -n))
    return links[f"{kind}:{nearest}"]


def axis_link(cluster: Cluster, layout: Layout, axis: str, op: str = "all_reduce", group: int = 2) -> Link:
    """The link ``op`` on ``axis`` (a group of ``group`` ranks) runs over: ``cluster.axis_links``
    by the axis's name, then by its base axis's, then calibration's ``"OP:SIZE"`` entries (send and
    recv as ``p2p``, the nearest size), else ``intra`` when the group's span fits in a node."""
    links = cluster.axis_links
    if links:
        for key in (axis, base_axis(axis)):
            if key in links:
                return links[key]
        found = _measured(links, op, group)
        if found is not None:
            return found
    return cluster.intra if axis_span(layout, axis) <= cluster.devices_per_node else cluster.inter


# ---- the pipeline bubble ---------------------------------------------------------------------------


def bubble_closed_form(schedule: str, p: int, m: int, v: int, f: float, b: float, w: float) -> float | None:
    """Idle time of a rank in one step, with ``f``, ``b``, ``w`` a stage's forward, input-gradient
    and weight-gradient time per micro-batch: ``(p-1)(f+b+w)/v`` for GPipe, 1F1B and interleaved
    (``v`` chunks), ``(p-1)(f+b-w)`` for ZB-H1 where ``w <= min(f, b)``; None where no closed form
    is known to hold. Transfers free; tessera's runtime (receives posted early and waited for
    lazily) meets these for any costs, which ``tests/unit/test_planner_timing.py`` checks
    against the simulator."""
    if p == 1:
        return 0.0
    if schedule in ("gpipe", "1f1b", "interleaved"):
        return (p - 1) * (f + b + w) / (v if schedule == "interleaved" else 1)
    if schedule == "zero_bubble" and w <= min(f, b):
        return (p - 1) * (f + b - w)
    return None


@lru_cache(maxsize=1024)
def simulated_bubble(schedule: str, p: int, m: int, v: int, f: int, b: int, w: int) -> float:
    """Idle time of a rank in one step from the schedule simulator (tessera's runtime model:
    ``post_early`` lists, lazy receives), in the units of the integer costs ``f``, ``b``, ``w``
    (per chunk and micro-batch). Cached: the search asks for the same few shapes again and again."""
    from tessera.parallel.pipeline.p2p_placement import post_early
    from tessera.parallel.pipeline.schedules import build_schedule
    from tessera.parallel.pipeline.simulate import simulate

    costs = {"F": f, "B": b, "W": w}
    actions = [post_early(rank) for rank in build_schedule(schedule, p, m, v, costs=costs)]
    result = simulate(actions, costs, lazy_receive=True)
    return float(result.makespan) - m * v * (f + b + w)


def pipeline_bubble(schedule: str, p: int, m: int, v: int, f: float, b: float, w: float) -> float:
    """Idle seconds of a pipeline rank in one step (:func:`bubble_closed_form`, else the cached
    simulator on costs rounded to 1/16 of the forward)."""
    closed = bubble_closed_form(schedule, p, m, v, f, b, w)
    if closed is not None or f <= 0:
        return closed or 0.0
    unit = f / v / 16  # the simulator's costs are per chunk
    fq, bq, wq = max(1, round(f / v / unit)), max(1, round(b / v / unit)), round(w / v / unit)
    return simulated_bubble(schedule, p, m, v, fq, bq, wq) * unit


# ---- the step ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _StagePlan:
    stage: Stage
    traffic: tuple[Traffic, ...]
    work: StageWork
    parameters: float  # local_parameters of the stage


@lru_cache(maxsize=16384)
def _plans(model: ModelSpec, layout: Layout, workload: Workload) -> tuple[tuple[_StagePlan, int], ...]:
    """What does not depend on the cluster, once per distinct stage, with how many pipeline ranks
    hold such a stage."""
    cut = stages(model, layout.pipeline, layout.chunks)
    out = []
    for st in dict.fromkeys(cut):
        traffic = tuple(stage_traffic(model, layout, workload, st).values())
        plan = _StagePlan(st, traffic, stage_work(model, layout, workload, st), local_parameters(model, layout, st))
        out.append((plan, cut.count(st)))
    return tuple(out)


def _hidden_behind(t: float, calls: float, window: float) -> float:
    """Exposed seconds of ``t`` of communication in ``calls`` pieces, each started when its data is
    ready during ``window`` seconds of compute: the last piece, and what does not fit."""
    last = t / calls if calls else t
    return last + max(0.0, t - last - window)


def _data_exposed(layout: Layout, secs: dict[str, float], calls: dict[str, float], fwd: float, bwd: float) -> float:
    """Exposed seconds of the replica axis: DDP's buckets overlap the last backward (a pipeline's
    one all-reduce does not); ZeRO-1 reduces and gathers at the step; ZeRO-2 reduces each
    micro-step behind its backward and gathers at the step; ZeRO-3 also gathers in the forward
    (prefetching) and the backward. ``fwd``, ``bwd``: seconds of one micro-step's passes."""
    ar, rs, ag = (secs.get(op, 0.0) for op in ("all_reduce", "reduce_scatter", "all_gather"))
    micro = layout.accumulation
    if layout.zero == 0:
        return ar if layout.pipeline > 1 else _hidden_behind(ar, calls.get("all_reduce", 1), bwd)
    if layout.zero == 1:
        return ar + rs + ag
    rs_calls, ag_calls = calls.get("reduce_scatter", 1) / micro, calls.get("all_gather", 1) / micro
    rs_step = rs / micro
    if layout.zero == 2:
        return ar + ag + micro * _hidden_behind(rs_step, rs_calls, bwd)
    half = ag / micro / 2  # each micro-step gathers every chunk for the forward and again for the backward
    forward = _hidden_behind(half, ag_calls / 2, fwd)
    backward = rs_step / rs_calls + max(0.0, half + rs_step - rs_step / rs_calls - bwd) if rs_calls else half + rs_step
    return ar + micro * (forward + backward)


@dataclass(frozen=True)
class _StageTime:
    compute: float
    comm: dict[str, float]
    exposed: float
    per_micro: float  # critical-path seconds of one micro-batch (compute and exposed tensor/sequence)
    work: StageWork


def _stage_time(plan: _StagePlan, layout: Layout, cluster: Cluster) -> _StageTime:
    """Seconds of one stage's step before the bubble and the optimizer."""
    m, rate = layout.microbatches, cluster.flops
    secs: dict[tuple[str, str], float] = {}
    for t in plan.traffic:
        secs[t.op, t.axis] = axis_link(cluster, layout, t.axis, t.op, t.group).time(t.bytes, t.calls)
    comm = dict.fromkeys(BASE_AXES, 0.0)
    for (_, axis), sec in secs.items():
        comm[base_axis(axis)] += sec
    work = plan.work
    fwd, bwd = _pass_seconds(plan, layout, cluster)
    compute = m * (fwd + bwd)
    # overlap needs idle hardware to move the bytes: ranks sharing cores have none (gloo's copies
    # and sums run on the cores that compute), so there communication adds to compute
    overlap = ranks_per_core(cluster) <= 1.0
    seq = comm["sequence"]
    if layout.sequence_mode == "ring" and overlap:  # transfers overlap the block computations
        seq = max(0.0, seq - m * work.attention / rate)
    critical = comm["tensor"] + seq
    replica = replica_axis(layout)[0]
    data_secs = {op: sec for (op, axis), sec in secs.items() if axis == replica}
    data_calls = {t.op: t.calls for t in plan.traffic if t.axis == replica}
    exposed = critical + (
        _data_exposed(layout, data_secs, data_calls, fwd, bwd) if overlap else sum(data_secs.values())
    )
    exposed += _pipeline_exposed(layout, cluster, plan.traffic, secs)
    return _StageTime(compute, comm, exposed, (compute + critical) / m, work)


def _pass_seconds(plan: _StagePlan, layout: Layout, cluster: Cluster) -> tuple[float, float]:
    """Seconds of one micro-batch's forward and backward (recomputation included) on a rank of
    the stage: flops over the rate, plus each block's fixed cost (a third in the forward), and
    checkpointing's recompute as calibration measured it (its flops where it did not)."""
    work, rate, blocks = plan.work, cluster.flops, plan.stage.blocks
    fixed = blocks * cluster.block_overhead
    forward = work.forward / rate + fixed / 3
    backward = work.backward / rate + 2 * fixed / 3
    cost = cluster.recompute_cost.get(layout.checkpoint) if layout.checkpoint != "none" else None
    if cost is None:
        backward += work.recompute / rate
    else:
        backward += blocks * (cost - 1.0) * (3 * work.block / rate + cluster.block_overhead)
    return forward, backward


def _pipeline_exposed(layout: Layout, cluster: Cluster, traffic: tuple[Traffic, ...],
                      secs: dict[tuple[str, str], float]) -> float:  # fmt: skip
    """The tied embedding's all-reduce, and the transfers of the fill and the drain (one
    activation down the pipeline and one gradient up): steady-state transfers overlap, but for
    ranks sharing cores, where every transfer takes its time from the compute."""
    p = layout.pipeline
    if p == 1:
        return 0.0
    exposed = secs.get(("all_reduce", "pipeline"), 0.0)
    if ranks_per_core(cluster) > 1.0:
        return exposed + sum(sec for (op, axis), sec in secs.items() if axis == "pipeline" and op != "all_reduce")
    for t in traffic:
        if t.op == "send" and t.axis == "pipeline" and t.calls:
            exposed += 2 * (p - 1) * axis_link(cluster, layout, "pipeline", "send", p).time(t.bytes / t.calls)
    return exposed


def _optimizer_time(heaviest: float, layout: Layout, workload: Workload, cluster: Cluster) -> float:
    """The elementwise update of the ``heaviest`` stage's fp32 parameters on a rank (a ZeRO shard:
    1/replicas), on the device, or with offload on the host plus the copies of gradients down and
    parameters up."""
    shard = heaviest / (replica_axis(layout)[1] if layout.zero else 1)
    if not layout.offload:
        return 4 * shard / (cluster.optimizer_rate or cluster.flops / 8)
    host_rate = cluster.optimizer_rate or DEFAULT_HOST_OPTIMIZER_RATE
    copies = 2 * shard * workload.element_bytes / (cluster.host_link or cluster.intra.bandwidth)
    return 4 * shard / host_rate + copies


def predict_time(model: ModelSpec, layout: Layout, workload: Workload, cluster: Cluster) -> TimeEstimate:
    """Seconds of one optimizer step of ``layout`` on ``cluster``: the slowest stage's compute
    and exposed communication, the pipeline bubble behind it, and the optimizer step. Where ranks
    share cores (``ranks_per_core`` k > 1: CPU ranks), a waiting rank's core runs the others'
    work: the step is the mean rank's busy time, or the slowest rank's path run k times faster
    with its bubble, whichever is longer (compute and exposed_comm are then the mean rank's)."""
    plans = _plans(model, layout, workload)
    times = [(_stage_time(plan, layout, cluster), count) for plan, count in plans]
    slow = max((t for t, _ in times), key=lambda t: t.compute + t.exposed)
    bubble = _bubble(layout, slow)
    optimizer = _optimizer_time(max(plan.parameters for plan, _ in plans), layout, workload, cluster)
    shared = ranks_per_core(cluster)
    if shared <= 1.0:
        return TimeEstimate(
            slow.compute, slow.comm, slow.exposed, bubble, optimizer, slow.compute + slow.exposed + bubble + optimizer
        )
    ranks = sum(count for _, count in times)
    compute = sum(t.compute * count for t, count in times) / ranks
    exposed = sum(t.exposed * count for t, count in times) / ranks
    path = (slow.compute + slow.exposed + bubble) / shared
    wait = max(0.0, path - compute - exposed)
    return TimeEstimate(compute, slow.comm, exposed, wait, optimizer, compute + exposed + wait + optimizer)


def ranks_per_core(cluster: Cluster) -> float:
    """Ranks sharing one core (calibration measures it for CPU ranks); 1: each rank its own."""
    return cluster.ranks_per_core


def _bubble(layout: Layout, slow: _StageTime) -> float:
    """The idle time of the slowest stage's pipeline: its micro-batch's forward, input-gradient
    (with recomputation) and weight-gradient times (exposed tensor and sequence communication
    shared out in proportion) into the schedule's bubble."""
    if layout.pipeline == 1:
        return 0.0
    w = slow.work
    scale = slow.per_micro / w.total if w.total else 0.0
    f, b, wt = w.forward * scale, (w.backward / 2 + w.recompute) * scale, w.backward / 2 * scale
    return pipeline_bubble(layout.schedule, layout.pipeline, layout.microbatches, layout.chunks, f, b, wt)
