"""3D layers: thin ``nn.Module``s over :mod:`tessera.parallel.tensor.tp3d.functional` (the
cube, the layout and the parameters' blocks are described there). Each takes its context as
``ctx=``; ``tessera.nn`` has the same classes taking the current context by default."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera import comm
from tessera.context import ParallelContext
from tessera.parallel.tensor.common import ShardSpec, check_tied, class_parallel_cross_entropy, pad_dim, shard_parameter
from tessera.parallel.tensor.plain import PatchEmbedding
from tessera.parallel.tensor.tp3d.functional import (
    INPUT,
    OUTPUT,
    WEIGHT,
    Cube,
    batch_block,
    check_local,
    hidden_local,
    hidden_param,
    hidden_spec,
    layer_norm_3d,
    linear_3d,
    mean_over_batch,
    weight_spec,
)

__all__ = [
    "Classifier3D",
    "CrossEntropyLoss3D",
    "Dropout3D",
    "Embedding3D",
    "LayerNorm3D",
    "Linear3D",
    "PatchEmbedding3D",
    "VocabParallelClassifier3D",
    "VocabParallelCrossEntropyLoss3D",
    "VocabParallelEmbedding3D",
]


class _CubeLayer(nn.Module):
    """Holds the context and this rank's cube."""

    def __init__(self, ctx: ParallelContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.cube = Cube.of(self.ctx)


class Linear3D(_CubeLayer):
    """``y = x W^T + b`` (Agarwal's 3D matmul): ``[b/q, (s,) F_in] -> [b/q, (s,) out_groups*F_out]``,
    both in the activation layout. ``weight [out, in]``: out block ``w*q + n`` (of each of
    ``out_groups`` fused parts) by in block ``o``, 1/q^3 of it (:func:`weight_spec`); ``bias`` as
    the activations. Any sizes. ``keep_blocks`` keeps the weight gathered in the forward for the
    backward (the default of this class; ``tessera.nn`` passes ``parallel.tensor.keep_blocks``);
    off, the backward gathers it again."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        out_groups: int = 1,
        keep_blocks: bool = True,
        ctx: ParallelContext,
    ) -> None:
        super().__init__(ctx)
        self.keep_blocks = keep_blocks
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
        check_local(x, self.in_features, self.cube, "Linear3D input")
        y = linear_3d(x, self.weight, self.cube, groups=self.out_groups, keep_blocks=self.keep_blocks)
        if self.bias is not None:
            y = y + hidden_local(self.bias, self.cube)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"out_groups={self.out_groups}, keep_blocks={self.keep_blocks}"
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
        ctx: ParallelContext,
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
        check_local(x, size, self.cube, "LayerNorm3D input")
        bias = None if self.bias is None else hidden_local(self.bias, self.cube)
        return layer_norm_3d(x, hidden_local(self.weight, self.cube), bias, size, self.cube, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


class Embedding3D(_CubeLayer):
    """Lookup with every row of ``weight [num, dim]`` on every rank and ``dim`` split as the
    activations: token ids ``[b, (s)]`` (full) -> ``[b/q, (s,) F]``, no communication forward."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, ctx: ParallelContext) -> None:
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

    def __init__(self, num_embeddings: int, embedding_dim: int, *, ctx: ParallelContext) -> None:
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
        ctx: ParallelContext,
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
        check_local(x, self.in_features, self.cube, "Classifier3D input")
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
    logit, so a softmax gives them zero probability and zero gradient. ``keep_blocks`` as
    :class:`Linear3D`'s."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        bias: bool = False,
        *,
        weight: nn.Parameter | None = None,
        keep_blocks: bool = True,
        ctx: ParallelContext,
    ) -> None:
        super().__init__(ctx)
        self.in_features, self.num_classes, self.keep_blocks = in_features, num_classes, keep_blocks
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
        check_local(x, self.in_features, self.cube, "VocabParallelClassifier3D input")
        cube = self.cube
        logits = linear_3d(x, self.weight, cube, keep_blocks=self.keep_blocks)
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
    """ViT patch embedding (as ``plain.PatchEmbedding``) with every parameter split on the
    embedding dimension as the activations: images ``[b, c, H, W]`` (full) ->
    ``[b/q, 1 + N, F]``; each rank convolves its batch block into its channels."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_size: int, *, ctx: ParallelContext) -> None:
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

    def __init__(self, p: float = 0.5, *, ctx: ParallelContext) -> None:
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

    def __init__(self, *, ignore_index: int = -100, ctx: ParallelContext) -> None:
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

    def __init__(self, *, num_classes: int | None = None, ignore_index: int = -100, ctx: ParallelContext) -> None:
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
