"""The operator-level planner's rules: for each kind of operator of a traced graph
(:func:`tessera.planner.ilp_ops.classify`), its candidate sharding strategies over the ranks of
one axis (:class:`Rules`, :func:`strategies_for`), in the vocabulary of
:mod:`tessera.planner.ilp_ops`: what each strategy needs of every tensor input, what its output
is, and its cost on one rank."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from tessera.planner.ilp_ops import (
    PARTIAL,
    REPLICATED,
    Need,
    OpNode,
    Shape,
    Shard,
    Sharding,
    Strategy,
    UnsupportedOperatorError,
    arg,
    binary_kind,
    layouts_of,
    reshape_dim,
    shardable,
)


def _normalize(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


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
