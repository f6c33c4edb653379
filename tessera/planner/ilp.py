"""The planner's operator-level mode: sharding choices per operator of a traced model, solved as an
integer linear program (docs/planner.md, "Operator-level mode (ILP)").

``plan_operators(module, example_inputs, tensor_size)`` traces the module with
``torch.fx.symbolic_trace``, propagates shapes, gives every tensor-valued node its candidate
strategies (:mod:`tessera.planner.ilp_trace`, with :mod:`tessera.planner.ilp_rules`), and picks
one per node with scipy's HiGHS: the cheapest step (compute per rank, the collectives that
convert one node's output into what its consumers need, forward and backward, and a small charge
per parameter byte held). The model's inputs are replicated and its outputs must be.
:func:`tessera.planner.ilp_apply.apply_operator_plan` then rewrites the graph for one rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tessera.comm.ledger import logical_bytes
from tessera.planner.ilp_ops import Need, OpNode, Sharding, Strategy, UnsupportedOperatorError, describe_target
from tessera.planner.ilp_plan import Collective, CostModel, NodeChoice, OperatorPlan, Reshard
from tessera.planner.ilp_trace import target_name, trace_operators

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
