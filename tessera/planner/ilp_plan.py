"""What the operator-level planner decides and what it charges for: the :class:`CostModel` its
objective is made of, and the :class:`OperatorPlan` it returns (one strategy per node, the
conversions between them, the collectives of a step and its predicted cost)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tessera.comm.ledger import logical_bytes
from tessera.planner.ilp_ops import REPLICATED, Need, Sharding
from tessera.planner.spec import Cluster


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
