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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tessera import comm
from tessera.comm import AxisGroup
from tessera.context import ParallelContext, get_context
from tessera.nn.plain import PatchEmbedding
from tessera.parallel.tensor.common import (
    ShardSpec,
    check_tied,
    class_parallel_cross_entropy,
    pad_dim,
    shard_parameter,
)

__all__ = [
    "Classifier3D",
    "CrossEntropyLoss3D",
    "Cube",
    "Dropout3D",
    "Embedding3D",
    "LayerNorm3D",
    "Linear3D",
    "PatchEmbedding3D",
    "VocabParallelClassifier3D",
    "VocabParallelCrossEntropyLoss3D",
    "VocabParallelEmbedding3D",
    "batch_block",
    "batch_parts",
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

INPUT, WEIGHT, OUTPUT, TENSOR = "3d_input", "3d_weight", "3d_output", "tensor"


# ---- the cube and the hidden layout ----------------------------------------------------------


@dataclass(frozen=True)
class Cube:
    """This rank's three lines through the q x q x q cube, and the whole tensor group."""

    input: AxisGroup  # members differ in n
    weight: AxisGroup  # members differ in w
    output: AxisGroup  # members differ in o
    tensor: AxisGroup

    def __post_init__(self) -> None:
        q = self.input.size
        if not self.weight.size == self.output.size == q or self.tensor.size != q**3:
            raise ValueError(f"3D: the cube lines {self.weight}, {self.input}, {self.output} do not form a q^3 cube")

    def __deepcopy__(self, memo: dict[int, Any]) -> Cube:
        return self  # process groups are handles: a copied module shares them

    @classmethod
    def of(cls, ctx: ParallelContext) -> Cube:
        return cls(ctx.group(INPUT), ctx.group(WEIGHT), ctx.group(OUTPUT), ctx.group(TENSOR))

    @property
    def q(self) -> int:
        return self.input.size

    @property
    def w(self) -> int:
        return self.weight.rank

    @property
    def n(self) -> int:
        return self.input.rank

    @property
    def o(self) -> int:
        return self.output.rank

    @property
    def block(self) -> int:
        """This rank's block of a hidden dimension split q^2 ways: ``o*q + n``."""
        return self.o * self.q + self.n

    @property
    def hidden_groups(self) -> tuple[AxisGroup, AxisGroup]:
        """The groups splitting the hidden dimension (statistics over it are summed over both)."""
        return (self.input, self.output)

    def per_rank(self, size: int) -> int:
        """Units per rank of a hidden dimension of ``size``: ``ceil(size/q^2)``."""
        return -(-size // self.q**2)


def _context(ctx: ParallelContext | None) -> ParallelContext:
    return ctx if ctx is not None else get_context()


def _check_local(x: torch.Tensor, size: int, cube: Cube, what: str) -> None:
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


def linear_3d(x: torch.Tensor, weight: torch.Tensor, cube: Cube, *, groups: int = 1) -> torch.Tensor:
    """Agarwal's 3D matmul ``x W^T``: ``x [..., F_in]`` in the layout times this rank's weight block
    ``[groups*F_out, q*F_in]`` (:func:`weight_spec`) -> ``[..., groups*F_out]`` in the layout (each
    part's block ``o*q + n``, side by side)."""
    x = comm.all_gather_forward_reduce_scatter_backward(x, cube.input, -1)  # in block o
    rows, cols = weight.shape
    local = weight.view(groups, 1, rows // groups, cols)  # each part's out block w*q + n
    gathered = comm.all_gather_forward_reduce_scatter_backward(local, cube.weight, 1)  # [G, q, F, in/q]
    w = gathered.transpose(0, 1).reshape(cube.q * rows, cols)  # for each o': the parts' blocks o'*q + n
    partial = F.linear(x, w)  # [..., q*groups*F_out], summed over o next
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


def hidden_parts(ctx: ParallelContext | None = None) -> int:
    """The hidden dimension is split into q^2 blocks (by ``3d_output``, then ``3d_input``)."""
    return Cube.of(_context(ctx)).q ** 2


def batch_parts(ctx: ParallelContext | None = None) -> int:
    """The batch is split into q blocks (by ``3d_weight``)."""
    return Cube.of(_context(ctx)).q


def split_activation(x_full: torch.Tensor, ctx: ParallelContext | None = None) -> torch.Tensor:
    """``[b, (s,) h]`` (full, the same on every rank) -> ``[ceil(b/q), (s,) F]``: batch block ``w``,
    hidden block ``o*q + n``, zero-padded. Backward all-gathers, so the full input gets its full
    gradient on every rank."""
    cube = Cube.of(_context(ctx))
    x = pad_dim(x_full, 0, cube.q)
    x = comm.split_forward_gather_backward(x, cube.weight, 0)
    return _split_hidden(x, cube)


def gather_activation(
    x_local: torch.Tensor, ctx: ParallelContext | None = None, full_shape: Any = None
) -> torch.Tensor:
    """Inverse of :func:`split_activation` (collective over the tensor group): the full activation on
    every rank. ``full_shape`` (its batch and last entries) drops the padding; without it the sizes
    are taken as unpadded (``q * b_local``, ``q^2 * F``)."""
    cube = Cube.of(_context(ctx))
    batch = full_shape[0] if full_shape is not None else cube.q * x_local.shape[0]
    hidden = full_shape[-1] if full_shape is not None else cube.q**2 * x_local.shape[-1]
    _check_local(x_local, hidden, cube, "gather_activation")
    x = _gather_hidden(x_local, hidden, cube)
    x = comm.gather_forward_split_backward(x, cube.weight, 0)
    return x.narrow(0, 0, batch)


# ---- layers --------------------------------------------------------------------------------------


class _CubeLayer(nn.Module):
    """Holds the context and this rank's cube."""

    def __init__(self, ctx: ParallelContext | None) -> None:
        super().__init__()
        self.ctx = _context(ctx)
        self.cube = Cube.of(self.ctx)


class Linear3D(_CubeLayer):
    """``y = x W^T + b`` (Agarwal's 3D matmul): ``[b/q, (s,) F_in] -> [b/q, (s,) out_groups*F_out]``,
    both in the activation layout. ``weight [out, in]``: out block ``w*q + n`` (of each of
    ``out_groups`` fused parts) by in block ``o``, 1/q^3 of it (:func:`weight_spec`); ``bias`` as
    the activations. Any sizes."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        out_groups: int = 1,
        ctx: ParallelContext | None = None,
    ) -> None:
        super().__init__(ctx)
        if out_features % out_groups:
            raise ValueError(f"Linear3D: {out_features} output features do not split into {out_groups} parts")
        self.in_features, self.out_features, self.out_groups = in_features, out_features, out_groups
        plain = nn.Linear(in_features, out_features, bias=bias)
        spec = weight_spec(out_features, in_features, self.cube.q, out_groups)
        self.weight = shard_parameter(plain.weight, spec, self.ctx)
        self.bias: nn.Parameter | None = None
        if plain.bias is not None:
            self.bias = hidden_param(plain.bias, 0, self.ctx, out_groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_local(x, self.in_features, self.cube, "Linear3D input")
        y = linear_3d(x, self.weight, self.cube, groups=self.out_groups)
        if self.bias is not None:
            y = y + hidden_local(self.bias, self.cube)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"out_groups={self.out_groups}"
        )


class LayerNorm3D(_CubeLayer):
    """LayerNorm over the split hidden dimension (statistics over the true ``h`` units, all-reduced
    over ``3d_input`` and ``3d_output``); ``weight``/``bias`` split as the activations."""

    def __init__(
        self,
        normalized_shape: int | list[int] | tuple[int, ...],
        eps: float = 1e-5,
        bias: bool = True,
        *,
        ctx: ParallelContext | None = None,
    ) -> None:
        super().__init__(ctx)
        plain = nn.LayerNorm(normalized_shape, eps=eps, bias=bias)
        if len(plain.normalized_shape) != 1:
            raise ValueError(f"LayerNorm3D normalises the last (hidden) dimension only, got {plain.normalized_shape}")
        self.normalized_shape, self.eps = plain.normalized_shape, eps
        self.weight = hidden_param(plain.weight, 0, self.ctx)
        self.bias: nn.Parameter | None = None
        if plain.bias is not None:
            self.bias = hidden_param(plain.bias, 0, self.ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = self.normalized_shape[0]
        _check_local(x, size, self.cube, "LayerNorm3D input")
        bias = None if self.bias is None else hidden_local(self.bias, self.cube)
        return layer_norm_3d(x, hidden_local(self.weight, self.cube), bias, size, self.cube, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


class Embedding3D(_CubeLayer):
    """Lookup with every row of ``weight [num, dim]`` on every rank and ``dim`` split as the
    activations: token ids ``[b, (s)]`` (full) -> ``[b/q, (s,) F]``, no communication forward."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, ctx: ParallelContext | None = None) -> None:
        super().__init__(ctx)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        plain = nn.Embedding(num_embeddings, embedding_dim)
        self.weight = hidden_param(plain.weight, 1, self.ctx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(batch_block(ids, self.cube), hidden_local(self.weight, self.cube))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class VocabParallelEmbedding3D(_CubeLayer):
    """Lookup with ``weight [V, dim]`` split as a Linear weight (rows ``w*q + n`` of V split q^2
    ways, hidden coarse block ``o``): each rank looks the whole batch up in its rows (zeros for
    other ids), then the partial lookups are reduce-scattered over ``3d_input`` (hidden) and
    ``3d_weight`` (batch). ``[b, (s)]`` (full) -> ``[b/q, (s,) F]``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, ctx: ParallelContext | None = None) -> None:
        super().__init__(ctx)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        plain = nn.Embedding(num_embeddings, embedding_dim)
        spec = weight_spec(num_embeddings, embedding_dim, self.cube.q)
        self.weight = shard_parameter(plain.weight, spec, self.ctx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        cube = self.cube
        rows = self.weight.shape[0]
        start = (cube.w * cube.q + cube.n) * rows
        ids = pad_dim(ids, 0, cube.q)
        mine = (ids >= start) & (ids < start + rows)
        local = F.embedding(torch.where(mine, ids - start, torch.zeros_like(ids)), self.weight)
        local = local.masked_fill(~mine.unsqueeze(-1), 0.0)  # [B, (s,) q F]: hidden coarse block o
        local = comm.reduce_scatter_forward_all_gather_backward(local, cube.input, -1)
        return comm.reduce_scatter_forward_all_gather_backward(local, cube.weight, 0)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class Classifier3D(_CubeLayer):
    """Head with every class on every rank: ``weight [classes, in]`` split on ``in`` as the
    activations (may be ``Embedding3D.weight``, tied), ``bias`` replicated. ``[b/q, (s,) F]`` ->
    ``[b/q, (s,) classes]`` (partial products all-reduced over ``3d_input`` and ``3d_output``)."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        bias: bool = True,
        *,
        weight: nn.Parameter | None = None,
        ctx: ParallelContext | None = None,
    ) -> None:
        super().__init__(ctx)
        self.in_features, self.num_classes = in_features, num_classes
        plain = nn.Linear(in_features, num_classes, bias=bias)
        spec = hidden_spec((num_classes, in_features), 1)
        self.weight = (
            shard_parameter(plain.weight, spec, self.ctx)
            if weight is None
            else check_tied(weight, spec, "Classifier3D")
        )
        self.bias = plain.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_local(x, self.in_features, self.cube, "Classifier3D input")
        logits = F.linear(x, hidden_local(self.weight, self.cube))
        for group in self.cube.hidden_groups:
            logits = comm.all_reduce_forward_copy_backward(logits, group)
        if self.bias is not None:  # each batch block adds it: sum its gradient over them
            logits = logits + comm.copy_forward_all_reduce_backward(self.bias, self.cube.weight)
        return logits

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, num_classes={self.num_classes}, bias={self.bias is not None}"


class VocabParallelClassifier3D(_CubeLayer):
    """Head with the classes split: a 3D Linear whose ``weight [classes, in]`` is split as
    ``VocabParallelEmbedding3D.weight`` (and may be it, tied). ``[b/q, (s,) F] -> [b/q, (s,) C']``,
    ``C' = ceil(classes/q^2)``: classes block ``o*q + n``. Padded classes get the dtype's lowest
    logit, so a softmax gives them zero probability and zero gradient."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        bias: bool = False,
        *,
        weight: nn.Parameter | None = None,
        ctx: ParallelContext | None = None,
    ) -> None:
        super().__init__(ctx)
        self.in_features, self.num_classes = in_features, num_classes
        plain = nn.Linear(in_features, num_classes, bias=bias)
        spec = weight_spec(num_classes, in_features, self.cube.q)
        if weight is None:
            self.weight = shard_parameter(plain.weight, spec, self.ctx)
        else:
            self.weight = check_tied(weight, spec, "VocabParallelClassifier3D")
        self.bias: nn.Parameter | None = None
        if plain.bias is not None:
            spec = ShardSpec((num_classes,), ((OUTPUT, INPUT),))
            self.bias = shard_parameter(plain.bias, spec, self.ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_local(x, self.in_features, self.cube, "VocabParallelClassifier3D input")
        cube = self.cube
        logits = linear_3d(x, self.weight, cube)
        if self.bias is not None:
            logits = logits + comm.copy_forward_all_reduce_backward(self.bias, cube.weight)
        per = logits.shape[-1]
        valid = max(0, min(per, self.num_classes - cube.block * per))
        if valid < per:
            padded = torch.arange(per, device=logits.device) >= valid
            logits = logits.masked_fill(padded, torch.finfo(logits.dtype).min)
        return logits

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, num_classes={self.num_classes}, bias={self.bias is not None}"


class PatchEmbedding3D(_CubeLayer):
    """ViT patch embedding (as ``tessera.nn.plain.PatchEmbedding``) with every parameter split on
    the embedding dimension as the activations: images ``[b, c, H, W]`` (full) ->
    ``[b/q, 1 + N, F]``; each rank convolves its batch block into its channels."""

    def __init__(
        self, img_size: int, patch_size: int, in_chans: int, embed_size: int, *, ctx: ParallelContext | None = None
    ) -> None:
        super().__init__(ctx)
        plain = PatchEmbedding(img_size, patch_size, in_chans, embed_size)
        self.patch_size, self.num_patches, self.embed_size = patch_size, plain.num_patches, embed_size
        assert plain.bias is not None  # a conv with bias
        self.weight = hidden_param(plain.weight, 0, self.ctx)
        self.bias = hidden_param(plain.bias, 0, self.ctx)
        self.cls_token = hidden_param(plain.cls_token, 2, self.ctx)
        self.pos_embed = hidden_param(plain.pos_embed, 2, self.ctx)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        cube = self.cube
        for group in cube.hidden_groups:  # each rank's channels feed back a part of the image grad
            images = comm.copy_forward_all_reduce_backward(images, group)
        images = pad_dim(images, 0, cube.q)
        images = comm.split_forward_gather_backward(images, cube.weight, 0)
        weight, bias = hidden_local(self.weight, cube), hidden_local(self.bias, cube)
        x = F.conv2d(images, weight, bias, stride=self.patch_size).flatten(2).transpose(1, 2)
        cls = hidden_local(self.cls_token, cube).expand(x.shape[0], -1, -1)
        return torch.cat([cls, x], dim=1) + hidden_local(self.pos_embed, cube)

    def extra_repr(self) -> str:
        return f"patch_size={self.patch_size}, num_patches={self.num_patches}, embed_size={self.embed_size}"


class Dropout3D(_CubeLayer):
    """Dropout on 3D activations: every axis of the cube splits them, so the mask comes from the
    stream ``ctx.rng.fork("3d_input", "3d_output", "3d_weight")`` (distinct per tensor rank, equal
    across data replicas)."""

    def __init__(self, p: float = 0.5, *, ctx: ParallelContext | None = None) -> None:
        super().__init__(ctx)
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must be in [0, 1], got {p}")
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with self.ctx.rng.fork(INPUT, OUTPUT, WEIGHT):
            return F.dropout(x, self.p, training=True)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class CrossEntropyLoss3D(_CubeLayer):
    """Mean cross entropy of logits with every class ``[b/q, (s,) C]`` (a ``Classifier3D``'s output)
    against full targets ``[b, (s)]`` (each rank takes its batch block): the mean over the tensor
    group's whole batch, the same scalar on every rank."""

    def __init__(self, *, ignore_index: int = -100, ctx: ParallelContext | None = None) -> None:
        super().__init__(ctx)
        self.ignore_index = ignore_index

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        targets = batch_block(targets, self.cube, self.ignore_index).flatten()
        local = F.cross_entropy(logits.flatten(0, -2).float(), targets, ignore_index=self.ignore_index, reduction="sum")
        return mean_over_batch(local, (targets != self.ignore_index).sum(), self.cube)


class VocabParallelCrossEntropyLoss3D(_CubeLayer):
    """Mean cross entropy of class-split logits ``[b/q, (s,) C']`` (a ``VocabParallelClassifier3D``'s
    output: classes block ``o*q + n``) against full targets ``[b, (s)]``: the same scalar on every
    rank. ``num_classes`` masks the padding of logits fed directly (the classifier's padded
    classes already hold the lowest logit)."""

    def __init__(
        self, *, num_classes: int | None = None, ignore_index: int = -100, ctx: ParallelContext | None = None
    ) -> None:
        super().__init__(ctx)
        self.num_classes, self.ignore_index = num_classes, ignore_index

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        cube = self.cube
        per = logits.shape[-1]
        start = cube.block * per
        valid = per if self.num_classes is None else max(0, min(per, self.num_classes - start))
        targets = batch_block(targets, cube, self.ignore_index).flatten()
        losses = class_parallel_cross_entropy(logits.flatten(0, -2), targets, cube.hidden_groups, start, valid)
        kept = targets != self.ignore_index
        return mean_over_batch(torch.where(kept, losses, torch.zeros_like(losses)).sum(), kept.sum(), cube)
