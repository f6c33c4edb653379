"""3D tensor parallelism on a q x q x q cube of the tensor group (Agarwal et al. 1995; Bian et al.
2021, "Maximizing parallelism in distributed training for huge neural networks", Colossal-AI's
3D layers).

The cube. Tensor rank ``t = w*q*q + n*q + o``; three lines of the cube pass through it:
``3d_weight`` (members differ in ``w``), ``3d_input`` (in ``n``) and ``3d_output`` (in ``o``).

Activation layout. ``[b, (s,) h]`` is held as ``[ceil(b/q), (s,) ceil(h/q^2)]``:

* the batch is split by ``3d_weight`` (block ``w``; zero rows pad it to a multiple of q, they
  carry no loss and :func:`gather_activation` drops them), the sequence is whole;
* the hidden dimension is zero-padded to a multiple of q^2 and split by ``3d_output``, then
  ``3d_input``: rank ``(w, n, o)`` holds block ``o*q + n`` of ``F = ceil(h/q^2)`` units (the
  ``ShardSpec`` split by ``(3d_output, 3d_input)``). Coarse block ``o`` (``q F`` units) is the
  union of the blocks of the ranks of one ``3d_input`` line.

So ``hidden_parts = q^2`` and ``batch_parts = q``; every layer returns the layout it takes.

Linear (Agarwal's 3D matmul). ``Y = X W^T``, ``W [out, in]``: rank ``(w, n, o)`` keeps
``W[out block w*q + n, in block o]`` (out split q^2 ways by ``(3d_weight, 3d_input)``, in q ways
by ``3d_output``: 1/q^3 of the weight)::

    forward   X_o = all-gather X along 3d_input              [b/q, s, in/q]   in block o
              W_o = all-gather W along 3d_weight             [out/q, in/q]    out blocks o'*q + n, all o'
              Y   = reduce-scatter X_o W_o^T along 3d_output [b/q, s, out/q^2] out block o*q + n
    backward  dY_o = all-gather dY along 3d_output; dX = reduce-scatter dY_o W_o along 3d_input;
              dW = reduce-scatter dY_o^T X_o along 3d_weight.

Because ``W_o`` holds the out blocks ``o'*q + n`` of every ``o'``, the reduce-scatter over ``o``
hands rank ``o`` out block ``o*q + n``: the output has exactly the input's layout. (Colossal-AI's
layers instead swap the roles of the input and output axes from one layer to the next, which
the layers then have to track; here nothing is tracked and any chain works: Linear -> LayerNorm
-> Linear, residual adds, ...). Logical bytes per rank, fp size ``e``, sizes divisible::

    all-gather + reduce-scatter on 3d_input    2 (q-1)/q^3 e b s in
    all-gather + reduce-scatter on 3d_weight   2 (q-1)/q^3 e in out
    reduce-scatter + all-gather on 3d_output   2 (q-1)/q^3 e b s out
    all-reduce on 3d_weight (bias gradient)    2 (q-1)/q^3 e out

in all ``2 (q-1)/q^3 e (b s (in + out) + in out + out)``; with padding, ``b`` is rounded up to a
multiple of q and ``in``, ``out`` to multiples of q^2 (see ``tests/dist/test_tp3d.py``).

Uneven sizes. Every dimension that meets the hidden dimension is padded to a multiple of q^2,
whatever it is split into: the activations' and the hidden parameters' (split q^2 ways), a
Linear's out dimension (q^2 ways, per fused part) and its in dimension, split only q ways but
padded to a multiple of q^2 (``ShardSpec.pad_to``) so that in block ``o`` is the activations'
coarse block ``o``. So every size works, and a padded unit stays exactly zero: its weights and
biases are zero, so are its outputs, and so are their gradients, the next layer's weights on it
being zero too (LayerNorm masks its padding and takes its statistics over the true ``h``
units). The vocabulary of the vocabulary-parallel layers is padded likewise (logits
``[b/q, s, ceil(V/q^2)]``, block ``o*q + n``; padded classes get the lowest logit).

Other parameters:

=================================  ==============================  =================================
parameter                          split                           gradient
=================================  ==============================  =================================
bias, LayerNorm, Embedding,        hidden as the activations       all-reduced over 3d_weight
Classifier, PatchEmbedding         (``(3d_output, 3d_input)``),    (the batch blocks)
                                   replicated over 3d_weight
VocabParallelEmbedding /           as ``Linear.weight``: vocab by  complete on its rank
VocabParallelClassifier ``[V, h]`` ``(3d_weight, 3d_input)``,
                                   hidden by ``3d_output``
=================================  ==============================  =================================

This module is the functional core (the cube is :class:`~tessera.parallel.tensor.grid.Cube`);
the ``nn.Module`` layers are in :mod:`tessera.parallel.tensor.tp3d.layers`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tessera import comm
from tessera.amp import autocast_operands
from tessera.comm import AxisGroup
from tessera.context import ParallelContext
from tessera.parallel.tensor.common import ShardSpec, pad_dim, shard_parameter
from tessera.parallel.tensor.grid import INPUT, OUTPUT, TENSOR, WEIGHT, Cube

__all__ = [
    "INPUT",
    "OUTPUT",
    "TENSOR",
    "WEIGHT",
    "Cube",
    "batch_block",
    "batch_parts",
    "check_local",
    "gather_activation",
    "hidden_local",
    "hidden_param",
    "hidden_parts",
    "hidden_spec",
    "layer_norm_3d",
    "linear_3d",
    "mean_over_batch",
    "split_activation",
    "weight_spec",
]


def check_local(x: torch.Tensor, size: int, cube: Cube, what: str) -> None:
    if x.shape[-1] != cube.per_rank(size):
        raise ValueError(
            f"{what}: expected the 3D layout of {size} hidden units ({cube.per_rank(size)} per rank), got "
            f"shape {tuple(x.shape)}; split a full activation with split_activation first"
        )


def batch_block(x: torch.Tensor, cube: Cube, pad_value: float = 0.0) -> torch.Tensor:
    """This rank's batch rows of a tensor that arrives full on every rank (token ids, images,
    targets): ``[B, ...] -> [ceil(B/q), ...]`` (block ``w``, padded with ``pad_value``). No
    communication and no gradient to the full tensor."""
    per = -(-x.shape[0] // cube.q)
    return pad_dim(x, 0, cube.q, pad_value).narrow(0, cube.w * per, per)


# ---- parameters with a hidden dimension -------------------------------------------------------


def hidden_spec(shape: tuple[int, ...], dim: int, groups: int = 1) -> ShardSpec:
    """Dimension ``dim`` of ``shape`` (``groups`` fused parts) split as the activations' hidden
    dimension, the others whole: replicated over ``3d_weight``."""
    dims: list[tuple[str, ...]] = [()] * len(shape)
    dims[dim] = (OUTPUT, INPUT)
    parts = [1] * len(shape)
    parts[dim] = groups
    return ShardSpec(tuple(shape), tuple(dims), tuple(parts))


def weight_spec(out_features: int, in_features: int, q: int, groups: int = 1) -> ShardSpec:
    """A Linear weight ``[out, in]`` (and a vocabulary-parallel ``[V, h]``): out by
    ``(3d_weight, 3d_input)`` (per fused part), in by ``3d_output``, both padded to multiples of
    q^2."""
    return ShardSpec((out_features, in_features), ((WEIGHT, INPUT), (OUTPUT,)), (groups, 1), (0, q * q))


def hidden_param(full: torch.Tensor, dim: int, ctx: ParallelContext, groups: int = 1) -> nn.Parameter:
    """A parameter whose dimension ``dim`` is hidden, sharded by :func:`hidden_spec`."""
    return shard_parameter(full, hidden_spec(tuple(full.shape), dim, groups), ctx)


def hidden_local(param: torch.Tensor, cube: Cube) -> torch.Tensor:
    """A :func:`hidden_param` for use in the forward: each rank uses it on its batch block only,
    so the backward sums the gradient over the ranks that share it (``3d_weight``)."""
    return comm.copy_forward_all_reduce_backward(param, cube.weight)


# ---- functional core ---------------------------------------------------------------------------


def _split_hidden(x: torch.Tensor, cube: Cube) -> torch.Tensor:
    """``[..., h]`` (full, the same on every rank) -> ``[..., F]`` block ``o*q + n``; the backward
    all-gathers, so the full tensor gets its full gradient on every rank."""
    x = pad_dim(x, -1, cube.q**2)
    x = comm.split_forward_gather_backward(x, cube.output, -1)
    return comm.split_forward_gather_backward(x, cube.input, -1)


def _gather_hidden(x: torch.Tensor, size: int, cube: Cube) -> torch.Tensor:
    """Inverse of :func:`_split_hidden`: ``[..., F] -> [..., size]`` on every rank."""
    x = comm.gather_forward_split_backward(x, cube.input, -1)
    x = comm.gather_forward_split_backward(x, cube.output, -1)
    return x.narrow(-1, 0, size)


def _gathered_weight(weight: torch.Tensor, cube: Cube, groups: int) -> torch.Tensor:
    """This rank's weight block ``[groups*F_out, q*F_in]`` all-gathered along ``3d_weight``:
    ``[q*groups*F_out, q*F_in]``, for each ``o'`` the parts' out blocks ``o'*q + n``."""
    rows, cols = weight.shape
    local = weight.view(groups, 1, rows // groups, cols)  # each part's out block w*q + n
    gathered = comm.all_gather_forward_reduce_scatter_backward(local, cube.weight, 1)  # [G, q, F, in/q]
    return gathered.transpose(0, 1).reshape(cube.q * rows, cols)


class _LinearRegathered(torch.autograd.Function):
    """``F.linear(x, gathered weight)`` keeping only this rank's weight block for backward, which
    gathers it again. The backward is written out (``dx = g W_o``, ``dW_o = g^T x``, then the
    gather's reduce-scatter along ``3d_weight``) rather than differentiated with
    ``torch.autograd.grad``, so that a compiled block traces it whole, without a graph break."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, cube: Cube, groups: int) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.cube, ctx.groups = cube, groups
        return F.linear(x, _gathered_weight(weight, cube, groups))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        x, weight = ctx.saved_tensors
        cube, groups = ctx.cube, ctx.groups
        gathered = _gathered_weight(weight.detach(), cube, groups)  # [q*rows, cols]
        flat = grad.reshape(-1, grad.shape[-1])
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = flat.mm(gathered).view(*grad.shape[:-1], gathered.shape[-1])
        if ctx.needs_input_grad[1]:
            rows, cols = weight.shape
            d_gathered = flat.t().mm(x.reshape(-1, x.shape[-1]))  # [q*rows, cols], summed over the tokens
            parts = d_gathered.view(cube.q, groups, rows // groups, cols).transpose(0, 1)  # [G, q, F, cols]
            dw = comm.reduce_scatter(parts.contiguous(), cube.weight, 1).reshape(rows, cols)
        return dx, dw, None, None


def linear_3d(
    x: torch.Tensor, weight: torch.Tensor, cube: Cube, *, groups: int = 1, keep_blocks: bool = True
) -> torch.Tensor:
    """Agarwal's 3D matmul ``x W^T``: ``x [..., F_in]`` in the layout times this rank's weight block
    ``[groups*F_out, q*F_in]`` (:func:`weight_spec`) -> ``[..., groups*F_out]`` in the layout (each
    part's block ``o*q + n``, side by side). ``keep_blocks``: keep the gathered weight for backward
    (else backward gathers it again: ``(q-1)/q^3 e in out`` more bytes on ``3d_weight``, the
    gathered weight ``[out/q, in/q]`` less memory)."""
    x, weight = autocast_operands(x, weight)  # as F.linear's; the weight gathered in the compute dtype
    x = comm.all_gather_forward_reduce_scatter_backward(x, cube.input, -1)  # in block o
    if keep_blocks:
        partial = F.linear(x, _gathered_weight(weight, cube, groups))  # [..., q*groups*F_out], summed over o next
    else:
        partial = _LinearRegathered.apply(x, weight, cube, groups)
    return comm.reduce_scatter_forward_all_gather_backward(partial, cube.output, -1)


class _NormalizeHidden(torch.autograd.Function):
    """``(x - mean) / sqrt(var + eps)`` over a hidden dimension split over ``groups``: ``size``
    real units in all, ``valid`` of them on this rank (the rest is padding, kept at zero)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, groups: tuple[AxisGroup, ...], size: int, eps: float, valid: int
    ) -> torch.Tensor:
        mask = (torch.arange(x.shape[-1], device=x.device) < valid).to(x.dtype)
        mean = x.sum(-1, keepdim=True)
        for group in groups:
            comm.all_reduce(mean, group)
        mean = mean / size
        centered = (x - mean) * mask
        var = centered.square().sum(-1, keepdim=True)
        for group in groups:
            comm.all_reduce(var, group)
        rstd = torch.rsqrt(var / size + eps)
        xhat = centered * rstd
        ctx.save_for_backward(xhat, rstd, mask)
        ctx.groups, ctx.size = groups, size
        return xhat

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        xhat, rstd, mask = ctx.saved_tensors
        grad = grad * mask
        sums = torch.stack([grad.sum(-1), (grad * xhat).sum(-1)])
        for group in ctx.groups:
            comm.all_reduce(sums, group)
        mean_grad, mean_grad_xhat = (sums / ctx.size).unsqueeze(-1).unbind(0)
        dx = rstd * (grad - mean_grad - xhat * mean_grad_xhat) * mask
        return dx, None, None, None, None


def layer_norm_3d(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    size: int,
    cube: Cube,
    eps: float,
) -> torch.Tensor:
    """LayerNorm of ``x [..., F]`` (the layout) over the whole ``size`` hidden units, with this
    rank's blocks of ``weight`` and ``bias``; padded units stay zero."""
    per = x.shape[-1]
    valid = max(0, min(per, size - cube.block * per))
    y: torch.Tensor = _NormalizeHidden.apply(x, cube.hidden_groups, size, eps, valid)
    if weight is not None:
        y = y * weight
    return y if bias is None else y + bias


def mean_over_batch(local_sum: torch.Tensor, local_count: torch.Tensor, cube: Cube) -> torch.Tensor:
    """``sum / count`` over the batch blocks (``3d_weight``); the ranks of a block hold the same
    values, so the backward is local."""
    total = comm.all_reduce_forward_copy_backward(local_sum, cube.weight)
    count = comm.all_reduce(local_count.to(total.dtype), cube.weight)
    return total / count


# ---- boundary helpers ------------------------------------------------------------------------


def hidden_parts(ctx: ParallelContext) -> int:
    """The hidden dimension is split into q^2 blocks (by ``3d_output``, then ``3d_input``)."""
    return Cube.of(ctx).q ** 2


def batch_parts(ctx: ParallelContext) -> int:
    """The batch is split into q blocks (by ``3d_weight``)."""
    return Cube.of(ctx).q


def split_activation(x_full: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """``[b, (s,) h]`` (full, the same on every rank) -> ``[ceil(b/q), (s,) F]``: batch block ``w``,
    hidden block ``o*q + n``, zero-padded. Backward all-gathers, so the full input gets its full
    gradient on every rank."""
    cube = Cube.of(ctx)
    x = pad_dim(x_full, 0, cube.q)
    x = comm.split_forward_gather_backward(x, cube.weight, 0)
    return _split_hidden(x, cube)


def gather_activation(x_local: torch.Tensor, ctx: ParallelContext, full_shape: Any = None) -> torch.Tensor:
    """Inverse of :func:`split_activation` (collective over the tensor group): the full activation on
    every rank. ``full_shape`` (its batch and last entries) drops the padding; without it the sizes
    are taken as unpadded (``q * b_local``, ``q^2 * F``)."""
    cube = Cube.of(ctx)
    batch = full_shape[0] if full_shape is not None else cube.q * x_local.shape[0]
    hidden = full_shape[-1] if full_shape is not None else cube.q**2 * x_local.shape[-1]
    check_local(x_local, hidden, cube, "gather_activation")
    x = _gather_hidden(x_local, hidden, cube)
    x = comm.gather_forward_split_backward(x, cube.weight, 0)
    return x.narrow(0, 0, batch)
