"""3D tensor parallelism on a q x q x q cube of the tensor group (Agarwal et al. 1995; Bian et al.
2021, "Maximizing parallelism in distributed training for huge neural networks", Colossal-AI's
3D layers).

The cube. Tensor rank ``t = w*q*q + n*q + o``; three lines of the cube pass through it:
``3d_weight`` (members differ in ``w``), ``3d_input`` (in ``n``) and ``3d_output`` (in ``o``).

Activation layout. ``[b, (s,) h]`` is held as ``[ceil(b/q), (s,) F]``:

* the batch is split by ``3d_weight`` (block ``w``; zero rows pad it to a multiple of q, they
  carry no loss and :func:`gather_activation` drops them), the sequence is whole;
* the hidden dimension is split by ``3d_output``, then ``3d_input``: rank ``(w, n, o)`` holds fine
  block ``n`` of coarse block ``o``, a coarse block being ``c = ceil(h/q)`` units and a fine block
  ``F`` units, zero-padded at the end of its coarse block (:class:`HiddenSplit`).

So ``hidden_parts = q^2`` and ``batch_parts = q``. When ``c`` is a multiple of q (every ``h`` with
``h % q^2 == 0``; on q = 2 also ``h % 4 == 3``) ``F = c/q`` and the block is simply block
``o*q + n`` of ``h`` split q^2 ways (a ``ShardSpec`` split by ``(3d_output, 3d_input)``, unpadded
when ``h % q^2 == 0``, so attention heads stay whole). Every layer returns the layout it takes.

Linear (Agarwal's 3D matmul). ``Y = X W^T``, ``W [out, in]``: rank ``(w, n, o)`` keeps
``W[out block w*q + n, in block o]`` (out split q^2 ways by ``(3d_weight, 3d_input)``, in q ways
by ``3d_output``: 1/q^3 of the weight)::

    forward   X_o = all-gather X along 3d_input              [b/q, s, in/q]   in block o
              W_o = all-gather W along 3d_weight             [out/q, in/q]    out blocks o'*q + n, all o'
              Y   = reduce-scatter X_o W_o^T along 3d_output [b/q, s, out/q^2] out block o*q + n
    backward  dY_o = all-gather dY along 3d_output; dX = reduce-scatter dY_o W_o along 3d_input;
              dW = reduce-scatter dY_o^T X_o along 3d_weight.

Because ``W_o`` holds the out blocks ``(o', n)`` of every ``o'``, the reduce-scatter over ``o``
hands rank ``o`` out block ``(o, n)``: the output has exactly the input's layout. (Colossal-AI's
layers instead swap the roles of the input and output axes from one layer to the next, which
the layers then have to track; here nothing is tracked and any chain works: Linear -> LayerNorm
-> Linear, residual adds, ...). Logical bytes per rank, fp size ``e``, sizes divisible::

    all-gather + reduce-scatter on 3d_input    2 (q-1)/q^3 e b s in
    all-gather + reduce-scatter on 3d_weight   2 (q-1)/q^3 e in out
    reduce-scatter + all-gather on 3d_output   2 (q-1)/q^3 e b s out
    all-reduce on 3d_weight (bias gradient)    2 (q-1)/q^3 e out

in all ``2 (q-1)/q^3 e (b s (in + out) + in out)``, plus the bias; with padding every size is
the padded block's (see ``tests/dist/test_tp3d.py``).

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

Uneven hidden sizes. A ``ShardSpec`` pads a dimension split k ways to a multiple of k. A Linear's
in dimension is split q ways, so the activation's coarse blocks are ``ceil(h/q)``; its out
dimension q^2 ways, and its q^2 blocks must be the activation's fine blocks. Both hold when
``c = ceil(h/q)`` is a multiple of q. When it is not but ``h % q == 0`` (h = 30 on q = 2), a
Linear keeps each coarse block of its out dimension as a ``ShardSpec`` group of its own (groups
``q * out_groups``, split by ``(3d_input, 3d_weight)`` and padded to a multiple of q^2), so
``F = round_up(c, q^2)/q``; the other parameters with a hidden dimension are then kept whole on
every rank (their gradient all-reduced over ``tensor``). A Linear whose out features (per fused
part) fit neither, ``h % q != 0`` and ``ceil(h/q) % q != 0`` (h = 29 on q = 2), raises ValueError:
no ``ShardSpec`` can hold its blocks. Other layers take any size; the vocabulary of the
vocabulary-parallel layers is split as plain q^2 blocks (logits ``[b/q, s, ceil(V/q^2)]``, block
``o*q + n``), so any vocabulary works.
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
from tessera.parallel.tensor.common import ShardSpec, round_up, shard_parameter, spec_of

__all__ = [
    "Classifier3D",
    "CrossEntropyLoss3D",
    "Cube",
    "Dropout3D",
    "Embedding3D",
    "HiddenSplit",
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
    "layer_norm_3d",
    "linear_3d",
    "mean_over_batch",
    "split_activation",
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
    def hidden_groups(self) -> tuple[AxisGroup, AxisGroup]:
        """The groups splitting the hidden dimension (statistics over it are summed over both)."""
        return (self.input, self.output)


@dataclass(frozen=True)
class HiddenSplit:
    """How a hidden dimension of ``size`` units lies on the cube: coarse block ``o`` (``coarse``
    units) by ``3d_output``, fine block ``n`` of it (``fine`` units, padded at the end of the
    coarse block) by ``3d_input``."""

    size: int
    q: int

    @property
    def coarse(self) -> int:
        return -(-self.size // self.q)

    @property
    def exact(self) -> bool:
        """Whether block ``(o, n)`` is block ``o*q + n`` of ``size`` split q^2 ways (a ShardSpec)."""
        return self.coarse % self.q == 0

    @property
    def fine(self) -> int:
        """Units per rank (``F``)."""
        if self.exact:
            return self.coarse // self.q
        return round_up(self.coarse, self.q * self.q) // self.q

    def block(self, o: int, n: int) -> tuple[int, int]:
        """``(start, valid)``: where block ``(o, n)`` starts and how many real units it holds."""
        start = o * self.coarse + n * self.fine
        end = min(o * self.coarse + min((n + 1) * self.fine, self.coarse), self.size)
        return start, max(0, end - start)

    def linear_rows(self) -> tuple[tuple[str, str], int]:
        """How a Linear splits out rows of this size: the ``ShardSpec`` axes and the number of
        groups per fused part (see the module docstring, "Uneven hidden sizes")."""
        if self.exact:
            return (WEIGHT, INPUT), 1
        if self.size % self.q == 0:
            return (INPUT, WEIGHT), self.q
        raise ValueError(
            f"3D: a Linear cannot produce {self.size} output features on q={self.q}: neither "
            f"ceil({self.size}/q)={self.coarse} nor {self.size} is divisible by q, so no ShardSpec "
            "holds its blocks; pad the layer to the next multiple of q"
        )


def _context(ctx: ParallelContext | None) -> ParallelContext:
    return ctx if ctx is not None else get_context()


def _check_local(x: torch.Tensor, split: HiddenSplit, what: str) -> None:
    if x.shape[-1] != split.fine:
        raise ValueError(
            f"{what}: expected the 3D layout of {split.size} hidden units ({split.fine} per rank), got "
            f"shape {tuple(x.shape)}; split a full activation with split_activation first"
        )


def _pad_to(x: torch.Tensor, dim: int, size: int, value: float = 0.0) -> torch.Tensor:
    """``x`` with dimension ``dim`` padded at its end with ``value`` to ``size``."""
    extra = size - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def batch_block(x: torch.Tensor, cube: Cube, pad_value: float = 0.0) -> torch.Tensor:
    """This rank's batch rows of a tensor that arrives full on every rank (token ids, images,
    targets): ``[B, ...] -> [ceil(B/q), ...]`` (block ``w``, padded with ``pad_value``). No
    communication and no gradient to the full tensor."""
    per = -(-x.shape[0] // cube.q)
    return _pad_to(x, 0, per * cube.q, pad_value).narrow(0, cube.w * per, per)


def _split_hidden(x: torch.Tensor, split: HiddenSplit, cube: Cube) -> torch.Tensor:
    """``[..., h]`` (full, the same on every rank) -> ``[..., F]`` block ``(o, n)``; the backward
    all-gathers, so the full tensor gets its full gradient on every rank."""
    x = _pad_to(x, -1, split.coarse * cube.q)
    x = comm.split_forward_gather_backward(x, cube.output, -1)
    x = _pad_to(x, -1, split.fine * cube.q)
    return comm.split_forward_gather_backward(x, cube.input, -1)


def _gather_hidden(x: torch.Tensor, split: HiddenSplit, cube: Cube) -> torch.Tensor:
    """Inverse of :func:`_split_hidden`: ``[..., F] -> [..., h]`` on every rank."""
    x = comm.gather_forward_split_backward(x, cube.input, -1)
    x = x.narrow(-1, 0, split.coarse)
    x = comm.gather_forward_split_backward(x, cube.output, -1)
    return x.narrow(-1, 0, split.size)


def _take_block(x: torch.Tensor, dim: int, split: HiddenSplit, cube: Cube, groups: int = 1) -> torch.Tensor:
    """Block ``(o, n)`` of each of the ``groups`` parts of dimension ``dim`` of a full tensor,
    zero-padded to ``F``, side by side (no communication)."""
    dim = dim % x.dim()
    parts = x.unflatten(dim, (groups, split.size))
    start, valid = split.block(cube.o, cube.n)
    block = _pad_to(parts.narrow(dim + 1, start, valid), dim + 1, split.fine)
    return block.flatten(dim, dim + 1)


# ---- parameters with a hidden dimension -------------------------------------------------------


def hidden_param(
    full: torch.Tensor, dim: int, split: HiddenSplit, ctx: ParallelContext, groups: int = 1
) -> nn.Parameter:
    """A parameter whose dimension ``dim`` (``groups`` fused parts of ``split.size``) is hidden:
    sharded as the activations (replicated over ``3d_weight``) when the split is exact, else
    kept whole (see the module docstring)."""
    if not split.exact:
        return nn.Parameter(full.detach().clone())
    dims: list[tuple[str, ...]] = [()] * full.dim()
    dims[dim] = (OUTPUT, INPUT)
    parts = [1] * full.dim()
    parts[dim] = groups
    return shard_parameter(full, ShardSpec(tuple(full.shape), tuple(dims), tuple(parts)), ctx)


def hidden_local(param: torch.Tensor, dim: int, split: HiddenSplit, cube: Cube, groups: int = 1) -> torch.Tensor:
    """This rank's blocks ``[.., groups*F, ..]`` of a :func:`hidden_param`. Each rank uses them on
    its batch block only, so the backward sums the gradient over the ranks that share them."""
    if split.exact:
        return comm.copy_forward_all_reduce_backward(param, cube.weight)
    whole = comm.copy_forward_all_reduce_backward(param, cube.tensor)
    return _take_block(whole, dim, split, cube, groups)


def _check_tied(weight: nn.Parameter, expected: nn.Parameter, owner: str) -> nn.Parameter:
    """``weight`` if it is laid out like ``expected`` (the layer's own parameter would be)."""
    spec, want = spec_of(weight), spec_of(expected)
    same = tuple(weight.shape) == tuple(expected.shape) and (
        (spec is None and want is None)
        or (spec is not None and want is not None and (spec.full_shape, spec.dims) == (want.full_shape, want.dims))
    )
    if not same:
        raise ValueError(f"{owner}: the tied weight has spec {spec}, expected one like {want}")
    return weight


# ---- functional core ---------------------------------------------------------------------------


def _gather_out_rows(weight: torch.Tensor, cube: Cube, groups: int, pieces: int) -> torch.Tensor:
    """All-gather a Linear weight ``[groups*F, in/q]`` along ``3d_weight`` into
    ``[q*groups*F, in/q]``: for each coarse block ``o'``, each part's out block ``(o', n)``; the
    backward reduce-scatters the gradient (summing the batch blocks').

    ``pieces=1``: the rank holds block ``w*q + n`` of each part, i.e. block ``(w, n)``;
    ``pieces=q``: it holds piece ``n*q + w`` of each coarse block of each part (uneven sizes)."""
    rows, cols = weight.shape
    fine = rows // groups
    if pieces == 1:
        local, dim = weight.view(groups, 1, fine, cols), 1
    else:
        local, dim = weight.view(groups, cube.q, fine // cube.q, cols), 2
    gathered = comm.all_gather_forward_reduce_scatter_backward(local, cube.weight, dim)  # [G, q, F, in/q]
    return gathered.transpose(0, 1).reshape(cube.q * rows, cols)


def linear_3d(x: torch.Tensor, weight: torch.Tensor, cube: Cube, *, groups: int = 1, pieces: int = 1) -> torch.Tensor:
    """Agarwal's 3D matmul ``x W^T``: ``x [..., F_in]`` in the layout times this rank's weight block
    ``[groups*F_out, ceil(in/q)]`` -> ``[..., groups*F_out]`` in the layout (each part's block
    ``(o, n)``, side by side). ``pieces`` as in :func:`_gather_out_rows`."""
    x = comm.all_gather_forward_reduce_scatter_backward(x, cube.input, -1)  # in block o (padded)
    x = x.narrow(-1, 0, weight.shape[1])
    w = _gather_out_rows(weight, cube, groups, pieces)
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
    split: HiddenSplit,
    cube: Cube,
    eps: float,
) -> torch.Tensor:
    """LayerNorm of ``x [..., F]`` (the layout) over the whole ``split.size`` hidden units, with
    this rank's blocks of ``weight`` and ``bias``; padded units stay zero."""
    _, valid = split.block(cube.o, cube.n)
    y: torch.Tensor = _NormalizeHidden.apply(x, cube.hidden_groups, split.size, eps, valid)
    if weight is not None:
        y = y * weight
    return y if bias is None else y + bias


def mean_over_batch(local_sum: torch.Tensor, local_count: torch.Tensor, cube: Cube) -> torch.Tensor:
    """``sum / count`` over the batch blocks (``3d_weight``); the ranks of a block hold the same
    values, so the backward is local."""
    total = comm.all_reduce_forward_copy_backward(local_sum, cube.weight)
    count = comm.all_reduce(local_count.to(total.dtype), cube.weight)
    return total / count


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token CE ``[N]`` of logits ``[N, B]`` holding classes ``[start, start + valid)`` of a
    class dimension split over ``groups``: the max, then the sum of exps and the target logit are
    all-reduced over them; the backward is local (``softmax - one_hot`` of this block)."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, groups: tuple[AxisGroup, ...], start: int, valid: int
    ) -> torch.Tensor:
        x = logits.float()
        real = torch.arange(x.shape[-1], device=x.device) < valid
        top = x.masked_fill(~real, float("-inf")).amax(dim=-1)
        for group in groups:
            comm.all_reduce(top, group, op="max")
        shifted = x - top.unsqueeze(-1)
        exp = shifted.exp().masked_fill(~real, 0.0)
        local = targets - start
        has_target = (local >= 0) & (local < valid)
        index = torch.where(has_target, local, torch.zeros_like(local))
        target_logit = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1).masked_fill(~has_target, 0.0)
        sums = torch.stack([exp.sum(dim=-1), target_logit])
        for group in groups:
            comm.all_reduce(sums, group)
        ctx.save_for_backward(exp.div_(sums[0].unsqueeze(-1)), index, has_target)
        ctx.logits_dtype = logits.dtype
        return sums[0].log() - sums[1]

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        softmax, index, has_target = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, index.unsqueeze(-1), -has_target.to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


