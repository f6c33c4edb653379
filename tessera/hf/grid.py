"""The grid tensor modes (2D SUMMA, 2.5D Tesseract, 3D) for unmodified Hugging Face models.

In a grid mode every activation between layers has one layout: ``[b, (s,) h]`` held as this
rank's batch block and hidden block (:class:`Space` says which groups cut which). So, unlike 1D,
no layer needs to know where it stands: every Linear becomes the mode's Linear, every norm the
mode's norm, and the model's own code in between (attention on ``view(..., -1, head_dim)``,
residual adds, activations) runs unchanged on the blocks, each rank holding whole heads of its
batch rows. What :func:`apply_grid` does to a model laid out as a :class:`~tessera.hf.decoder.Layout`:

- at the model's entry (a forward pre-hook) every batch-sized input but ``labels`` (token ids,
  attention masks, token types, images) is cut to this rank's batch block, so the model's own
  shape arithmetic and masks see the local batch;
- the word embedding becomes the mode's vocabulary-parallel embedding (fed the whole batch's ids,
  all-gathered: they are small), which a vocabulary head may share (tied);
- the ``replicated`` modules (position and token-type tables, ViT's patch embedding) run whole on
  the local batch and hand on their hidden block; their parameters' gradients are summed over
  the tensor group;
- every ``nn.Linear`` / ``Conv1D`` becomes :class:`GridLinear` (the mode's Linear, fused parts
  kept; a LoRA layer's base too, its adapter split with it: ``tessera.lora``), every LayerNorm
  :class:`GridNorm` (the mode's) and every RMSNorm :class:`GridRMSNorm`;
- the head's logits, or a base model's outputs, are gathered whole (batch and classes), so the
  model's loss and the user's see plain tensors.

Every replacement keeps the replaced module's parameter names and full shapes (a ``Conv1D``'s
weight stays ``[in, out]``), so full state dicts have the plain model's keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from tessera import comm
from tessera.comm import AxisGroup
from tessera.context import ParallelContext
from tessera.hf.decoder import Layout, has_submodule
from tessera.hf.layers import is_conv1d
from tessera.hf.policy import retie, swap
from tessera.parallel.tensor.common import (
    ShardSpec,
    all_reduce_forward_backward,
    pad_dim,
    shard_parameter,
    spec_of,
    sum_grad_over,
)
from tessera.parallel.tensor.grid import Cube
from tessera.parallel.tensor.modes import MODES, TensorMode
from tessera.parallel.tensor.tp2d.functional import grid_2d
from tessera.parallel.tensor.tp2p5d.functional import grid_2p5d

__all__ = ["GridLinear", "GridNorm", "GridRMSNorm", "Space", "apply_grid", "head_parts"]

GRID_MODES = ("2d", "2.5d", "3d")
WHOLE_INPUTS = ("labels",)  # batch-sized inputs the model uses only against gathered outputs


@dataclass(frozen=True)
class Space:
    """How a grid mode cuts an activation ``[b, (s,) h]``: the batch by ``batch`` (outermost
    first: block ``index`` row-major over the groups' ranks) and the hidden dimension by
    ``hidden`` likewise, each zero-padded to a multiple of its number of blocks."""

    batch: tuple[AxisGroup, ...]
    hidden: tuple[AxisGroup, ...]
    tensor: AxisGroup

    @staticmethod
    def of(ctx: ParallelContext) -> Space:
        mode = ctx.dims.tensor_mode
        if mode in ("2d", "2.5d"):
            grid = grid_2d(ctx) if mode == "2d" else grid_2p5d(ctx)
            return Space(grid.batch_groups, (grid.row,), ctx.group("tensor"))
        if mode == "3d":
            cube = Cube.of(ctx)
            return Space((cube.weight,), (cube.output, cube.input), ctx.group("tensor"))
        raise ValueError(f"tensor mode {mode!r} is not a grid mode ({', '.join(GRID_MODES)})")

    @staticmethod
    def _index(groups: Sequence[AxisGroup]) -> int:
        index = 0
        for group in groups:
            index = index * group.size + group.rank
        return index

    @property
    def batch_parts(self) -> int:
        return math.prod(g.size for g in self.batch)

    @property
    def hidden_parts(self) -> int:
        return math.prod(g.size for g in self.hidden)

    def batch_block(self, x: torch.Tensor, pad_value: float = 0) -> torch.Tensor:
        """This rank's rows of ``x [B, ...]`` (the same on every rank), padded with ``pad_value``."""
        x = pad_dim(x, 0, self.batch_parts, pad_value)
        per = x.shape[0] // self.batch_parts
        return x.narrow(0, self._index(self.batch) * per, per)

    def whole_batch(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's :meth:`batch_block` of a tensor, side by side (padding rows kept)."""
        for group in reversed(self.batch):  # innermost first
            x = comm.all_gather(x.contiguous(), group, dim=0)
        return x

    def hidden_block(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's block of the last dimension of ``x`` (differentiable; zero-padded)."""
        x = pad_dim(x, -1, self.hidden_parts)
        per = x.shape[-1] // self.hidden_parts
        return x.narrow(-1, self._index(self.hidden) * per, per)


def head_parts(ctx: ParallelContext) -> int:
    """Into how many parts a layout splits the attention heads: the tensor size in 1D, the hidden
    dimension's blocks in a grid mode."""
    mode = ctx.dims.tensor_mode
    return ctx.size("tensor") if mode == "1d" else int(MODES[mode].hidden_parts(ctx))


def _kernel(make: Callable[[], nn.Module]) -> nn.Module:
    """A mode layer built on the meta device, used only for its forward (its parameters are
    passed in by ``functional_call``) and its parameters' specs."""
    with torch.device("meta"):
        return make()


def _transposed(spec: ShardSpec) -> ShardSpec:
    return ShardSpec(spec.full_shape[::-1], spec.dims[::-1], spec.groups[::-1], spec.pad_to[::-1])


def _spec(param: Any) -> ShardSpec:
    spec = spec_of(param) if isinstance(param, torch.Tensor) else None
    if spec is None:
        raise RuntimeError("a grid-mode layer built without a sharded parameter")
    return spec


class _Kernelled(nn.Module):
    """A module whose forward is a mode layer's (``self.kernel``, not a submodule) run on this
    module's own parameters, which keep the replaced module's names."""

    def __init__(self, kernel: nn.Module) -> None:
        super().__init__()
        self.kernel: nn.Module
        object.__setattr__(self, "kernel", kernel)

    def _params(self) -> dict[str, torch.Tensor]:
        return dict(self.named_parameters(recurse=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.kernel, self._params(), (x,))


class GridLinear(_Kernelled):
    """``module`` (``nn.Linear`` or ``Conv1D``) as the mode's Linear: ``[b, (s,) in]`` ->
    ``[b, (s,) out]`` in the activation layout; ``groups`` fused outputs (q, k, v) each split
    on their own. A ``Conv1D``'s weight keeps its ``[in, out]`` shape (its spec transposed)."""

    def __init__(self, module: Any, *, ctx: ParallelContext, mode: TensorMode, groups: int = 1) -> None:
        self.transposed = is_conv1d(module)
        weight = module.weight.t() if self.transposed else module.weight
        out_features, in_features = weight.shape
        bias = module.bias is not None
        super().__init__(_kernel(lambda: mode.linear(in_features, out_features, bias, out_groups=groups, ctx=ctx)))
        self.in_features, self.out_features, self.groups = in_features, out_features, groups
        spec = _spec(self.kernel.weight)
        if self.transposed:
            self.weight = shard_parameter(module.weight, _transposed(spec), ctx)
        else:
            self.weight = shard_parameter(module.weight, spec, ctx)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = shard_parameter(module.bias, _spec(self.kernel.bias), ctx)

    def _params(self) -> dict[str, torch.Tensor]:
        params = super()._params()
        if self.transposed:
            params["weight"] = self.weight.t().contiguous()
        return params

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, groups={self.groups}, "
            f"conv1d={self.transposed}, {type(self.kernel).__name__}"
        )


class GridNorm(_Kernelled):
    """An ``nn.LayerNorm`` over the last dimension as the mode's LayerNorm (statistics over the
    whole hidden size)."""

    def __init__(self, module: nn.LayerNorm, *, ctx: ParallelContext, mode: TensorMode) -> None:
        (hidden,) = module.normalized_shape
        bias = module.bias is not None
        if module.weight is None:
            raise ValueError("a LayerNorm without elementwise_affine has no grid-mode stand-in")
        super().__init__(_kernel(lambda: mode.layer_norm(hidden, module.eps, bias, ctx=ctx)))
        self.weight = shard_parameter(module.weight, _spec(self.kernel.weight), ctx)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = shard_parameter(module.bias, _spec(self.kernel.bias), ctx)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)} local, {type(self.kernel).__name__}"


def is_rms_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a LLaMA-style RMSNorm: ``weight * x / rms(x)``, computed in fp32."""
    return type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), nn.Parameter)


class GridRMSNorm(nn.Module):
    """A LLaMA-style RMSNorm (``weight * (x * rsqrt(mean(x^2) + eps))``, computed in fp32 and cast
    back) over a hidden dimension split as the activations: the sum of squares is all-reduced
    over the hidden blocks (padding units are zero and add nothing); ``weight`` is split as
    the hidden dimension, its gradient summed over the batch blocks."""

    def __init__(self, module: nn.Module, *, ctx: ParallelContext, mode: TensorMode, space: Space) -> None:
        super().__init__()
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        self.hidden = weight.shape[0]
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if eps is None:
            raise ValueError(f"{type(module).__name__}: no variance_epsilon or eps")
        self.eps = float(eps)
        self.space = space
        norm = _kernel(lambda: mode.layer_norm(self.hidden, self.eps, False, ctx=ctx))
        self.weight = shard_parameter(weight, _spec(norm.weight), ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        squares = h.pow(2).sum(-1, keepdim=True)
        for group in self.space.hidden:
            squares = all_reduce_forward_backward(squares, group)
        h = h * torch.rsqrt(squares / self.hidden + self.eps)
        return sum_grad_over(self.weight, *self.space.batch) * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.hidden}, eps={self.eps}, split as the activations"


class GridEmbedding(_Kernelled):
    """The word embedding (``nn.Embedding``) as the mode's vocabulary-parallel embedding: this
    rank's batch block of ids -> ``[b, s, h]`` in the activation layout (the whole batch's ids
    are all-gathered for the mode's lookup). Ids equal to ``padding_idx`` give their row no
    gradient, as in ``nn.Embedding``."""

    def __init__(self, module: nn.Embedding, *, ctx: ParallelContext, mode: TensorMode, space: Space) -> None:
        vocab, dim = module.num_embeddings, module.embedding_dim
        super().__init__(_kernel(lambda: mode.vocab_parallel_embedding(vocab, dim, ctx=ctx)))
        self.num_embeddings, self.embedding_dim, self.padding_idx = vocab, dim, module.padding_idx
        self.space = space
        self.weight = shard_parameter(module.weight, _spec(self.kernel.weight), ctx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = functional_call(self.kernel, self._params(), (self.space.whole_batch(ids),))
        if self.padding_idx is not None:
            padded = (ids == self.padding_idx).unsqueeze(-1)
            out = torch.where(padded, out.detach(), out)
        return out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {type(self.kernel).__name__}"


class GridHead(_Kernelled):
    """The output projection: a vocabulary head (``vocab``: the mode's vocabulary-parallel
    classifier, sharing the embedding's weight when ``tied``) or a class head (the mode's
    Linear); its logits are gathered whole, ``[B, (s,) classes]``, the batch's true size read
    from ``batch`` (set at the model's entry)."""

    def __init__(
        self,
        module: nn.Linear,
        *,
        ctx: ParallelContext,
        mode: TensorMode,
        batch: _BatchSize,
        vocab: bool,
        tied: nn.Parameter | None,
    ) -> None:
        classes, hidden, bias = module.out_features, module.in_features, module.bias is not None
        if vocab:
            kernel = _kernel(lambda: mode.vocab_parallel_classifier(hidden, classes, bias, ctx=ctx))
        else:
            kernel = _kernel(lambda: mode.linear(hidden, classes, bias, ctx=ctx))
        super().__init__(kernel)
        self.ctx, self.mode, self.batch = ctx, mode, batch
        self.in_features, self.out_features = hidden, classes
        self.weight = tied if tied is not None else shard_parameter(module.weight, _spec(self.kernel.weight), ctx)
        if tied is not None and spec_of(tied) != _spec(self.kernel.weight):
            raise ValueError("a tied head's weight is not split as the vocabulary-parallel classifier's")
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = shard_parameter(module.bias, _spec(self.kernel.bias), ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        return self.mode.gather_activation(logits, self.ctx, (self.batch.size, self.out_features))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, gathered, {type(self.kernel).__name__}"
        )


class _BatchSize:
    """The true batch size of the current forward (set at the model's entry, read by the
    gathers at its exit)."""

    size = 0


def _enter(model: nn.Module, space: Space, batch: _BatchSize) -> None:
    """At ``model``'s entry cut every batch-sized tensor input but ``labels`` to this rank's
    batch block (attention masks padded with 1, so padding rows attend somewhere)."""

    def cut(name: str, value: Any, size: int) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != size:
            return value
        if name in WHOLE_INPUTS:
            return value
        return space.batch_block(value, 1 if name.endswith("attention_mask") else 0)

    def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError("grid tensor modes take token ids (input_ids), not inputs_embeds")
        main = args[0] if args else kwargs.get("input_ids", kwargs.get("pixel_values"))
        if not isinstance(main, torch.Tensor):
            raise ValueError("grid tensor modes need the model's input (input_ids or pixel_values) as a tensor")
        batch.size = main.shape[0]
        args = tuple(cut("", a, batch.size) for a in args)
        return args, {k: cut(k, v, batch.size) for k, v in kwargs.items()}

    model.register_forward_pre_hook(hook, with_kwargs=True)


def _exit_base(model: Any, ctx: ParallelContext, mode: TensorMode, batch: _BatchSize) -> None:
    """At a base model's exit gather its outputs whole (``last_hidden_state``, ``pooler_output``)."""

    def hook(_: nn.Module, args: Any, out: Any) -> Any:
        for key in ("last_hidden_state", "pooler_output"):
            value = out.get(key) if hasattr(out, "get") else None
            if isinstance(value, torch.Tensor):
                out[key] = mode.gather_activation(value, ctx, (batch.size, model.config.hidden_size))
        return out

    model.register_forward_hook(hook)


def _replicated(module: nn.Module, space: Space) -> None:
    """``module`` runs whole on the local batch and hands on its output's hidden block; each
    rank's gradient of its parameters covers its batch and hidden blocks, so they are summed
    over the tensor group (the parameters stay equal everywhere)."""
    module.register_forward_hook(lambda _m, _a, out: space.hidden_block(out))
    for param in module.parameters():
        if param.requires_grad:  # a frozen table (an adapter's base) has no gradient to sum
            param.register_hook(lambda grad: comm.all_reduce(grad.contiguous(), space.tensor))


def apply_grid(model: Any, ctx: ParallelContext, layout: Layout) -> dict[int, nn.Parameter]:
    """Rewrite ``model`` (laid out as ``layout``) for ``ctx``'s grid tensor mode; the replaced
    parameters, old id -> new parameter."""
    mode, space, batch = MODES[ctx.dims.tensor_mode], Space.of(ctx), _BatchSize()
    has_head = has_submodule(model, layout.head)
    prefix = f"{layout.body}." if has_head and layout.body else ""
    replicated = tuple(prefix + name for name in layout.replicated)
    groups = {
        f"{prefix}{layout.layers}.{n}.{column}": parts
        for n in range(len(model.get_submodule(prefix + layout.layers)))
        for block in layout.blocks
        for column, parts in block.columns.items()
    }
    embedding = prefix + layout.embedding if layout.embedding is not None else None
    replaced: dict[int, nn.Parameter] = {}

    for name, module in list(model.named_modules()):
        if not name or any(name == r or name.startswith(r + ".") for r in replicated):
            continue
        make: Callable[[Any], nn.Module] | None = None
        if name == layout.head and has_head:
            tied = replaced.get(id(module.weight))
            make = partial(GridHead, ctx=ctx, mode=mode, batch=batch, vocab=layout.vocab_head, tied=tied)
        elif name == embedding:
            make = partial(GridEmbedding, ctx=ctx, mode=mode, space=space)
        elif isinstance(module, nn.Linear) or is_conv1d(module):
            owner, _, part = name.rpartition(".")
            if part in ("base_layer", "lora_A", "lora_B") and hasattr(model.get_submodule(owner), "rebase"):
                if part != "base_layer":
                    continue  # a LoRA layer: swapped whole, its rebase splits the factors with the base
                name = owner
            make = partial(GridLinear, ctx=ctx, mode=mode, groups=groups.get(name, 1))
        elif isinstance(module, nn.LayerNorm):
            make = partial(GridNorm, ctx=ctx, mode=mode)
        elif is_rms_norm(module):
            make = partial(GridRMSNorm, ctx=ctx, mode=mode, space=space)
        elif isinstance(module, nn.Embedding):
            raise ValueError(f"{name}: an embedding the layout does not list (as the word embedding or replicated)")
        if make is not None:
            swap(model, name, make, replaced)
    retie(model, replaced)  # a parameter the model shares elsewhere (BERT's head bias) follows its split
    for name in replicated:
        _replicated(model.get_submodule(name), space)
    parts = space.hidden_parts
    if layout.per_layer is not None:
        for layer in model.get_submodule(prefix + layout.layers):
            layout.per_layer(layer, parts)
    _enter(model, space, batch)
    if not has_head:
        _exit_base(model, ctx, mode, batch)
    return replaced
