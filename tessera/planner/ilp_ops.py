"""The operator-level planner's vocabulary: layouts of a tensor over the ranks of one axis, the
strategies an operator may take, and the operators it knows (:func:`classify`); the rules that
give each kind of operator its candidate strategies are :mod:`tessera.planner.ilp_rules`.

A tensor of a graph is held, over the ``n`` ranks of the tensor axis, as :data:`REPLICATED` (every
rank the whole tensor), ``Shard(d)`` (each rank its ``1/n`` block of dimension ``d``) or
:data:`PARTIAL` (each rank a full-shaped addend: the tensor is their sum). The gradient of a tensor
has the dual layout: a shard's gradient is the same shard, a partial sum's gradient is replicated
(each addend feeds the sum with weight one), and a replicated tensor's gradient is replicated
unless its consumer splits the work among the ranks (a column-parallel Linear: each rank's input
gradient is a partial sum), which :class:`Need` records with ``partial_grad``.

A :class:`Strategy` says what one operator needs of each tensor input, what its output is, and its
cost on one rank: floating-point operations (forward and backward), parameter bytes and the
parameter-gradient all-reduce that splitting the batch needs.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import fx, nn

from tessera.errors import TesseraError


class UnsupportedOperatorError(TesseraError, ValueError):
    """The operator-level planner cannot shard a model: it does not trace, or a node runs an
    operator without strategies (the message names the node and its target)."""


@dataclass(frozen=True, order=True)
class Sharding:
    """How a tensor is held over the axis: "R" replicated, "S" split on ``dim``, "P" partial sums."""

    kind: Literal["R", "S", "P"]
    dim: int = -1

    def __str__(self) -> str:
        return f"S({self.dim})" if self.kind == "S" else self.kind


REPLICATED = Sharding("R")
PARTIAL = Sharding("P")


def Shard(dim: int) -> Sharding:
    return Sharding("S", dim)


@dataclass(frozen=True, order=True)
class Need:
    """What a consumer needs of one input: its ``layout``, and (replicated inputs only) whether the
    gradient the consumer sends back is a partial sum because it splits the work."""

    layout: Sharding
    partial_grad: bool = False

    def __str__(self) -> str:
        return f"{self.layout}*" if self.partial_grad else str(self.layout)


@dataclass(frozen=True)
class Strategy:
    """One way to run a node: ``inputs`` (one :class:`Need` per distinct tensor input, in the
    node's order), ``output``; per rank: ``flops`` (forward + backward), ``param_bytes`` and
    ``grad_all_reduce`` (bytes of each parameter gradient summed over the axis in the backward)."""

    name: str
    output: Sharding
    inputs: tuple[Need, ...]
    flops: float = 0.0
    param_bytes: float = 0.0
    grad_all_reduce: tuple[int, ...] = ()


Shape = tuple[int, ...]


@dataclass
class OpNode:
    """A tensor-valued node of the graph with its inputs' and output's shapes and strategies.
    ``kind`` names the rule that made the strategies (apply reads it); ``shape`` is the output's
    (a tuple output, from chunk or split: the first piece's, and ``is_tuple`` is set)."""

    node: fx.Node
    kind: str
    inputs: list[fx.Node]
    shape: Shape
    dtype: torch.dtype
    needs_grad: bool
    is_tuple: bool = False
    strategies: list[Strategy] | None = None

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


# ---- tables of supported targets --------------------------------------------------------------

_NONLINEAR_FUNCTIONS: set[Any] = {F.gelu, F.relu, F.silu, F.tanh, F.sigmoid, torch.relu, torch.tanh, torch.sigmoid}
_NONLINEAR_FUNCTIONS |= {torch.exp, torch.rsqrt, torch.sqrt, F.softplus}
_NONLINEAR_METHODS = {"relu", "tanh", "sigmoid", "exp", "rsqrt", "sqrt"}
_NONLINEAR_MODULES: tuple[type[nn.Module], ...] = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid)
_LINEAR_FUNCTIONS: set[Any] = {operator.neg, torch.neg}
_LINEAR_METHODS = {"contiguous", "neg", "clone"}
_BINARY: dict[Any, str] = {
    operator.add: "add",
    operator.sub: "add",
    torch.add: "add",
    torch.sub: "add",
    operator.mul: "mul",
    torch.mul: "mul",
    operator.truediv: "div",
    torch.div: "div",
}
_BINARY_METHODS = {"add": "add", "sub": "add", "mul": "mul", "div": "div"}
_MATMUL_FUNCTIONS: set[Any] = {operator.matmul, torch.matmul, torch.bmm}
_SOFTMAX_FUNCTIONS: set[Any] = {F.softmax, F.log_softmax, torch.softmax, torch.log_softmax}
_VIEW_METHODS = {"view", "reshape", "flatten"}
_VIEW_FUNCTIONS: set[Any] = {torch.reshape, torch.flatten}
_SPLIT_TARGETS: set[Any] = {torch.chunk, torch.split}
_REDUCE_TARGETS: set[Any] = {torch.sum, torch.mean}
SIZE_QUERIES = {"size", "dim"}  # methods on a tensor that give plain values


def describe_target(node: fx.Node) -> str:
    """``node``'s operator as a reader knows it: ``F.gelu``, ``.view``, ``nn.Linear``."""
    if node.op == "call_method":
        return f".{node.target}"
    if node.op == "call_module":
        sub = node.graph.owning_module.get_submodule(str(node.target)) if node.graph.owning_module else None
        return f"{type(sub).__name__}" if sub is not None else str(node.target)
    if node.op == "call_function":
        target: Any = node.target
        return getattr(target, "__name__", str(target))
    return node.op


# ---- layout helpers ---------------------------------------------------------------------------


def shardable(shape: Sequence[int], dim: int, n: int) -> bool:
    return 0 <= dim < len(shape) and shape[dim] >= n and shape[dim] % n == 0


def layouts_of(shape: Sequence[int], n: int, *, partial: bool) -> list[Sharding]:
    """Every layout a tensor of ``shape`` may take: replicated, each dimension that divides, and
    (for operators linear in this input) partial sums."""
    out = [REPLICATED] + [Shard(d) for d in range(len(shape)) if shardable(shape, d, n)]
    return [*out, PARTIAL] if partial else out


def reshape_dim(in_shape: Shape, out_shape: Shape, dim: int, n: int) -> int | None:
    """Where a split of ``in_shape``'s dimension ``dim`` lands after a row-major reshape to
    ``out_shape``, or None when the split is not a split of one output dimension.

    A reshape groups input and output dimensions into runs of equal product. A split of the run's
    leading input dimension (size-1 dimensions aside) is a split of the run's flat index into ``n``
    contiguous blocks, which is a split of the run's leading output dimension when ``n`` divides
    it; a split of any other dimension of the run interleaves and is no output dimension's split.
    """
    if not shardable(in_shape, dim, n) or 0 in in_shape:
        return None
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        run_in, run_out = [i], [j]
        a = in_shape[i] if i < len(in_shape) else 1
        b = out_shape[j] if j < len(out_shape) else 1
        while a != b:
            if a < b:
                i += 1
                a *= in_shape[i]
                run_in.append(i)
            else:
                j += 1
                b *= out_shape[j]
                run_out.append(j)
        i, j = i + 1, j + 1
        if dim in run_in:
            lead_in = next((d for d in run_in if d < len(in_shape) and in_shape[d] != 1), None)
            lead_out = next((d for d in run_out if d < len(out_shape) and out_shape[d] != 1), None)
            if lead_in != dim or lead_out is None or not shardable(out_shape, lead_out, n):
                return None
            return lead_out
    return None


# ---- argument access --------------------------------------------------------------------------


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``index`` (counting the tensor a method is called on) or keyword ``name``."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def classify(node: fx.Node, gm: fx.GraphModule) -> str | None:
    """The rule for a tensor-valued node, or None when no rule knows its operator."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if isinstance(mod, nn.Linear):
            return "linear"
        if isinstance(mod, nn.LayerNorm):
            return "layer_norm"
        if isinstance(mod, _NONLINEAR_MODULES):
            return "nonlinear"
        if isinstance(mod, nn.Identity) or (isinstance(mod, nn.Dropout) and mod.p == 0):
            return "linear_unary"
        if isinstance(mod, (nn.Softmax, nn.LogSoftmax)):
            return "softmax"
        return None
    target: Any = node.target
    if node.op == "call_method":
        table = {**{m: "nonlinear" for m in _NONLINEAR_METHODS}, **{m: "linear_unary" for m in _LINEAR_METHODS}}
        table |= {m: "binary" for m in _BINARY_METHODS} | {"matmul": "matmul", "bmm": "matmul"}
        table |= {m: "view" for m in _VIEW_METHODS} | {"transpose": "permute", "permute": "permute"}
        table |= {"chunk": "split", "split": "split", "sum": "reduce", "mean": "reduce"}
        table |= {"softmax": "softmax", "log_softmax": "softmax", "pow": "pow"}
        return table.get(target)
    if node.op != "call_function":
        return None
    if target in _NONLINEAR_FUNCTIONS:
        return "nonlinear"
    if target in _LINEAR_FUNCTIONS:
        return "linear_unary"
    checks: list[tuple[set[Any] | dict[Any, str], str]] = [
        (_BINARY, "binary"),
        (_MATMUL_FUNCTIONS, "matmul"),
        (_SOFTMAX_FUNCTIONS, "softmax"),
        (_VIEW_FUNCTIONS, "view"),
        ({torch.transpose, torch.permute}, "permute"),
        (_SPLIT_TARGETS, "split"),
        (_REDUCE_TARGETS, "reduce"),
        ({F.scaled_dot_product_attention}, "sdpa"),
        ({F.mse_loss}, "mse_loss"),
        ({operator.pow, torch.pow}, "pow"),
        ({operator.getitem}, "getitem"),
    ]
    for targets, kind in checks:
        if target in targets:
            return kind
    return None


def binary_kind(node: fx.Node) -> str:
    target: Any = node.target
    return _BINARY_METHODS[str(target)] if node.op == "call_method" else _BINARY[target]
