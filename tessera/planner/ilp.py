"""The planner's operator-level mode: sharding choices per operator of a traced model, solved as an
integer linear program (docs/planner.md, "Operator-level mode (ILP)").

``plan_operators(module, example_inputs, tensor_size)`` traces the module with
``torch.fx.symbolic_trace``, propagates shapes, gives every tensor-valued node its candidate
strategies (:mod:`tessera.planner.ilp_ops`), and picks one per node with scipy's HiGHS: the cheapest
step (compute per rank, the collectives that convert one node's output into what its consumers
need, forward and backward, and a small charge per parameter byte held). The model's inputs are
replicated and its outputs must be. :func:`tessera.planner.ilp_apply.apply_operator_plan` then
rewrites the graph for one rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

from tessera.comm.ledger import logical_bytes
from tessera.planner.ilp_ops import (
    REPLICATED,
    SIZE_QUERIES,
    Need,
    OpNode,
    Rules,
    Shape,
    Sharding,
    Strategy,
    UnsupportedOperatorError,
    classify,
    describe_target,
    strategies_for,
)
from tessera.planner.spec import Cluster

__all__ = [
    "Collective",
    "CostModel",
    "NodeChoice",
    "OperatorPlan",
    "Reshard",
    "UnsupportedOperatorError",
    "conversion",
    "plan_operators",
    "trace_operators",
]


@dataclass(frozen=True)
class CostModel:
    """The figures the objective is made of, for one rank of the tensor axis: ``flops`` per second
    on matmuls; ``bandwidth`` (bytes/s per rank) and ``latency`` (s per call) of the axis's
    collectives; ``memory_s_per_byte``: seconds charged per byte of parameter state held
    (``state_factor`` bytes per parameter byte: value, gradient, two Adam moments), a tie-breaker
    by default (a GB of state costs 10 us); ``reshard_overhead``: seconds charged per conversion even when
    it moves nothing, so that no gratuitous one is chosen."""

    flops: float = 400e12
    bandwidth: float = 200e9
    latency: float = 10e-6
    memory_s_per_byte: float = 1e-14
    state_factor: float = 4.0
    reshard_overhead: float = 1e-9

    @classmethod
    def from_cluster(cls, cluster: Cluster, tensor_size: int, **overrides: float) -> CostModel:
        """The figures of ``cluster``: its per-axis "tensor" link when calibrated, else the link
        within a node when ``tensor_size`` ranks fit in one, else the link between nodes."""
        link = cluster.axis_links.get("tensor")
        if link is None:
            link = cluster.intra if tensor_size <= cluster.devices_per_node else cluster.inter
        base = cls(flops=cluster.flops, bandwidth=link.bandwidth, latency=link.latency)
        return replace(base, **overrides)

    def collective_s(self, op: str, payload_bytes: int, n: int) -> float:
        return self.latency + float(logical_bytes(op, payload_bytes, n)) / self.bandwidth


@dataclass(frozen=True)
class Collective:
    """One collective of the plan on each rank: ``op`` as the comm ledger names it, ``phase``
    ("forward" or "backward"), the tensor handed to it (``payload_bytes``) and the logical bytes per
    rank the ledger will count; ``where``: the node or edge it serves."""

    op: str
    phase: str
    payload_bytes: int
    logical_bytes: float
    seconds: float
    where: str


@dataclass(frozen=True)
class Reshard:
    """Node ``producer``'s output converted from ``source`` to ``need`` once for ``consumers``."""

    producer: str
    source: Sharding
    need: Need
    consumers: tuple[str, ...]
    collectives: tuple[Collective, ...]


@dataclass(frozen=True)
class NodeChoice:
    """The strategy chosen for one node, its output layout, what it needs of each input (by input
    node name), and its cost per rank: compute seconds, the parameter-gradient all-reduce's
    seconds, and bytes of parameters held."""

    name: str
    kind: str
    target: str
    strategy: str
    output: Sharding
    inputs: tuple[tuple[str, Need], ...]
    compute_s: float
    comm_s: float
    param_bytes: float


