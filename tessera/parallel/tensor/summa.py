"""SUMMA on a q x q grid: the building blocks shared by 2D (Optimus) and 2.5D (Tesseract).

A matrix ``A [m, k]`` lives on the grid as blocks: rank ``(i, j)`` holds ``A_ij``, the block of
rows ``i`` and columns ``j`` (sizes padded to a multiple of q). ``row`` is the group of the grid
row through this rank (its members differ in ``j``; ``row.rank == j``), ``col`` the group of the
grid column (``col.rank == i``). Each product takes q steps; at step ``l`` one or two blocks
travel, broadcast from grid column or row ``l``, and a partial result may be reduced onto it:

==========  ========================================  =========================================
product     step ``l`` on rank ``(i, j)``             logical bytes per rank (q steps)
==========  ========================================  =========================================
C = A B     broadcast ``A_il`` on the row,            (q-1) (|A_ij| + |B_ij|)
            ``B_lj`` on the column; C_ij += A_il B_lj  C stays: A and B move
C = A B^T   broadcast ``B_lj`` on the column;         (q-1) (|B_ij| + |C_ij|)
            reduce A_ij B_lj^T onto ``(i, l)`` (row)   A stays: B and C move
C = A^T B   broadcast ``A_il`` on the row;            (q-1) (|A_ij| + |C_ij|)
            reduce A_il^T B_ij onto ``(l, j)`` (col)   B stays: A and C move
==========  ========================================  =========================================

So which operand stays put is a choice: a Linear ``Y = X W^T`` can run as ``C = A B``
(``A = X``, ``B = W^T``: the output stays) or as ``C = A B^T`` (``A = X``, ``B = W``: the input
stays), with its weight's blocks stored to suit (``tp2d.functional``). ``C = A^T B`` is
``C = A B^T`` on the transposed grid (rows and columns swapped, every block transposed).

Backward. Each product's gradients are the other two products, run together in one loop of q
steps so that a block both need travels once:

* ``C = A B``: ``dA = dC B^T`` (B_lj on the column, reduce along the row) and ``dB = A^T dC``
  (A_il on the row, reduce along the column): ``(q-1) (2|A| + 2|B|)``; in all ``3 (q-1) (|A| + |B|)``.
* ``C = A B^T``: ``dA = dC B`` and ``dB = dC^T A`` both need ``dC_il`` (broadcast on the row,
  once), ``dA`` the ``B_lj`` (column) and ``dB`` a reduce along the column:
  ``(q-1) (|C| + 2|B|)``; in all ``(q-1) (2|C| + 3|B|)``.

``keep=True`` keeps the q blocks that arrived in the forward for the backward instead of
broadcasting them again (the Optimus memory trade, reversed): ``C = A B`` then moves
``2 (q-1) (|A| + |B|)`` and holds ``q (|A| + |B|)`` for backward instead of ``|A| + |B|``;
``C = A B^T`` moves ``2 (q-1) (|B| + |C|)`` and holds ``q |B|`` instead of ``|B|``.

2.5D runs the same steps inside each of its ``depth`` grids. Every broadcast starts one step
ahead (``comm.broadcast_async``), so the next block travels while this step multiplies.

Besides the products: the grid transpose (block ``(i, j)`` to ``(j, i)``), and splitting and
gathering a ``[batch, (seq,) hidden]`` activation, whose batch is split over the grid's rows
(and grids) and hidden over its columns. This rank's place in the grid(s) is a
:class:`~tessera.parallel.tensor.grid.SummaGrid`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tessera import comm
from tessera.comm import AxisGroup
from tessera.parallel.tensor.common import pad_dim
from tessera.parallel.tensor.grid import SummaGrid

__all__ = [
    "SummaGrid",
    "batch_block",
    "gather_activation",
    "grid_batch",
    "grid_transpose",
    "matmul_ab",
    "matmul_abt",
    "matmul_atb",
    "split_activation",
    "summa_ab",
    "summa_abt",
    "summa_atb",
]


# ---- blocks on the move ----------------------------------------------------------------------


class _Block:
    """Member ``src``'s block arriving on every member of ``group`` (blocks have equal shapes);
    started at construction, ``get()`` waits for it."""

    def __init__(self, block: torch.Tensor, group: AxisGroup, src: int) -> None:
        self.transposed = not block.is_contiguous() and block.dim() == 2 and block.t().is_contiguous()
        if self.transposed:
            block = block.t()  # a transposed weight goes as stored
        block = block.contiguous()
        buf = block if group.size == 1 or group.rank == src else torch.empty_like(block)
        self.pending: comm.Pending | None = None
        if torch.compiler.is_compiling():  # a compiled graph's broadcast op (no overlap, no graph break)
            self.received = comm.broadcast(buf, group, src)
        else:
            self.pending = comm.broadcast_async(buf, group, src)

    def get(self) -> torch.Tensor:
        out = self.pending.wait() if self.pending is not None else self.received
        return out.t() if self.transposed else out


class _Stream:
    """Every member's ``block`` along ``group`` in turn (member ``l``'s at step ``l``), each
    broadcast one step ahead; or, with ``kept``, the blocks an earlier pass received, with no
    communication. ``received`` lists the blocks handed out, for keeping."""

    def __init__(self, block: torch.Tensor | None, group: AxisGroup, kept: Sequence[torch.Tensor] = ()) -> None:
        self.block, self.group, self.kept = block, group, tuple(kept)
        self.received: list[torch.Tensor] = []
        self._ahead = _Block(block, group, 0) if block is not None else None

    @classmethod
    def of(cls, kept: Sequence[torch.Tensor], group: AxisGroup) -> _Stream:
        return cls(None, group, kept)

    def at(self, step: int) -> torch.Tensor:
        if self._ahead is None:
            return self.kept[step]
        assert self.block is not None
        block = self._ahead.get()
        if step + 1 < self.group.size:
            self._ahead = _Block(self.block, self.group, step + 1)
        self.received.append(block)
        return block


def _reduce_onto(part: torch.Tensor, group: AxisGroup, step: int, mine: torch.Tensor | None) -> torch.Tensor | None:
    """``part`` summed over ``group`` onto member ``step``: the sum if this is that member, else
    ``mine`` (what this member got at an earlier step). Every member calls it at every step."""
    total = comm.reduce(part, group, dst=step)
    return total if group.rank == step else mine


# ---- SUMMA products (no autograd) ------------------------------------------------------------


def _ab(a: _Stream, b: _Stream, q: int, shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    out = like.new_zeros(shape)
    for step in range(q):
        out.addmm_(a.at(step), b.at(step))
    return out


def _abt(a: torch.Tensor, b: _Stream, row: AxisGroup) -> torch.Tensor:
    out = None
    for step in range(row.size):  # A_ij B_lj^T: column j's share of C_il
        out = _reduce_onto(a @ b.at(step).t(), row, step, out)
    assert out is not None
    return out


def summa_ab(a: torch.Tensor, b: torch.Tensor, row: AxisGroup, col: AxisGroup) -> torch.Tensor:
    """``C = A B``: ``a`` is ``A_ij [m/q, k/q]``, ``b`` is ``B_ij [k/q, n/q]``; returns ``C_ij [m/q, n/q]``."""
    return _ab(_Stream(a, row), _Stream(b, col), row.size, (a.shape[0], b.shape[1]), a)


def summa_abt(a: torch.Tensor, b: torch.Tensor, row: AxisGroup, col: AxisGroup) -> torch.Tensor:
    """``C = A B^T``: ``a`` is ``A_ij [m/q, k/q]``, ``b`` is ``B_ij [n/q, k/q]``; returns ``C_ij [m/q, n/q]``."""
    return _abt(a, _Stream(b, col), row)


def summa_atb(a: torch.Tensor, b: torch.Tensor, row: AxisGroup, col: AxisGroup) -> torch.Tensor:
    """``C = A^T B``: ``a`` is ``A_ij [k/q, m/q]``, ``b`` is ``B_ij [k/q, n/q]``; returns ``C_ij [m/q, n/q]``
    (``C^T = B^T A`` on the transposed grid)."""
    return summa_abt(b.t(), a.t(), col, row).t()


# ---- autograd ------------------------------------------------------------------------------


class _MatmulAB(torch.autograd.Function):
    """``C = A B``; backward: ``dA = dC B^T`` and ``dB = A^T dC`` in one loop."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, row: AxisGroup, col: AxisGroup, keep: bool) -> torch.Tensor:
        sa, sb = _Stream(a, row), _Stream(b, col)
        out = _ab(sa, sb, row.size, (a.shape[0], b.shape[1]), a)
        ctx.save_for_backward(*(sa.received + sb.received) if keep else (a, b))
        ctx.groups, ctx.keep = (row, col), keep
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        row, col = ctx.groups
        q, saved = row.size, ctx.saved_tensors
        need_a, need_b = ctx.needs_input_grad[:2]
        sa: _Stream | None
        sb: _Stream | None
        if ctx.keep:
            sa, sb = _Stream.of(saved[:q], row), _Stream.of(saved[q:], col)
        else:
            sa = _Stream(saved[0], row) if need_b else None
            sb = _Stream(saved[1], col) if need_a else None
        grad = grad.contiguous()
        da = db = None
        for step in range(q):
            if need_a:  # dA_il = sum_j dC_ij B_lj^T, onto (i, l)
                assert sb is not None
                da = _reduce_onto(grad @ sb.at(step).t(), row, step, da)
            if need_b:  # dB_lj = sum_i A_il^T dC_ij, onto (l, j)
                assert sa is not None
                db = _reduce_onto(sa.at(step).t() @ grad, col, step, db)
        return da, db, None, None, None


