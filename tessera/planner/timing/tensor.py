"""Tensor-parallel traffic of one micro-batch, per family of tensor modes: Megatron's 1D,
SUMMA (2D and 2.5D) and the 3D cube, for a block, the first stage's embedding and the last
stage's head and loss (docs/tensor-parallel.md, "Costs")."""

from __future__ import annotations

from tessera.planner.layout import Layout
from tessera.planner.spec import ModelSpec
from tessera.planner.timing.counting import Book, Shape, block_linears, blocks_per_rank

# ---- tensor parallelism: one block -------------------------------------------------------------


def _block_1d(book: Book, m: ModelSpec, layout: Layout, sh: Shape) -> None:
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


def _summa_linear(book: Book, layout: Layout, sh: Shape, fin: int, fout: int, groups: int, bias: bool,
                  form: str | None = None) -> None:  # fmt: skip
    """A SUMMA Linear, forward and backward (tp2d/functional.py's table; keep_blocks off): W
    blocks broadcast twice and reduced once along the column; "ab" moves X along the row the
    same way, "abt" reduces Y and broadcasts dY; bias (and 2.5D's depth) gradients all-reduced.
    A recompute runs all of its forward again (its output is made inside the product)."""
    row, col, dep = _summa_axes(layout)
    q, d = layout.grid, layout.depth
    bin_, bout = blocks_per_rank(fin, q), blocks_per_rank(fout, q, groups)
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


def _summa_norm(book: Book, m: ModelSpec, layout: Layout, sh: Shape) -> None:
    """SUMMA LayerNorm: mean and variance all-reduced along the row forward and backward; the
    weight and bias gradients over the column (and 2.5D's depth)."""
    row, col, dep = _summa_axes(layout)
    q, vectors = layout.grid, 2 if m.norm == "layernorm" else 1
    book.add("all_reduce", row, q, 2 * sh.tokens * sh.er, 2, fwd=True)
    book.add("all_reduce", row, q, 2 * sh.tokens * sh.er, 2)
    book.add("all_reduce", col, q, vectors * sh.width * sh.pe, vectors)
    if dep is not None:
        book.add("all_reduce", dep, layout.depth, vectors * sh.width * sh.pe, vectors)


def _cube_linear(book: Book, layout: Layout, sh: Shape, fin: int, fout: int, groups: int, bias: bool,
                 again: bool = True) -> None:  # fmt: skip
    """Agarwal's 3D Linear (tp3d/functional.py): the input gathered along 3d_input, the weight
    along 3d_weight (again in backward), the output reduce-scattered along 3d_output, and back.
    ``again``: a recompute reduces the output again too (not a block's last Linear: the
    recompute stops at the last tensor the backward needs)."""
    q = layout.grid
    f_in, f_out = blocks_per_rank(fin, q * q), blocks_per_rank(fout, q * q, groups)
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


def _cube_norm(book: Book, m: ModelSpec, layout: Layout, sh: Shape) -> None:
    """3D LayerNorm: mean and variance (forward) and the two gradient sums (backward) over both
    hidden axes; the parameters' gradients over 3d_weight."""
    q, vectors = layout.grid, 2 if m.norm == "layernorm" else 1
    for axis in ("3d_input", "3d_output"):
        book.add("all_reduce", axis, q, 2 * sh.tokens * sh.er, 2, fwd=True)
        book.add("all_reduce", axis, q, 2 * sh.tokens * sh.er, 1)
    book.add("all_reduce", "3d_weight", q, vectors * sh.width * sh.pe, vectors)


def block_tensor(book: Book, m: ModelSpec, layout: Layout, sh: Shape) -> None:
    """One block's tensor-parallel traffic, forward and backward."""
    mode = layout.tensor_mode
    if layout.tensor == 1:
        return
    if mode == "1d":
        _block_1d(book, m, layout, sh)
        return
    for i, (fin, fout, groups) in enumerate(block_linears(m)):
        if mode == "3d":
            _cube_linear(book, layout, sh, fin, fout, groups, m.biases, again=i < 3)
        else:
            _summa_linear(book, layout, sh, fin, fout, groups, m.biases)
    for _ in range(2):
        (_cube_norm if mode == "3d" else _summa_norm)(book, m, layout, sh)


# ---- embeddings, head and loss ---------------------------------------------------------------


def embedding_tensor(book: Book, m: ModelSpec, layout: Layout, sh: Shape) -> None:
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
                book.add("all_reduce", dep, layout.depth, blocks_per_rank(m.vocab_size, q) * sh.width * sh.pe)
        if m.learned_positions:
            table = blocks_per_rank(positions, q) * sh.width * sh.pe
            book.add("all_gather", col, q, q * table)
            book.add("reduce_scatter", col, q, q * table)
            if dep is not None:
                book.add("all_reduce", dep, layout.depth, table)


def head_tensor(book: Book, m: ModelSpec, layout: Layout, sh: Shape) -> None:
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
