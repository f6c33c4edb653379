"""A chunk's backward split in two without repeated work: the input gradient now (zero-bubble B),
the weight gradients later (W).

B runs the autograd graph from the chunk's output to its input only, so it skips every weight
gradient. On the way it keeps the gradient arriving at each *intermediate*: a node on the path
from output to input that also leads, off that path, to a parameter (a ``Linear``'s ``addmm``,
a ``LayerNorm``). W starts from those nodes with the kept gradients and walks only the branches
to the parameters, so the input path is not computed again (with ``torch.autograd.backward(out,
inputs=params)`` it would be: W would cost B + W). This is the split of Qi et al. 2023 and of
``torch.distributed.pipelining``; the graph walk is a few microseconds per node, once per
micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass(eq=False)
class _ParamGroup:
    """Parameters and the intermediates their gradients flow through (off the input path)."""

    params: list[torch.Tensor]
    intermediates: list[Node]
    grads: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)


@dataclass
class WeightWork:
    """What B leaves for W: per parameter group, the gradients that reached its intermediates."""

    groups: list[_ParamGroup]


def _parents(root: Node) -> dict[Node, list[Node]]:
    """Every node reachable from ``root`` -> the nodes that feed gradient into it."""
    parents: dict[Node, list[Node]] = {root: []}
    stack = [root]
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                stack.append(child)
            parents[child].append(node)
    return parents


def _ancestors(start: Node, parents: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], list[Node]]:
    """Nodes above ``start`` (towards the output), not passing through ``stop``; and the ``stop``
    nodes met on the way, in a deterministic order (so gradients add up in the same order)."""
    seen: set[Node] = set()
    met: dict[Node, None] = {}
    stack = [start]
    while stack:
        for parent in parents.get(stack.pop(), ()):
            if parent in stop:
                met[parent] = None
            elif parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen, list(met)


def _param_groups(root: Node, x: torch.Tensor, params: Sequence[torch.Tensor]) -> list[_ParamGroup]:
    """Group ``params`` by the intermediates (nodes on the output-to-input path) their gradients
    leave that path at; parameters sharing an intermediate share a group."""
    parents = _parents(root)
    x_node = get_gradient_edge(x).node
    input_path, _ = _ancestors(x_node, parents, set())
    groups: list[_ParamGroup] = []
    owner: dict[Node, _ParamGroup] = {}
    for param in params:
        _, met = _ancestors(get_gradient_edge(param).node, parents, input_path)
        if not met:
            continue  # the output does not depend on this parameter
        joined = {id(owner[n]): owner[n] for n in met if n in owner}
        group = _ParamGroup([param], met)
        for other in joined.values():  # merge groups that share an intermediate
            group.params = other.params + group.params
            group.intermediates = list(dict.fromkeys([*other.intermediates, *group.intermediates]))
            groups.remove(other)
        for node in group.intermediates:
            owner[node] = group
        groups.append(group)
    return groups


def backward_input(
    out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor, params: Sequence[torch.Tensor]
) -> tuple[torch.Tensor | None, WeightWork]:
    """B: the gradient of ``x`` (a leaf that requires grad; ``None`` if ``out`` does not depend
    on it) from ``out`` and its gradient ``grad`` (``None`` when ``out`` is a scalar loss),
    computing no weight gradient. The graph is kept for :func:`backward_weight`; ``out`` may be
    dropped."""
    if out.grad_fn is None:
        raise RuntimeError("the chunk's output has no autograd graph")
    groups = _param_groups(out.grad_fn, x, params)
    handles = []
    for group in groups:
        for node in group.intermediates:

            def keep(
                grad_outputs: tuple[torch.Tensor | None, ...], group: _ParamGroup = group, node: Node = node
            ) -> None:
                group.grads[node] = tuple(grad_outputs)

            handles.append(node.register_prehook(keep))
    try:
        (x_grad,) = torch.autograd.grad(out, x, grad, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return x_grad, WeightWork(groups)


def backward_weight(work: WeightWork) -> None:
    """W: accumulate the parameter gradients left by :func:`backward_input` into ``.grad``."""
    for group in work.groups:
        edges: list[GradientEdge] = []
        grads: list[torch.Tensor] = []
        for node in group.intermediates:
            for k, g in enumerate(group.grads.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, k))
                    grads.append(g)
        if not edges:
            continue
        handles = []
        if len(group.intermediates) > 1:
            # One intermediate may lie above another on the way to a parameter: pin each to the
            # gradient B saw, so nothing arriving from the other is counted twice.
            for node in group.intermediates:
                saved = group.grads.get(node)
                if saved is not None:
                    handles.append(node.register_prehook(lambda _, saved=saved: saved))
        try:
            param_grads = torch.autograd.grad(edges, group.params, grads, retain_graph=True, allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        for param, g in zip(group.params, param_grads, strict=True):
            if g is None:
                continue
            if param.grad is None:
                param.grad = g
            else:
                param.grad += g
    work.groups.clear()