class _MatmulABT(torch.autograd.Function):
    """``C = A B^T``; backward: ``dA = dC B`` and ``dB = dC^T A`` in one loop sharing ``dC_il``."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, row: AxisGroup, col: AxisGroup, keep: bool) -> torch.Tensor:
        sb = _Stream(b, col)
        out = _abt(a, sb, row)
        ctx.save_for_backward(a, *(sb.received if keep else (b,)))
        ctx.groups, ctx.keep = (row, col), keep
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        row, col = ctx.groups
        a, *b_saved = ctx.saved_tensors
        need_a, need_b = ctx.needs_input_grad[:2]
        if not (need_a or need_b):
            return None, None, None, None, None
        sg = _Stream(grad.contiguous(), row)  # dC_il: both gradients use it
        sb = None
        if need_a:
            sb = _Stream.of(b_saved, col) if ctx.keep else _Stream(b_saved[0], col)
        da = a.new_zeros(a.shape) if need_a else None
        db = None
        for step in range(row.size):
            g = sg.at(step)
            if da is not None and sb is not None:  # dA_ij += dC_il B_lj
                da.addmm_(g, sb.at(step))
            if need_b:  # dB_lj = sum_i dC_il^T A_ij, onto (l, j)
                db = _reduce_onto(g.t() @ a, col, step, db)
        return da, db, None, None, None


def matmul_ab(a: torch.Tensor, b: torch.Tensor, row: AxisGroup, col: AxisGroup, *, keep: bool = False) -> torch.Tensor:
    """Differentiable :func:`summa_ab`: ``A_ij [m/q, k/q]``, ``B_ij [k/q, n/q]`` -> ``C_ij [m/q, n/q]``;
    ``keep``: keep the blocks received in the forward for the backward."""
    return _MatmulAB.apply(a, b, row, col, keep)


def matmul_abt(a: torch.Tensor, b: torch.Tensor, row: AxisGroup, col: AxisGroup, *, keep: bool = False) -> torch.Tensor:
    """Differentiable :func:`summa_abt`: ``A_ij [m/q, k/q]``, ``B_ij [n/q, k/q]`` -> ``C_ij [m/q, n/q]``."""
    return _MatmulABT.apply(a, b, row, col, keep)


def matmul_atb(a: torch.Tensor, b: torch.Tensor, row: AxisGroup, col: AxisGroup, *, keep: bool = False) -> torch.Tensor:
    """Differentiable :func:`summa_atb`: ``A_ij [k/q, m/q]``, ``B_ij [k/q, n/q]`` -> ``C_ij [m/q, n/q]``."""
    return _MatmulABT.apply(b.t(), a.t(), col, row, keep).t()


# ---- grid transpose ------------------------------------------------------------------------


def _swap_with_transposed(x: torch.Tensor, grid: SummaGrid) -> torch.Tensor:
    if grid.i == grid.j:
        return x
    peer = grid.tensor_index(grid.k, grid.j, grid.i)
    out = torch.empty_like(x)
    comm.batch_p2p([comm.P2POp("send", x, grid.tensor, peer), comm.P2POp("recv", out, grid.tensor, peer)])
    return out


class _GridTranspose(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, grid: SummaGrid) -> torch.Tensor:
        ctx.grid = grid
        return _swap_with_transposed(x.contiguous(), grid).view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _swap_with_transposed(grad.contiguous(), ctx.grid), None


def grid_transpose(x: torch.Tensor, grid: SummaGrid) -> torch.Tensor:
    """Rank ``(k, i, j)`` gets the block rank ``(k, j, i)`` holds (same shape); the backward is the
    same swap. Off-diagonal ranks send and receive one block each."""
    return _GridTranspose.apply(x, grid)


# ---- activation layout -----------------------------------------------------------------------


def grid_batch(x: torch.Tensor, grid: SummaGrid, pad_value: float = 0.0) -> torch.Tensor:
    """The batch rows of this rank's grid: ``[B, ...]`` (full) -> ``[B'/depth, ...]`` (block
    ``k``), with ``B'`` the batch padded with ``pad_value`` to a multiple of ``depth*q``."""
    x = pad_dim(x, 0, grid.batch_parts, pad_value)
    per_grid = x.shape[0] // grid.depth
    return x.narrow(0, grid.k * per_grid, per_grid)