@dataclass(frozen=True)
class OperatorPlan:
    """A sharding of every tensor-valued node of a traced graph over ``tensor_size`` ranks.

    ``cost`` is the objective the solver minimised (seconds, memory charge included);
    ``compute_s`` and ``comm_s`` its parts; ``param_bytes`` per rank; ``signature`` (name, op,
    target of every node) lets :func:`apply_operator_plan` check that a module traces to the same
    graph."""

    tensor_size: int
    choices: dict[str, NodeChoice]
    reshards: tuple[Reshard, ...]
    collectives: tuple[Collective, ...]
    compute_s: float
    comm_s: float
    param_bytes: float
    cost: float
    signature: tuple[tuple[str, str, str], ...] = field(repr=False)

    def strategy(self, node: str) -> str:
        return self.choices[node].strategy

    def layout(self, node: str) -> Sharding:
        return self.choices[node].output

    def comm_bytes(self, op: str | None = None, phase: str | None = None) -> float:
        """Logical bytes per rank of one step (forward and backward), as the comm ledger counts."""
        return sum(c.logical_bytes for c in self._select(op, phase))

    def calls(self, op: str | None = None, phase: str | None = None) -> int:
        return sum(1 for _ in self._select(op, phase))

    def _select(self, op: str | None, phase: str | None) -> list[Collective]:
        return [c for c in self.collectives if (op is None or c.op == op) and (phase is None or c.phase == phase)]

    def describe(self) -> str:
        """A table of the choices (nodes that keep everything replicated and cost nothing left
        out), then every collective and the totals."""
        rows = [("node", "operator", "strategy", "output", "inputs", "compute us", "params")]
        for c in self.choices.values():
            if c.kind in ("input", "constant", "output") or (c.output == REPLICATED and not c.compute_s):
                continue
            ins = ", ".join(f"{name}:{need}" for name, need in c.inputs)
            rows.append(
                (c.name, c.target, c.strategy, str(c.output), ins, f"{c.compute_s * 1e6:.1f}", _size(c.param_bytes))
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [f"operator-level plan over {self.tensor_size} ranks (* : the input's gradient is a partial sum)"]
        lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
        lines.append("collectives per step (logical bytes per rank):")
        for col in self.collectives or ():
            lines.append(f"  {col.phase:8s} {col.op:14s} {_size(col.logical_bytes):>10s}  {col.where}")
        if not self.collectives:
            lines.append("  none")
        lines.append(
            f"total: compute {self.compute_s * 1e6:.1f} us, communication {self.comm_s * 1e6:.1f} us, "
            f"parameters {_size(self.param_bytes)} per rank, objective {self.cost * 1e6:.1f} us"
        )
        return "\n".join(lines)


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"


# ---- conversions ------------------------------------------------------------------------------


def conversion(
    source: Sharding, need: Need, nbytes: int, n: int, needs_grad: bool
) -> list[tuple[str, str, int]] | None:
    """The collectives, as ``(phase, op, payload bytes)``, that turn a producer's ``source`` layout
    into what a consumer needs, forward and (when the value needs a gradient) backward; None when
    no conversion exists. The backward converts the consumer's gradient (the dual of ``need``)
    into the producer's (the dual of ``source``): see the module docstring of ``ilp_ops``."""
    target = need.layout
    fwd: list[tuple[str, int]] = []
    bwd: list[tuple[str, int]] = []
    if source.kind == "R":
        if target.kind == "S":
            bwd = [("all_gather", nbytes)]  # split forward; the gradient's shards gathered
        elif target.kind == "R" and need.partial_grad:
            bwd = [("all_reduce", nbytes)]  # copy forward; the partial gradients summed (Megatron's f)
        # R -> P: the first rank keeps the value, the others hold zeros; the gradient stays whole
    elif source.kind == "S":
        if target.kind == "R":
            fwd = [("all_gather", nbytes)]
            bwd = [("reduce_scatter", nbytes)] if need.partial_grad else []  # else: keep the own slice
        elif target.kind == "S" and target.dim != source.dim:
            fwd = bwd = [("all_to_all", nbytes // n)]
        elif target.kind == "P":
            return None
    elif target.kind == "R":  # partial sums
        fwd = [("all_reduce", nbytes)]
        bwd = [("all_reduce", nbytes)] if need.partial_grad else []
    elif target.kind == "S":
        fwd, bwd = [("reduce_scatter", nbytes)], [("all_gather", nbytes)]
    out = [("forward", op, size) for op, size in fwd]
    return out + [("backward", op, size) for op, size in bwd] if needs_grad else out


def is_identity(source: Sharding, need: Need, needs_grad: bool) -> bool:
    """Whether a consumer can take the producer's output as it is."""
    return source == need.layout and not (source.kind == "R" and need.partial_grad and needs_grad)


# ---- tracing ----------------------------------------------------------------------------------


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


# ---- the integer program ----------------------------------------------------------------------


def _node_seconds(strategy: Strategy, costs: CostModel, n: int) -> tuple[float, float, float]:
    """Compute, parameter-gradient all-reduce and memory charge of one strategy, in seconds."""
    comm = sum(costs.collective_s("all_reduce", size, n) for size in strategy.grad_all_reduce)
    memory = costs.memory_s_per_byte * costs.state_factor * strategy.param_bytes
    return strategy.flops / costs.flops, comm, memory


def _collectives(
    source: Sharding, need: Need, producer: OpNode, n: int, costs: CostModel, where: str
) -> list[Collective] | None:
    if producer.is_tuple:  # a tuple's pieces are taken as they are
        return [] if is_identity(source, need, producer.needs_grad) else None
    steps = conversion(source, need, producer.nbytes, n, producer.needs_grad)
    if steps is None:
        return None
    return [
        Collective(op, phase, size, float(logical_bytes(op, size, n)), costs.collective_s(op, size, n), where)
        for phase, op, size in steps
    ]


def _edge_groups(ops: list[OpNode]) -> dict[tuple[int, Need], list[tuple[int, int]]]:
    """(producer, need) -> the (consumer, strategy) pairs that need the producer's output so."""
    index = {op.node: i for i, op in enumerate(ops)}
    groups: dict[tuple[int, Need], list[tuple[int, int]]] = {}
    for v, op in enumerate(ops):
        assert op.strategies is not None
        for k, src in enumerate(op.inputs):
            for t, strategy in enumerate(op.strategies):
                groups.setdefault((index[src], strategy.inputs[k]), []).append((v, t))
    return groups


def _solve(ops: list[OpNode], n: int, costs: CostModel, memory_limit: float | None) -> list[int]:
    """The chosen strategy of every node. Variables: x[v, s] binary, one strategy per node;
    y[u, s, need] >= x[u, s] + x[v, t] - 1 for each consumer strategy t needing u's output as
    ``need``, charged the conversion's time (a conversion shared by consumers counts once);
    x[u, s] + x[v, t] <= 1 where no conversion exists."""
    try:
        import numpy as np
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_array
    except ImportError as exc:
        raise ImportError("the operator-level planner solves with scipy's HiGHS: pip install scipy") from exc

    offsets: list[int] = []
    cost: list[float] = []
    for op in ops:
        assert op.strategies is not None
        offsets.append(len(cost))
        cost += [sum(_node_seconds(s, costs, n)) for s in op.strategies]
    n_x = len(cost)
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    upper: list[float] = []

    def row(entries: list[tuple[int, float]], bound: float) -> None:
        for col, val in entries:
            rows.append(len(upper))
            cols.append(col)
            vals.append(val)
        upper.append(bound)

    for (u, need), users in _edge_groups(ops).items():
        assert ops[u].strategies is not None
        for s, strategy in enumerate(ops[u].strategies or []):
            x_us = offsets[u] + s
            steps = _collectives(strategy.output, need, ops[u], n, costs, "")
            if steps is None:
                for v, t in users:
                    row([(x_us, 1.0), (offsets[v] + t, 1.0)], 1.0)
                continue
            if is_identity(strategy.output, need, ops[u].needs_grad):
                continue
            y = len(cost)
            cost.append(sum(c.seconds for c in steps) + costs.reshard_overhead)
            for v, t in users:
                row([(x_us, 1.0), (offsets[v] + t, 1.0), (y, -1.0)], 1.0)
    constraints = []
    if upper:
        pairs = coo_array((vals, (rows, cols)), shape=(len(upper), len(cost)))
        constraints.append(LinearConstraint(pairs, -np.inf, np.array(upper)))
    one = coo_array(
        ([1.0] * n_x, ([i for i, op in enumerate(ops) for _ in op.strategies or []], range(n_x))),
        shape=(len(ops), len(cost)),
    )
    constraints.append(LinearConstraint(one, 1.0, 1.0))
    if memory_limit is not None:
        held = np.zeros(len(cost))
        for i, op in enumerate(ops):
            for s, strategy in enumerate(op.strategies or []):
                held[offsets[i] + s] = strategy.param_bytes * costs.state_factor
        constraints.append(LinearConstraint(held, -np.inf, memory_limit))
    integrality = np.r_[np.ones(n_x), np.zeros(len(cost) - n_x)]
    # nanoseconds: HiGHS's absolute gap (1e-6) must be far below the smallest charge
    result = milp(
        np.array(cost) * 1e9,
        integrality=integrality,
        bounds=Bounds(0.0, 1.0),
        constraints=constraints,
        options={"mip_rel_gap": 1e-9},
    )
    if result.status == 2:
        limit = f" within memory_limit={memory_limit:.0f} bytes" if memory_limit is not None else ""
        raise UnsupportedOperatorError(f"no sharding over {n} ranks fits{limit}")
    if result.x is None:
        raise RuntimeError(f"HiGHS did not solve the operator-level plan: {result.message}")
    chosen = []
    for i, op in enumerate(ops):
        picks = result.x[offsets[i] : offsets[i] + len(op.strategies or [])]
        chosen.append(int(np.argmax(picks)))
    return chosen


def plan_operators(
    module: nn.Module,
    example_inputs: Sequence[torch.Tensor] | torch.Tensor,
    tensor_size: int,
    costs: CostModel | None = None,
    *,
    memory_limit: float | None = None,
) -> OperatorPlan:
    """Shard every operator of ``module`` over ``tensor_size`` ranks at the least predicted cost.

    ``example_inputs``: the forward's tensors (their shapes and ``requires_grad`` are what count;
    meta tensors and a module built on the meta device plan a large model for free).
    ``memory_limit``: bytes of parameter state per rank (``costs.state_factor`` per parameter
    byte) that the plan must not exceed. Raises :class:`UnsupportedOperatorError` naming the node
    when the model does not trace or uses an operator without strategies.
    """
    if tensor_size < 1:
        raise ValueError(f"tensor_size={tensor_size} must be at least 1")
    costs = costs or CostModel()
    inputs = [example_inputs] if isinstance(example_inputs, torch.Tensor) else list(example_inputs)
    gm, ops = trace_operators(module, inputs, tensor_size)
    chosen = _solve(ops, tensor_size, costs, memory_limit)
    picked = {op.node: (op.strategies or [])[s] for op, s in zip(ops, chosen, strict=True)}
    by_node = {op.node: op for op in ops}

    choices: dict[str, NodeChoice] = {}
    collectives: list[Collective] = []
    compute = comm = params = memory_charge = 0.0
    for op in ops:
        strategy = picked[op.node]
        flops_s, grad_s, memory_s = _node_seconds(strategy, costs, tensor_size)
        for size in strategy.grad_all_reduce:
            lb = float(logical_bytes("all_reduce", size, tensor_size))
            seconds = costs.collective_s("all_reduce", size, tensor_size)
            collectives.append(
                Collective("all_reduce", "backward", size, lb, seconds, f"{op.name}: a parameter's gradient")
            )
        ins = tuple((src.name, need) for src, need in zip(op.inputs, strategy.inputs, strict=True))
        target = describe_target(op.node)
        choices[op.name] = NodeChoice(
            op.name, op.kind, target, strategy.name, strategy.output, ins, flops_s, grad_s, strategy.param_bytes
        )
        compute, comm = compute + flops_s, comm + grad_s
        params, memory_charge = params + strategy.param_bytes, memory_charge + memory_s

    reshards: dict[tuple[str, Need], list[str]] = {}
    for op in ops:
        for src, need in zip(op.inputs, picked[op.node].inputs, strict=True):
            if not is_identity(picked[src].output, need, by_node[src].needs_grad):
                reshards.setdefault((src.name, need), []).append(op.name)
    done: list[Reshard] = []
    for (src_name, need), users in reshards.items():
        producer = next(op for op in ops if op.name == src_name)
        source = picked[producer.node].output
        where = f"{src_name} {source} -> {need} for {', '.join(users)}"
        steps = _collectives(source, need, producer, tensor_size, costs, where)
        assert steps is not None
        done.append(Reshard(src_name, source, need, tuple(users), tuple(steps)))
        collectives += steps
        comm += sum(c.seconds for c in steps)
        memory_charge += costs.reshard_overhead  # charged like the solver did, not communication
    signature = tuple((node.name, node.op, target_name(node)) for node in gm.graph.nodes)
    return OperatorPlan(
        tensor_size,
        choices,
        tuple(done),
        tuple(collectives),
        compute,
        comm,
        params,
        compute + comm + memory_charge,
        signature,
    )


def target_name(node: fx.Node) -> str:
    target: Any = node.target
    if isinstance(target, str):
        return target
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
