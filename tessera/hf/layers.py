"""Tensor-parallel stand-ins for the layers of an unmodified Hugging Face model (1D, Megatron).

Each is built *from* the module it replaces and keeps that module's parameter names and full
shapes (a ``Conv1D``'s weight stays ``[in, out]``), so ``full_state_dict`` of a parallel model
gives the keys and shapes of the plain ``transformers`` model. The arithmetic is the 1D
functional core (:mod:`tessera.parallel.tensor.tp1d.functional`); these modules only say which
dimension of the existing weight is split and call it.

- :func:`enter_region`: the input of an attention or MLP block (a forward pre-hook applies it),
  replicated with its gradient summed over the group, or with sequence parallelism gathered
  along the sequence;
- :class:`ColumnParallel`: ``nn.Linear`` (weight ``[out, in]``) or ``Conv1D`` (``[in, out]``) split
  on its outputs, ``groups`` fused parts (GPT-2's ``c_attn`` holds q, k and v) each split on
  its own: ``[..., in] -> [..., out/P]``, a local matmul inside the region;
- :class:`RowParallel`: split on its inputs, bias whole: ``[..., in/P] -> [..., out]``;
- :class:`VocabEmbedding`: an ``nn.Embedding`` split on the vocabulary (padded to a multiple of
  P): each rank looks up its rows, the results are summed;
- :class:`VocabHead`: the output projection split on the vocabulary, its logits gathered whole
  (``[..., V]``, padding dropped), so the model's own loss and generation code see plain logits;
- :class:`SequenceParallelNorm`: a replicated norm applied to this rank's part of the sequence,
  its parameters' gradients summed over the tensor group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from tessera import comm
from tessera.context import ParallelContext
from tessera.parallel.tensor.common import ShardSpec, local_range, shard_parameter
from tessera.parallel.tensor.tp1d.functional import (
    SEQ_DIM,
    TENSOR,
    column_parallel_linear,
    gather_last_dim,
    row_parallel_linear,
    vocab_parallel_embedding,
)

__all__ = [
    "ColumnParallel",
    "RowParallel",
    "SequenceParallelNorm",
    "VocabEmbedding",
    "VocabHead",
    "enter_region",
    "is_conv1d",
]


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (a linear layer with weight ``[in, out]``)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _features(module: Any) -> tuple[int, int, bool]:
    """``(in, out, transposed)`` of a Linear or a Conv1D."""
    if is_conv1d(module):
        return module.weight.shape[0], module.weight.shape[1], True
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    raise TypeError(f"{type(module).__name__} is neither nn.Linear nor transformers' Conv1D")


class ColumnParallel(nn.Module):
    """``module`` (Linear or Conv1D) split on its ``out`` features over the tensor group:
    ``[..., in] -> [..., out/P]``, a local matmul. Its input must have entered the tensor
    region (:func:`enter_region`), whose backward sums the input's gradient over the group."""

    def __init__(self, module: Any, *, ctx: ParallelContext, groups: int = 1) -> None:
        super().__init__()
        self.ctx, self.groups = ctx, groups
        self.in_features, self.out_features, self.transposed = _features(module)
        out_dim = 1 if self.transposed else 0
        dims: list[tuple[str, ...]] = [(), ()]
        dims[out_dim] = (TENSOR,)
        parts = [1, 1]
        parts[out_dim] = groups
        spec = ShardSpec(tuple(module.weight.shape), tuple(dims), tuple(parts))
        self.weight = shard_parameter(module.weight, spec, ctx)
        self.bias: nn.Parameter | None = None
        if module.bias is not None:
            self.bias = shard_parameter(module.bias, ShardSpec((self.out_features,), ((TENSOR,),), (groups,)), ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.t() if self.transposed else self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, groups={self.groups}, "
            f"conv1d={self.transposed}"
        )


def enter_region(x: torch.Tensor, ctx: ParallelContext, sequence_parallel: bool) -> torch.Tensor:
    """The input of a tensor-parallel region (attention, MLP): ``x`` replicated, its gradient
    summed over the tensor group in backward; with ``sequence_parallel`` ``x`` is this rank's
    ``[b, s/P, h]`` and is all-gathered to ``[b, s, h]`` (reduce-scattered in backward)."""
    group = ctx.group(TENSOR)
    if sequence_parallel:
        return comm.all_gather_forward_reduce_scatter_backward(x, group, dim=SEQ_DIM)
    return comm.copy_forward_all_reduce_backward(x, group)


