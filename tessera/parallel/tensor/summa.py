"""SUMMA on a q x q grid: the building blocks shared by 2D (Optimus) and 2.5D (Tesseract).

A matrix ``A [m, k]`` lives on the grid as blocks: rank ``(i, j)`` holds ``A_ij``, the block of
rows ``i`` and columns ``j`` (sizes padded to a multiple of q). ``row`` is the group of the grid
row through this rank (its members differ in ``j``; ``row.rank == j``), ``col`` the group of the
grid column (``col.rank == i``). The three products take q steps each, step ``l`` moving one
block along the row and/or the column:

==========  ========================================  =========================================
product     step ``l`` on rank ``(i, j)``             logical bytes per rank (fwd, q steps)
==========  ========================================  =========================================
C = A B     broadcast ``A_il`` on the row,            (q-1) (|A_ij| + |B_ij|)
            ``B_lj`` on the column; C_ij += A_il B_lj
C = A B^T   broadcast ``B_lj`` on the column;         (q-1) (|B_ij| + |C_ij|)
            reduce A_ij B_lj^T onto ``(i, l)`` (row)
C = A^T B   broadcast ``A_il`` on the row;            (q-1) (|A_ij| + |C_ij|)
            reduce A_il^T B_ij onto ``(l, j)`` (col)
==========  ========================================  =========================================

Each product's backward is two of the others (``C = A B``: ``dA = dC B^T``, ``dB = A^T dC``),
so every autograd function here re-broadcasts its saved local blocks instead of keeping the q
received ones (the Optimus memory trade). 2.5D runs the same steps inside each of its ``depth``
grids. Each product runs one step ahead: the broadcasts of step ``l + 1`` are started
(``comm.broadcast_async``) before the matmul of step ``l``, so communication overlaps compute.

Besides the products: the grid transpose
(block ``(i, j)`` to ``(j, i)``), and splitting and gathering a ``[batch, (seq,) hidden]``
activation, whose batch is split over the grid's rows (and grids) and hidden over its columns.
This rank's place in the grid(s) is a :class:`~tessera.parallel.tensor.grid.SummaGrid`.
"""

from __future__ import annotations

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


# ---- SUMMA products (no autograd) ----------------------------------------------------------


class _Block:
    """Member ``src``'s block arriving on every member of ``group`` (blocks have equal shapes);
    started at construction, ``get()`` waits for it."""

    def __init__(self, block: torch.Tensor, group: AxisGroup, src: int) -> None:
        self.transposed = not block.is_contiguous() and block.dim() == 2 and block.t().is_contiguous()
        if self.transposed:
            block = block.t()  # a transposed weight goes as stored
        block = block.contiguous()
        buf = block if group.size == 1 or group.rank == src else torch.empty_like(block)
        self.pending = comm.broadcast_async(buf, group, src)

    def get(self) -> torch.Tensor:
        out = self.pending.wait()
        return out.t() if self.transposed else out


def summa_ab(a: torch.Tensor, b: torch.Tensor, row: AxisGroup, col: AxisGroup) -> torch.Tensor:
    """``C = A B``: ``a`` is ``A_ij [m/q, k/q]``, ``b`` is ``B_ij [k/q, n/q]``; returns ``C_ij [m/q, n/q]``."""
    out = a.new_zeros(a.shape[0], b.shape[1])
    ahead = (_Block(a, row, 0), _Block(b, col, 0))
    for step in range(row.size):
        a_blk, b_blk = ahead[0].get(), ahead[1].get()
        if step + 1 < row.size:  # the next step's blocks travel while this step multiplies
            ahead = (_Block(a, row, step + 1), _Block(b, col, step + 1))
        out.addmm_(a_blk, b_blk)
    return out