# ---- boundary helpers ------------------------------------------------------------------------


def hidden_parts(ctx: ParallelContext | None = None) -> int:
    """The hidden dimension is split into q^2 blocks (by ``3d_output``, then ``3d_input``)."""
    return Cube.of(_context(ctx)).q ** 2


def batch_parts(ctx: ParallelContext | None = None) -> int:
    """The batch is split into q blocks (by ``3d_weight``)."""
    return Cube.of(_context(ctx)).q


def split_activation(x_full: torch.Tensor, ctx: ParallelContext | None = None) -> torch.Tensor:
    """``[b, (s,) h]`` (full, the same on every rank) -> ``[ceil(b/q), (s,) F]``: batch block ``w``,
    hidden block ``(o, n)``, zero-padded. Backward all-gathers, so the full input gets its full
    gradient on every rank."""
    cube = Cube.of(_context(ctx))
    x = _pad_to(x_full, 0, -(-x_full.shape[0] // cube.q) * cube.q)
    x = comm.split_forward_gather_backward(x, cube.weight, 0)
    return _split_hidden(x, HiddenSplit(x_full.shape[-1], cube.q), cube)


def gather_activation(
    x_local: torch.Tensor, ctx: ParallelContext | None = None, full_shape: Any = None
) -> torch.Tensor:
    """Inverse of :func:`split_activation` (collective over the tensor group): the full activation on
    every rank. ``full_shape`` (its batch and last entries) drops the padding; without it the sizes
    are taken as unpadded (``q * b_local``, ``q^2 * F``)."""
    cube = Cube.of(_context(ctx))
    batch = full_shape[0] if full_shape is not None else cube.q * x_local.shape[0]
    hidden = full_shape[-1] if full_shape is not None else cube.q**2 * x_local.shape[-1]
    split = HiddenSplit(hidden, cube.q)
    _check_local(x_local, split, "gather_activation")
    x = _gather_hidden(x_local, split, cube)
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
    ``out_groups`` fused parts) by in block ``o``, 1/q^3 of it; ``bias`` as the activations.
    Any ``in_features``; ``out_features`` per part with ``ceil(out/q) % q == 0`` or ``out % q == 0``
    (see "Uneven hidden sizes" above), else ValueError."""

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
        q = self.cube.q
        self.in_features, self.out_features, self.out_groups = in_features, out_features, out_groups
        self.in_split, self.out_split = HiddenSplit(in_features, q), HiddenSplit(out_features // out_groups, q)
        row_axes, self.pieces = self.out_split.linear_rows()
        plain = nn.Linear(in_features, out_features, bias=bias)
        spec = ShardSpec((out_features, in_features), (row_axes, (OUTPUT,)), (out_groups * self.pieces, 1))
        self.weight = shard_parameter(plain.weight, spec, self.ctx)
        self.bias: nn.Parameter | None = None
        if plain.bias is not None:
            self.bias = hidden_param(plain.bias, 0, self.out_split, self.ctx, out_groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_local(x, self.in_split, "Linear3D input")
        y = linear_3d(x, self.weight, self.cube, groups=self.out_groups, pieces=self.pieces)
        if self.bias is not None:
            y = y + hidden_local(self.bias, 0, self.out_split, self.cube, self.out_groups)
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
        self.split = HiddenSplit(plain.normalized_shape[0], self.cube.q)
        self.weight = hidden_param(plain.weight, 0, self.split, self.ctx)
        self.bias: nn.Parameter | None = None
        if plain.bias is not None:
            self.bias = hidden_param(plain.bias, 0, self.split, self.ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_local(x, self.split, "LayerNorm3D input")
        weight = hidden_local(self.weight, 0, self.split, self.cube)
        bias = None if self.bias is None else hidden_local(self.bias, 0, self.split, self.cube)
        return layer_norm_3d(x, weight, bias, self.split, self.cube, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


class Embedding3D(_CubeLayer):
    """Lookup with every row of ``weight [num, dim]`` on every rank and ``dim`` split as the
    activations: token ids ``[b, (s)]`` (full) -> ``[b/q, (s,) F]``, no communication forward."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, ctx: ParallelContext | None = None) -> None:
        super().__init__(ctx)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.split = HiddenSplit(embedding_dim, self.cube.q)
        plain = nn.Embedding(num_embeddings, embedding_dim)
        self.weight = hidden_param(plain.weight, 1, self.split, self.ctx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        table = hidden_local(self.weight, 1, self.split, self.cube)
        return F.embedding(batch_block(ids, self.cube), table)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


def _vocab_spec(num: int, hidden: int) -> ShardSpec:
    """``[V, h]`` split as a Linear weight: vocabulary q^2 ways, hidden q ways."""
    return ShardSpec((num, hidden), ((WEIGHT, INPUT), (OUTPUT,)))


class VocabParallelEmbedding3D(_CubeLayer):
    """Lookup with ``weight [V, dim]`` split as a Linear weight (rows ``w*q + n`` of V split q^2
    ways, hidden coarse block ``o``): each rank looks the whole batch up in its rows (zeros for
    other ids), then the partial lookups are reduce-scattered over ``3d_input`` (hidden) and
    ``3d_weight`` (batch). ``[b, (s)]`` (full) -> ``[b/q, (s,) F]``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, ctx: ParallelContext | None = None) -> None:
        super().__init__(ctx)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.split = HiddenSplit(embedding_dim, self.cube.q)
        plain = nn.Embedding(num_embeddings, embedding_dim)
        self.weight = shard_parameter(plain.weight, _vocab_spec(num_embeddings, embedding_dim), self.ctx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        cube = self.cube
        rows = self.weight.shape[0]
        start = (cube.w * cube.q + cube.n) * rows
        ids = _pad_to(ids, 0, -(-ids.shape[0] // cube.q) * cube.q)
        mine = (ids >= start) & (ids < start + rows)
        local = F.embedding(torch.where(mine, ids - start, torch.zeros_like(ids)), self.weight)
        local = _pad_to(local.masked_fill(~mine.unsqueeze(-1), 0.0), -1, cube.q * self.split.fine)
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
        self.split = HiddenSplit(in_features, self.cube.q)
        plain = nn.Linear(in_features, num_classes, bias=bias)
        own = hidden_param(plain.weight, 1, self.split, self.ctx)
        self.weight = own if weight is None else _check_tied(weight, own, "Classifier3D")
        self.bias = plain.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_local(x, self.split, "Classifier3D input")
        logits = F.linear(x, hidden_local(self.weight, 1, self.split, self.cube))
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
        self.split = HiddenSplit(in_features, self.cube.q)
        plain = nn.Linear(in_features, num_classes, bias=bias)
        if weight is None:
            self.weight = shard_parameter(plain.weight, _vocab_spec(num_classes, in_features), self.ctx)
        else:
            spec = spec_of(weight)
            if spec is None or (spec.full_shape, spec.dims) != (
                (num_classes, in_features),
                _vocab_spec(num_classes, in_features).dims,
            ):
                raise ValueError(
                    f"VocabParallelClassifier3D: the tied weight has spec {spec}, expected one like "
                    f"{_vocab_spec(num_classes, in_features)}"
                )
            self.weight = weight
        self.bias: nn.Parameter | None = None
        if plain.bias is not None:
            spec = ShardSpec((num_classes,), ((OUTPUT, INPUT),))
            self.bias = shard_parameter(plain.bias, spec, self.ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_local(x, self.split, "VocabParallelClassifier3D input")
        cube = self.cube
        logits = linear_3d(x, self.weight, cube)
        if self.bias is not None:
            logits = logits + comm.copy_forward_all_reduce_backward(self.bias, cube.weight)
        per = logits.shape[-1]
        valid = max(0, min(per, self.num_classes - (cube.o * cube.q + cube.n) * per))
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
        self.split = HiddenSplit(embed_size, self.cube.q)
        assert plain.bias is not None  # a conv with bias
        self.weight = hidden_param(plain.weight, 0, self.split, self.ctx)
        self.bias = hidden_param(plain.bias, 0, self.split, self.ctx)
        self.cls_token = hidden_param(plain.cls_token, 2, self.split, self.ctx)
        self.pos_embed = hidden_param(plain.pos_embed, 2, self.split, self.ctx)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        cube, split = self.cube, self.split
        for group in cube.hidden_groups:  # each rank's channels feed back a part of the image grad
            images = comm.copy_forward_all_reduce_backward(images, group)
        images = _pad_to(images, 0, -(-images.shape[0] // cube.q) * cube.q)
        images = comm.split_forward_gather_backward(images, cube.weight, 0)
        weight, bias = hidden_local(self.weight, 0, split, cube), hidden_local(self.bias, 0, split, cube)
        x = F.conv2d(images, weight, bias, stride=self.patch_size).flatten(2).transpose(1, 2)
        cls = hidden_local(self.cls_token, 2, split, cube).expand(x.shape[0], -1, -1)
        return torch.cat([cls, x], dim=1) + hidden_local(self.pos_embed, 2, split, cube)

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
        start = (cube.o * cube.q + cube.n) * per
        valid = per if self.num_classes is None else max(0, min(per, self.num_classes - start))
        targets = batch_block(targets, cube, self.ignore_index).flatten()
        losses = _VocabParallelCrossEntropy.apply(logits.flatten(0, -2), targets, cube.hidden_groups, start, valid)
        kept = targets != self.ignore_index
        return mean_over_batch(torch.where(kept, losses, torch.zeros_like(losses)).sum(), kept.sum(), cube)