def batch_block(x: torch.Tensor, grid: SummaGrid, pad_value: float = 0.0) -> torch.Tensor:
    """This rank's batch block: ``[B, ...]`` (full) -> ``[B'/(depth*q), ...]`` (block ``k*q + i``).
    For inputs that arrive full on every rank (token ids, images, targets)."""
    x = pad_dim(x, 0, grid.batch_parts, pad_value)
    per_rank = x.shape[0] // grid.batch_parts
    return x.narrow(0, grid.batch_index * per_rank, per_rank)


def split_activation(x: torch.Tensor, grid: SummaGrid) -> torch.Tensor:
    """``[B, (S,) H]`` (full, same on every rank) -> ``[B'/(depth*q), (S,) H'/q]``: batch block
    ``k*q + i``, hidden block ``j``, batch and hidden zero-padded to multiples of ``depth*q`` and
    ``q``. Backward all-gathers, so the full input gets the full gradient on every rank."""
    x = pad_dim(pad_dim(x, 0, grid.batch_parts), -1, grid.q)
    for group in grid.batch_groups:
        x = comm.split_forward_gather_backward(x, group, 0)
    return comm.split_forward_gather_backward(x, grid.row, -1)


def gather_activation(x: torch.Tensor, grid: SummaGrid, full_shape: Any = None) -> torch.Tensor:
    """Inverse of :func:`split_activation` (collective over the tensor group): the full
    activation on every rank, cut to ``full_shape`` (batch and last dim) when given."""
    x = comm.gather_forward_split_backward(x, grid.row, -1)
    for group in reversed(grid.batch_groups):  # innermost first
        x = comm.gather_forward_split_backward(x, group, 0)
    if full_shape is not None:
        x = x.narrow(0, 0, full_shape[0]).narrow(-1, 0, full_shape[-1])
    return x