def summa_abt(a: torch.Tensor, b: torch.Tensor, row: AxisGroup, col: AxisGroup) -> torch.Tensor:
    """``C = A B^T``: ``a`` is ``A_ij [m/q, k/q]``, ``b`` is ``B_ij [n/q, k/q]``; returns ``C_ij [m/q, n/q]``.

    Step ``l``: ``A_ij B_lj^T`` is column ``j``'s share of ``C_il``, summed onto row member ``l``."""
    out: torch.Tensor | None = None
    ahead = _Block(b, col, 0)
    for step in range(row.size):
        b_blk = ahead.get()
        if step + 1 < row.size:
            ahead = _Block(b, col, step + 1)
        part = comm.reduce(a @ b_blk.t(), row, dst=step)
        if row.rank == step:
            out = part
    assert out is not None
    return out


def summa_atb(a: torch.Tensor, b: torch.Tensor, row: AxisGroup, col: AxisGroup) -> torch.Tensor:
    """``C = A^T B``: ``a`` is ``A_ij [k/q, m/q]``, ``b`` is ``B_ij [k/q, n/q]``; returns ``C_ij [m/q, n/q]``.

    Step ``l``: ``A_il^T B_ij`` is row ``i``'s share of ``C_lj``, summed onto column member ``l``."""
    out: torch.Tensor | None = None
    ahead = _Block(a, row, 0)
    for step in range(col.size):
        a_blk = ahead.get()
        if step + 1 < col.size:
            ahead = _Block(a, row, step + 1)
        part = comm.reduce(a_blk.t() @ b, col, dst=step)
        if col.rank == step:
            out = part
    assert out is not None
    return out


# ---- autograd ------------------------------------------------------------------------------


class _MatmulAB(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, row: AxisGroup, col: AxisGroup) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.groups = (row, col)
        return summa_ab(a, b, row, col)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        a, b = ctx.saved_tensors
        grad = grad.contiguous()
        da = summa_abt(grad, b, *ctx.groups) if ctx.needs_input_grad[0] else None  # dA = dC B^T
        db = summa_atb(a, grad, *ctx.groups) if ctx.needs_input_grad[1] else None  # dB = A^T dC
        return da, db, None, None


class _MatmulABT(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, row: AxisGroup, col: AxisGroup) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.groups = (row, col)
        return summa_abt(a, b, row, col)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        a, b = ctx.saved_tensors
        grad = grad.contiguous()
        da = summa_ab(grad, b, *ctx.groups) if ctx.needs_input_grad[0] else None  # dA = dC B
        db = summa_atb(grad, a, *ctx.groups) if ctx.needs_input_grad[1] else None  # dB = dC^T A
        return da, db, None, None


class _MatmulATB(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, row: AxisGroup, col: AxisGroup) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.groups = (row, col)
        return summa_atb(a, b, row, col)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        a, b = ctx.saved_tensors
        grad = grad.contiguous()
        da = summa_abt(b, grad, *ctx.groups) if ctx.needs_input_grad[0] else None  # dA = B dC^T
        db = summa_ab(a, grad, *ctx.groups) if ctx.needs_input_grad[1] else None  # dB = A dC
        return da, db, None, None


def matmul_ab(a: torch.Tensor, b: torch.Tensor, row: AxisGroup, col: AxisGroup) -> torch.Tensor:
    """Differentiable :func:`summa_ab`: ``A_ij [m/q, k/q]``, ``B_ij [k/q, n/q]`` -> ``C_ij [m/q, n/q]``."""
    return _MatmulAB.apply(a, b, row, col)


def matmul_abt(a: torch.Tensor, b: torch.Tensor, row: AxisGroup, col: AxisGroup) -> torch.Tensor:
    """Differentiable :func:`summa_abt`: ``A_ij [m/q, k/q]``, ``B_ij [n/q, k/q]`` -> ``C_ij [m/q, n/q]``."""
    return _MatmulABT.apply(a, b, row, col)


def matmul_atb(a: torch.Tensor, b: torch.Tensor, row: AxisGroup, col: AxisGroup) -> torch.Tensor:
    """Differentiable :func:`summa_atb`: ``A_ij [k/q, m/q]``, ``B_ij [k/q, n/q]`` -> ``C_ij [m/q, n/q]``."""
    return _MatmulATB.apply(a, b, row, col)


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
