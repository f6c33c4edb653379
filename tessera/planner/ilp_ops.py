"""The operator-level planner's vocabulary: layouts of a tensor over the ranks of one axis, and for
every supported operator of a traced graph its candidate sharding strategies.

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
from collections.abc import Callable, Sequence
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


def _normalize(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


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


def _needs_for(node: fx.Node, inputs: list[fx.Node], pairs: list[tuple[fx.Node, Need]]) -> tuple[Need, ...] | None:
    """One need per distinct input, or None when one input is asked for in two ways."""
    got: dict[fx.Node, Need] = {}
    for src, need in pairs:
        if got.setdefault(src, need) != need:
            return None
    missing = [i.name for i in inputs if i not in got]
    if missing:
        raise UnsupportedOperatorError(f"node '{node.name}': tensor argument(s) {missing} where no rule expects one")
    return tuple(got[i] for i in inputs)


# ---- strategies per kind ----------------------------------------------------------------------


class Rules:
    """Builds the strategies of each node for an axis of ``n`` ranks; ``shape_of`` gives a tensor
    node's shape (a tuple's first piece)."""

    def __init__(self, gm: fx.GraphModule, n: int, shape_of: Callable[[fx.Node], Shape]) -> None:
        self.gm, self.n, self.shape_of = gm, n, shape_of

    def unary(self, out: Shape, partial: bool, inputs: list[fx.Node]) -> list[Strategy]:
        return [Strategy(str(lay), lay, (Need(lay),) * len(inputs)) for lay in layouts_of(out, self.n, partial=partial)]

    def binary(self, node: fx.Node, kind: str, out: Shape, inputs: list[fx.Node]) -> list[Strategy]:
        """add/sub, mul, div with broadcasting: a split output splits each operand on the aligned
        dimension, or needs a broadcast operand whole (its gradient then a partial sum)."""
        operands = [a for a in node.args[:2]]
        tensors = [a for a in operands if isinstance(a, fx.Node) and a in inputs]
        scalars = len(operands) - len(tensors)
        out_rank = len(out)
        result: list[Strategy] = []
        for lay in layouts_of(out, self.n, partial=True):
            pairs: list[tuple[fx.Node, Need]] = []
            if lay.kind == "R":
                pairs = [(t, Need(REPLICATED)) for t in tensors]
            elif lay.kind == "S":
                for t in tensors:
                    shape = self.shape_of(t)
                    d = lay.dim - (out_rank - len(shape))
                    split = d >= 0 and shape[d] == out[lay.dim]
                    pairs.append((t, Need(Shard(d)) if split else Need(REPLICATED, partial_grad=True)))
            elif kind == "add":  # a partial sum plus a number would count the number n times
                if scalars:
                    continue
                pairs = [(t, Need(PARTIAL)) for t in tensors]
            else:  # mul / div are linear in one factor: that one partial, the other whole
                firsts = [0] if kind == "div" or len(tensors) == 1 else [0, 1]
                for first in firsts:
                    pick = [(t, Need(PARTIAL) if k == first else Need(REPLICATED, True)) for k, t in enumerate(tensors)]
                    needs = _needs_for(node, inputs, pick)
                    if needs is not None and (kind == "mul" or operands[0] is tensors[first]):
                        result.append(Strategy(f"P{first}", PARTIAL, needs))
                continue
            needs = _needs_for(node, inputs, pairs)
            if needs is not None:
                result.append(Strategy(str(lay), lay, needs))
        return result

    def linear(self, node: fx.Node, out: Shape, inputs: list[fx.Node]) -> list[Strategy]:
        """nn.Linear: whole, column (weight rows split), row (weight columns split: output partial)
        or a split of a leading dimension with the weight whole (gradient all-reduced)."""
        mod = self.gm.get_submodule(str(node.target))
        assert isinstance(mod, nn.Linear)
        x_shape, n = self.shape_of(inputs[0]), self.n
        tokens = math.prod(x_shape[:-1])
        flops = 6.0 * tokens * mod.in_features * mod.out_features
        w_bytes = mod.weight.numel() * mod.weight.element_size()
        b_bytes = 0 if mod.bias is None else mod.bias.numel() * mod.bias.element_size()
        grads = tuple(p.numel() * p.element_size() for p in mod.parameters() if p.requires_grad)
        last = len(x_shape) - 1
        result = [Strategy("replicate", REPLICATED, (Need(REPLICATED),), flops, w_bytes + b_bytes)]
        if mod.out_features % n == 0:
            column = Strategy("column", Shard(last), (Need(REPLICATED, True),), flops / n, (w_bytes + b_bytes) / n)
            result.append(column)
        if mod.in_features % n == 0:
            result.append(Strategy("row", PARTIAL, (Need(Shard(last)),), flops / n, w_bytes / n + b_bytes))
        for d in range(last):
            if shardable(x_shape, d, n):
                split = Strategy(f"split({d})", Shard(d), (Need(Shard(d)),), flops / n, w_bytes + b_bytes, grads)
                result.append(split)
        return result

    def layer_norm(self, node: fx.Node, inputs: list[fx.Node]) -> list[Strategy]:
        mod = self.gm.get_submodule(str(node.target))
        assert isinstance(mod, nn.LayerNorm)
        shape = self.shape_of(inputs[0])
        p_bytes = sum(p.numel() * p.element_size() for p in mod.parameters())
        grads = tuple(p.numel() * p.element_size() for p in mod.parameters() if p.requires_grad)
        out = [Strategy("replicate", REPLICATED, (Need(REPLICATED),), 0.0, p_bytes)]
        for d in range(len(shape) - len(mod.normalized_shape)):
            if shardable(shape, d, self.n):
                out.append(Strategy(f"split({d})", Shard(d), (Need(Shard(d)),), 0.0, p_bytes, grads))
        return out

    def matmul(self, node: fx.Node, out: Shape, inputs: list[fx.Node]) -> list[Strategy]:
        """A @ B of equal rank >= 2 (no broadcast batch): split a batch dimension of both, A's rows
        (B whole), B's columns (A whole), or the inner dimension (output partial)."""
        a, b = node.args[0], node.args[1]
        assert isinstance(a, fx.Node) and isinstance(b, fx.Node)
        sa, sb = self.shape_of(a), self.shape_of(b)
        inner = sa[-1]
        flops = 6.0 * math.prod(out) * inner  # each output element is an inner product
        options: list[tuple[str, Sharding, Need, Need, float]] = [
            ("R", REPLICATED, Need(REPLICATED), Need(REPLICATED), 1)
        ]
        n, r = self.n, len(sa)
        if len(sa) == len(sb) >= 2 and sa[:-2] == sb[:-2]:
            for d in range(r - 2):
                if shardable(sa, d, n):
                    options.append((f"S({d})", Shard(d), Need(Shard(d)), Need(Shard(d)), n))
            if shardable(sa, r - 2, n):
                options.append(("rows", Shard(r - 2), Need(Shard(r - 2)), Need(REPLICATED, True), n))
            if shardable(sb, r - 1, n):
                options.append(("columns", Shard(r - 1), Need(REPLICATED, True), Need(Shard(r - 1)), n))
            if shardable(sa, r - 1, n):
                options.append(("inner", PARTIAL, Need(Shard(r - 1)), Need(Shard(r - 2)), n))
        result = []
        for name, lay, need_a, need_b, parts in options:
            needs = _needs_for(node, inputs, [(a, need_a), (b, need_b)])
            if needs is not None:
                result.append(Strategy(name, lay, needs, flops / parts))
        return result

    def sdpa(self, node: fx.Node, out: Shape, inputs: list[fx.Node]) -> list[Strategy]:
        """scaled_dot_product_attention: whole, or split on a batch or head dimension of q, k, v
        alike (a mask must be broadcast along it)."""
        if arg(node, 4, "dropout_p", 0.0) or node.kwargs.get("enable_gqa", False):
            raise UnsupportedOperatorError(
                f"node '{node.name}' (scaled_dot_product_attention): dropout_p > 0 and enable_gqa are not supported"
            )
        q, k, v = node.args[:3]
        mask = arg(node, 3, "attn_mask")
        assert isinstance(q, fx.Node) and isinstance(k, fx.Node) and isinstance(v, fx.Node)
        sq, sk, sv = self.shape_of(q), self.shape_of(k), self.shape_of(v)
        causal = 0.5 if arg(node, 5, "is_causal", False) else 1.0
        flops = 3.0 * causal * math.prod(sq[:-2]) * sq[-2] * sk[-2] * 2 * (sq[-1] + sv[-1])
        options = [("replicate", REPLICATED, 1)] + [
            (f"split({d})", Shard(d), self.n)
            for d in range(len(sq) - 2)
            if shardable(sq, d, self.n) and sq[d] == sk[d] == sv[d]
        ]
        result = []
        for name, lay, parts in options:
            pairs = [(q, Need(lay)), (k, Need(lay)), (v, Need(lay))]
            if isinstance(mask, fx.Node):
                sm = self.shape_of(mask)
                d = lay.dim - (len(sq) - len(sm))
                if lay.kind == "S" and d >= 0 and sm[d] != 1:
                    continue
                pairs.append((mask, Need(REPLICATED, partial_grad=lay.kind == "S")))
            needs = _needs_for(node, inputs, pairs)
            if needs is not None:
                result.append(Strategy(name, lay, needs, flops / parts))
        return result

    def softmax(self, node: fx.Node, out: Shape, inputs: list[fx.Node]) -> list[Strategy]:
        if node.op == "call_module":
            dim = getattr(self.gm.get_submodule(str(node.target)), "dim", None)
        else:
            dim = arg(node, 1, "dim")
        if dim is None:
            raise UnsupportedOperatorError(f"node '{node.name}': softmax needs an explicit dim")
        dim = _normalize(dim, len(out))
        return [s for s in self.unary(out, False, inputs) if s.output.dim != dim]

    def view(self, node: fx.Node, out: Shape, inputs: list[fx.Node]) -> list[Strategy]:
        src = self.shape_of(inputs[0])
        result = [Strategy("R", REPLICATED, (Need(REPLICATED),)), Strategy("P", PARTIAL, (Need(PARTIAL),))]
        for d in range(len(src)):
            if shardable(src, d, self.n):
                to = reshape_dim(src, out, d, self.n)
                if to is not None:
                    result.append(Strategy(f"S({d})->S({to})", Shard(to), (Need(Shard(d)),)))
        return result

    def permute(self, node: fx.Node, out: Shape, inputs: list[fx.Node]) -> list[Strategy]:
        rank = len(out)
        if node.target in ("transpose", torch.transpose):
            a, b = _normalize(arg(node, 1, "dim0"), rank), _normalize(arg(node, 2, "dim1"), rank)
            order = list(range(rank))
            order[a], order[b] = b, a
        else:
            dims: Any = node.args[1:] if node.target == "permute" else arg(node, 1, "dims")
            if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
                dims = dims[0]
            order = [_normalize(int(d), rank) for d in dims]
        result = [Strategy("R", REPLICATED, (Need(REPLICATED),)), Strategy("P", PARTIAL, (Need(PARTIAL),))]
        for to, d in enumerate(order):
            if shardable(out, to, self.n):
                result.append(Strategy(f"S({d})->S({to})", Shard(to), (Need(Shard(d)),)))
        return result

    def split(self, node: fx.Node, out: Shape, inputs: list[fx.Node]) -> list[Strategy]:
        src = self.shape_of(inputs[0])
        dim = _normalize(arg(node, 2, "dim", 0), len(src))
        lays = [lay for lay in layouts_of(src, self.n, partial=True) if lay.dim != dim]
        return [Strategy(str(lay), lay, (Need(lay),)) for lay in lays]

    def reduce(self, node: fx.Node, out: Shape, inputs: list[fx.Node]) -> list[Strategy]:
        """sum / mean over ``dim`` (None: every dimension): a split of a reduced dimension makes
        partial sums (a mean's local part is scaled by 1/n when applied)."""
        src = self.shape_of(inputs[0])
        dims = arg(node, 1, "dim")
        keep = bool(arg(node, 2, "keepdim", False))
        reduced = set(range(len(src))) if dims is None else {_normalize(d, len(src)) for d in _as_tuple(dims)}
        result = [Strategy("R", REPLICATED, (Need(REPLICATED),)), Strategy("P", PARTIAL, (Need(PARTIAL),))]
        for d in range(len(src)):
            if not shardable(src, d, self.n):
                continue
            if d in reduced:
                result.append(Strategy(f"S({d})->P", PARTIAL, (Need(Shard(d)),)))
            else:
                to = d if keep else d - sum(1 for r in reduced if r < d)
                result.append(Strategy(f"S({d})", Shard(to), (Need(Shard(d)),)))
        return result

    def mse_loss(self, node: fx.Node, out: Shape, inputs: list[fx.Node]) -> list[Strategy]:
        a, b = node.args[0], node.args[1]
        reduction = arg(node, 4, "reduction", "mean")
        if not isinstance(a, fx.Node) or not isinstance(b, fx.Node):
            raise UnsupportedOperatorError(f"node '{node.name}': mse_loss needs two tensors")
        sa = self.shape_of(a)
        result = [Strategy("R", REPLICATED, tuple(Need(REPLICATED) for _ in inputs))]
        if sa != self.shape_of(b):
            return result
        for d in range(len(sa)):
            if shardable(sa, d, self.n):
                lay = Shard(d) if reduction == "none" else PARTIAL
                result.append(Strategy(f"S({d})", lay, tuple(Need(Shard(d)) for _ in inputs)))
        return result