class RowParallel(nn.Module):
    """``module`` (Linear or Conv1D) split on its ``in`` features; its output summed over the
    tensor group (reduce-scattered along the sequence with ``sequence_parallel``)."""

    def __init__(self, module: Any, *, ctx: ParallelContext, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.ctx, self.sequence_parallel = ctx, sequence_parallel
        self.in_features, self.out_features, self.transposed = _features(module)
        dims = ((TENSOR,), ()) if self.transposed else ((), (TENSOR,))
        self.weight = shard_parameter(module.weight, ShardSpec(tuple(module.weight.shape), dims), ctx)
        self.bias = module.bias

    def forward(self, x: torch.Tensor, adapter: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """``adapter``: a further partial product of this rank's (valid) input columns, summed
        with the base's by the same all-reduce (``tessera.lora.routing``'s served adapters)."""
        group = self.ctx.group(TENSOR)
        weight = self.weight.t() if self.transposed else self.weight
        _, valid = local_range(self.in_features, group.size, group.rank)
        return row_parallel_linear(
            x, weight, self.bias, group, valid_in=valid, sequence_parallel=self.sequence_parallel, adapter=adapter
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, conv1d={self.transposed}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class VocabEmbedding(nn.Module):
    """``module`` (an ``nn.Embedding``) split on the vocabulary; ``[...] -> [..., D]`` whole."""

    def __init__(self, module: Any, *, ctx: ParallelContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.num_embeddings, self.embedding_dim = module.num_embeddings, module.embedding_dim
        self.padding_idx = module.padding_idx
        spec = ShardSpec((self.num_embeddings, self.embedding_dim), ((TENSOR,), ()))
        self.weight = shard_parameter(module.weight, spec, ctx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        group = self.ctx.group(TENSOR)
        start, _ = local_range(self.num_embeddings, group.size, group.rank)
        return vocab_parallel_embedding(ids, self.weight, group, start, self.padding_idx)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, vocabulary split"


class VocabHead(nn.Module):
    """The output projection ``module`` (Linear, weight ``[V, D]``) split on the vocabulary, or,
    for a head tied to the input embedding, that embedding's split weight (``tied``); logits
    gathered whole, ``[..., D] -> [..., V]``."""

    def __init__(self, module: Any, *, ctx: ParallelContext, tied: nn.Parameter | None = None) -> None:
        super().__init__()
        self.ctx = ctx
        self.in_features, self.out_features = module.in_features, module.out_features
        spec = ShardSpec((self.out_features, self.in_features), ((TENSOR,), ()))
        self.weight = tied if tied is not None else shard_parameter(module.weight, spec, ctx)
        self.bias: nn.Parameter | None = None
        if module.bias is not None:
            self.bias = shard_parameter(module.bias, ShardSpec((self.out_features,), ((TENSOR,),)), ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.ctx.group(TENSOR)
        return gather_last_dim(column_parallel_linear(x, self.weight, self.bias, group), group, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, vocabulary split, gathered"


class SequenceParallelNorm(nn.Module):
    """A norm module (LayerNorm, RMSNorm: any module with replicated parameters applied per
    token) run on this rank's part of the sequence: the parameters enter through an identity
    whose backward sums their gradients over the tensor group, so each rank's ``.grad`` is the
    gradient of the whole sequence. Keeps the wrapped module's parameter names (``norm.weight``
    stays ``norm.weight``: the wrapped module's own parameters are registered here)."""

    def __init__(self, module: nn.Module, *, ctx: ParallelContext) -> None:
        super().__init__()
        self.inner: nn.Module
        object.__setattr__(self, "inner", module)  # not a submodule: its parameters are ours
        self.ctx = ctx
        for name, param in module.named_parameters(recurse=False):
            self.register_parameter(name, param)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        group = self.ctx.group(TENSOR)
        params = {n: comm.copy_forward_all_reduce_backward(p, group) for n, p in self.named_parameters()}
        return functional_call(self.inner, params, (x, *args), kwargs)

    def extra_repr(self) -> str:
        return f"{type(self.inner).__name__}, sequence parallel"


# ---- hooks on the model's own modules ------------------------------------------------------


def _hidden_argument(args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> tuple[torch.Tensor, bool]:
    if args:
        return args[0], True
    if name in kwargs:
        return kwargs[name], False
    raise TypeError(f"expected the hidden states as the first argument or as {name}=")


def _on_input(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], name: str = "hidden_states") -> None:
    """Apply ``fn`` to ``module``'s hidden-state input (first positional argument or ``name=``)."""

    def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        x, positional = _hidden_argument(args, kwargs, name)
        if positional:
            return (fn(x), *args[1:]), kwargs
        return args, {**kwargs, name: fn(x)}

    module.register_forward_pre_hook(hook, with_kwargs=True)


def region(module: nn.Module, ctx: ParallelContext, sequence_parallel: bool) -> None:
    """Make ``module`` (an attention or MLP block whose projections are Column -> Row) a
    tensor-parallel region: its input enters through :func:`enter_region`."""
    _on_input(module, lambda x: enter_region(x, ctx, sequence_parallel))


def split_sequence_before(module: nn.Module, ctx: ParallelContext) -> None:
    """Sequence parallelism starts at ``module``'s input: ``[b, s, h]`` (replicated) -> this rank's
    ``[b, s/P, h]``; the backward gathers the parts' gradients."""
    group = ctx.group(TENSOR)

    def split(x: torch.Tensor) -> torch.Tensor:
        if x.shape[SEQ_DIM] % group.size:
            raise ValueError(
                f"sequence parallelism: the sequence length {x.shape[SEQ_DIM]} is not divisible by the tensor "
                f"size {group.size}"
            )
        return comm.split_forward_gather_backward(x, group, dim=SEQ_DIM)

    _on_input(module, split)


def gather_sequence_after(module: nn.Module, ctx: ParallelContext) -> None:
    """Sequence parallelism ends at ``module``'s output: this rank's ``[b, s/P, h]`` -> ``[b, s, h]``."""
    group = ctx.group(TENSOR)

    def hook(_: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return comm.gather_forward_split_backward(out, group, dim=SEQ_DIM)

    module.register_forward_hook(hook)
