"""Tracing a model for the operator-level planner: ``torch.fx.symbolic_trace``, shapes propagated
from example inputs, and every tensor-valued node given its kind and its candidate strategies
(:mod:`tessera.planner.ilp_rules`), or an :class:`~tessera.planner.ilp_ops.UnsupportedOperatorError`
naming the node that the planner cannot shard."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

from tessera.planner.ilp_ops import SIZE_QUERIES, OpNode, Shape, UnsupportedOperatorError, classify, describe_target
from tessera.planner.ilp_rules import Rules, strategies_for


def _tensor_meta(node: fx.Node) -> TensorMetadata | tuple[TensorMetadata, ...] | None:
    meta = node.meta.get("tensor_meta")
    if isinstance(meta, TensorMetadata):
        return meta
    if isinstance(meta, (tuple, list)) and meta and all(isinstance(m, TensorMetadata) for m in meta):
        return tuple(meta)
    return None


def is_size_query(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in SIZE_QUERIES
    return node.op == "call_function" and node.target is getattr and node.args[1] in ("shape", "ndim", "dtype")


def trace_operators(
    module: nn.Module, example_inputs: Sequence[torch.Tensor], tensor_size: int
) -> tuple[fx.GraphModule, list[OpNode]]:
    """Trace ``module``, propagate ``example_inputs``' shapes (meta tensors with a meta module plan
    a large model without memory) and give every tensor-valued node its strategies."""
    try:
        gm = fx.symbolic_trace(module)
    except Exception as exc:  # fx raises many kinds (TraceError, TypeError on Proxy control flow)
        raise UnsupportedOperatorError(
            f"cannot trace {type(module).__name__} with torch.fx.symbolic_trace ({type(exc).__name__}: {exc}); "
            "the operator-level planner needs a model without data-dependent control flow"
        ) from exc
    try:
        ShapeProp(gm).propagate(*example_inputs)
    except Exception as exc:
        raise UnsupportedOperatorError(f"shapes of {type(module).__name__} could not be propagated: {exc}") from exc

    def shape_of(node: fx.Node) -> Shape:
        meta = _tensor_meta(node)
        assert meta is not None, node.name
        return tuple((meta if isinstance(meta, TensorMetadata) else meta[0]).shape)

    rules = Rules(gm, tensor_size, shape_of)
    ops: dict[fx.Node, OpNode] = {}
    module_calls: dict[str, str] = {}
    for node in gm.graph.nodes:
        meta = _tensor_meta(node)
        tensor_inputs = [i for i in node.all_input_nodes if i in ops]
        if node.op == "output":
            kind = "output"
        elif meta is None:
            if tensor_inputs and not is_size_query(node):
                raise UnsupportedOperatorError(
                    f"node '{node.name}' ({describe_target(node)}) turns a tensor into a plain value; "
                    "only .shape, .size() and .dim() are supported"
                )
            continue  # shapes, numbers: not sharded
        elif node.op in ("placeholder", "get_attr"):
            kind = "input" if node.op == "placeholder" else "constant"
        else:
            kind = _kind(node, gm, ops, module_calls)
        is_tuple = meta is not None and not isinstance(meta, TensorMetadata)
        metas: tuple[TensorMetadata | None, ...] = meta if is_tuple else (meta,)  # type: ignore[assignment]
        first = metas[0]
        op = OpNode(
            node,
            kind,
            tensor_inputs,
            shape=tuple(first.shape) if first is not None else (),
            dtype=first.dtype if first is not None else torch.float32,
            needs_grad=any(m is not None and m.requires_grad for m in metas),
            is_tuple=is_tuple and kind != "output",
        )
        op.strategies = strategies_for(rules, op)
        if kind == "constant":
            attr = _get_attr(gm, str(node.target))
            nbytes = attr.numel() * attr.element_size() if isinstance(attr, nn.Parameter) else 0
            op.strategies = [replace(s, param_bytes=nbytes) for s in op.strategies]
        if not op.strategies:
            raise UnsupportedOperatorError(
                f"node '{node.name}' ({describe_target(node)}) has no strategy over {tensor_size} ranks"
            )
        ops[node] = op
    return gm, list(ops.values())


def _get_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _kind(node: fx.Node, gm: fx.GraphModule, ops: dict[fx.Node, OpNode], module_calls: dict[str, str]) -> str:
    kind = classify(node, gm)
    if kind is None:
        raise UnsupportedOperatorError(
            f"node '{node.name}' runs {describe_target(node)}, which the operator-level planner has no "
            "strategies for (supported: nn.Linear, nn.LayerNorm, activations, softmax, "
            "scaled_dot_product_attention, matmul, add/sub/mul/div, view/reshape/flatten/transpose/permute, "
            "chunk/split, sum/mean, mse_loss)"
        )
    if kind == "getitem":
        src = node.args[0]
        if not (isinstance(src, fx.Node) and src in ops and ops[src].is_tuple):
            raise UnsupportedOperatorError(f"node '{node.name}' indexes a tensor; slicing is not supported")
    elif not isinstance(_tensor_meta(node), TensorMetadata) and kind != "split":
        raise UnsupportedOperatorError(f"node '{node.name}' ({describe_target(node)}) returns several tensors")
    if node.op == "call_module" and any(True for _ in gm.get_submodule(str(node.target)).parameters()):
        first = module_calls.setdefault(str(node.target), node.name)
        if first != node.name:
            raise UnsupportedOperatorError(
                f"module '{node.target}' is called by nodes '{first}' and '{node.name}'; "
                "the operator-level planner needs each module with parameters called once"
            )
    return kind


def target_name(node: fx.Node) -> str:
    target: Any = node.target
    if isinstance(target, str):
        return target
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