def _as_tuple(dims: Any) -> tuple[int, ...]:
    return tuple(dims) if isinstance(dims, (tuple, list)) else (int(dims),)


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


def strategies_for(rules: Rules, op: OpNode) -> list[Strategy]:
    """The candidate strategies of ``op`` (raises for an operator without a rule)."""
    node, out, ins = op.node, op.shape, op.inputs
    if op.kind in ("input", "constant"):
        return [Strategy(op.kind, REPLICATED, ())]
    if op.kind == "output":
        return [Strategy("output", REPLICATED, tuple(Need(REPLICATED) for _ in ins))]
    if op.kind == "nonlinear":
        return rules.unary(out, False, ins)
    if op.kind == "pow":
        if isinstance(arg(node, 1, "exponent"), fx.Node):
            raise UnsupportedOperatorError(f"node '{node.name}': pow with a tensor exponent is not supported")
        return rules.unary(out, False, ins)
    if op.kind == "linear_unary":
        return rules.unary(out, True, ins)
    if op.kind == "getitem":  # a piece of a chunk/split: its producer's layout, which it cannot convert
        return rules.unary(out, True, ins)
    if op.kind == "binary":
        if node.kwargs.get("alpha", 1) != 1 or node.kwargs.get("rounding_mode") is not None:
            raise UnsupportedOperatorError(f"node '{node.name}': alpha= and rounding_mode= are not supported")
        return rules.binary(node, binary_kind(node), out, ins)
    build: dict[str, Callable[[fx.Node, Shape, list[fx.Node]], list[Strategy]]] = {
        "linear": rules.linear,
        "matmul": rules.matmul,
        "sdpa": rules.sdpa,
        "softmax": rules.softmax,
        "view": rules.view,
        "permute": rules.permute,
        "split": rules.split,
        "reduce": rules.reduce,
        "mse_loss": rules.mse_loss,
    }
    if op.kind == "layer_norm":
        return rules.layer_norm(node, ins)
    return build[op.kind](node, out, ins)
