"""Seconds of one optimizer step (docs/planner.md, "Step time"): each stage's compute, its
communication over the links (:mod:`tessera.planner.timing.links`) and what of it overlaps with
compute, the pipeline bubble behind the slowest stage, and the optimizer's update."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from tessera.planner.layout import Layout
from tessera.planner.results import TimeEstimate
from tessera.planner.spec import Cluster, ModelSpec, Workload
from tessera.planner.timing.bubble import pipeline_bubble
from tessera.planner.timing.counting import Traffic
from tessera.planner.timing.links import axis_link, base_axis, unsplit
from tessera.planner.timing.partition import Stage, StageWork, rank_split, stage_work, stages
from tessera.planner.timing.traffic import replica_axis, shard_ranks, stage_traffic

#: host Adam rate (bytes of fp32 parameters per second and device) when the cluster gives none
DEFAULT_HOST_OPTIMIZER_RATE = 2e9
BASE_AXES = ("data", "tensor", "pipeline", "sequence")


@dataclass(frozen=True)
class _StagePlan:
    stage: Stage
    traffic: tuple[Traffic, ...]
    work: StageWork
    parameters: float  # the stage's trainable elements on a rank (all of its parameters without LoRA)


@lru_cache(maxsize=16384)
def stage_plans(
    model: ModelSpec, layout: Layout, workload: Workload, per_node: int = 0
) -> tuple[tuple[_StagePlan, int], ...]:
    """What does not depend on the cluster (but for hybrid sharding's ``per_node``, the ranks of
    a node), once per distinct stage, with how many pipeline ranks hold such a stage."""
    cut = stages(model, layout.pipeline, layout.chunks)
    out = []
    for st in dict.fromkeys(cut):
        traffic = tuple(stage_traffic(model, layout, workload, st, per_node).values())
        trainable = rank_split(model, layout, st)[0]  # what the optimizer steps (LoRA: the adapters)
        plan = _StagePlan(st, traffic, stage_work(model, layout, workload, st), trainable)
        out.append((plan, cut.count(st)))
    return tuple(out)


def _hidden_behind(t: float, calls: float, window: float) -> float:
    """Exposed seconds of ``t`` of communication in ``calls`` pieces, each started when its data is
    ready during ``window`` seconds of compute: the last piece, and what does not fit."""
    last = t / calls if calls else t
    return last + max(0.0, t - last - window)


def _data_exposed(layout: Layout, secs: dict[str, float], calls: dict[str, float], fwd: float, bwd: float) -> float:
    """Exposed seconds of the replica axis: DDP's buckets overlap the last backward (a pipeline's
    one all-reduce does not); ZeRO-1 reduces and gathers at the step; ZeRO-2 reduces each
    micro-step behind its backward and gathers at the step; ZeRO-3 also gathers in the forward
    (prefetching) and the backward. Hybrid sharding's all-reduce of the shards across nodes
    (``secs["across"]``) follows each chunk's reduce-scatter, in the same stream. ``fwd``,
    ``bwd``: seconds of one micro-step's passes."""
    ar, rs, ag = (secs.get(op, 0.0) for op in ("all_reduce", "reduce_scatter", "all_gather"))
    rs += secs.get("across", 0.0)
    micro = layout.accumulation
    if layout.zero == 0:
        return ar if layout.pipeline > 1 else _hidden_behind(ar, calls.get("all_reduce", 1), bwd)
    if layout.zero == 1:
        return ar + rs + ag
    rs_calls, ag_calls = calls.get("reduce_scatter", 1) / micro, calls.get("all_gather", 1) / micro
    rs_step = rs / micro
    if layout.zero == 2:
        return ar + ag + micro * _hidden_behind(rs_step, rs_calls, bwd)
    half = ag / micro / 2  # each micro-step gathers every chunk for the forward and again for the backward
    forward = _hidden_behind(half, ag_calls / 2, fwd)
    backward = rs_step / rs_calls + max(0.0, half + rs_step - rs_step / rs_calls - bwd) if rs_calls else half + rs_step
    return ar + micro * (forward + backward)


@dataclass(frozen=True)
class _StageTime:
    compute: float
    comm: dict[str, float]
    exposed: float
    per_micro: float  # critical-path seconds of one micro-batch (compute and exposed tensor/sequence)
    work: StageWork


def _stage_time(plan: _StagePlan, layout: Layout, cluster: Cluster) -> _StageTime:
    """Seconds of one stage's step before the bubble and the optimizer."""
    m, rate = layout.microbatches, cluster.flops
    secs: dict[tuple[str, str], float] = {}
    for t in plan.traffic:
        secs[t.op, t.axis] = axis_link(cluster, layout, t.axis, t.op, t.group).time(t.bytes, t.calls)
    comm = dict.fromkeys(BASE_AXES, 0.0)
    for (_, axis), sec in secs.items():
        comm[base_axis(axis)] += sec
    work = plan.work
    fwd, bwd = _pass_seconds(plan, layout, cluster)
    compute = m * (fwd + bwd)
    # overlap needs idle hardware to move the bytes: ranks sharing cores have none (gloo's copies
    # and sums run on the cores that compute), so there communication adds to compute
    overlap = ranks_per_core(cluster) <= 1.0
    seq = comm["sequence"]
    if layout.sequence_mode == "ring" and overlap:  # transfers overlap the block computations
        seq = max(0.0, seq - m * work.attention / rate)
    critical = comm["tensor"] + seq
    replica = replica_axis(layout)[0]
    data_secs: dict[str, float] = {}
    data_calls: dict[str, float] = {}
    for t in plan.traffic:  # the replica axis and hybrid sharding's groups of it by node
        if unsplit(t.axis) == replica:
            key = "across" if t.axis.endswith(".across") else t.op
            data_secs[key] = data_secs.get(key, 0.0) + secs[t.op, t.axis]
            data_calls[key] = data_calls.get(key, 0.0) + t.calls
    exposed = critical + (
        _data_exposed(layout, data_secs, data_calls, fwd, bwd) if overlap else sum(data_secs.values())
    )
    exposed += _pipeline_exposed(layout, cluster, plan.traffic, secs)
    return _StageTime(compute, comm, exposed, (compute + critical) / m, work)


def _pass_seconds(plan: _StagePlan, layout: Layout, cluster: Cluster) -> tuple[float, float]:
    """Seconds of one micro-batch's forward and backward (recomputation included) on a rank of
    the stage: flops over the rate, plus each block's fixed cost (a third in the forward), and
    checkpointing's recompute as calibration measured it (its flops where it did not)."""
    work, rate, blocks = plan.work, cluster.flops, plan.stage.blocks
    fixed = blocks * cluster.block_overhead
    forward = work.forward / rate + fixed / 3
    backward = work.backward / rate + 2 * fixed / 3
    cost = cluster.recompute_cost.get(layout.checkpoint) if layout.checkpoint != "none" else None
    if cost is None:
        backward += work.recompute / rate
    else:
        backward += blocks * (cost - 1.0) * (3 * work.block / rate + cluster.block_overhead)
    return forward, backward


def _pipeline_exposed(layout: Layout, cluster: Cluster, traffic: tuple[Traffic, ...],
                      secs: dict[tuple[str, str], float]) -> float:  # fmt: skip
    """The tied embedding's all-reduce, and the transfers of the fill and the drain (one
    activation down the pipeline and one gradient up): steady-state transfers overlap, but for
    ranks sharing cores, where every transfer takes its time from the compute."""
    p = layout.pipeline
    if p == 1:
        return 0.0
    exposed = secs.get(("all_reduce", "pipeline"), 0.0)
    if ranks_per_core(cluster) > 1.0:
        return exposed + sum(sec for (op, axis), sec in secs.items() if axis == "pipeline" and op != "all_reduce")
    for t in traffic:
        if t.op == "send" and t.axis == "pipeline" and t.calls:
            exposed += 2 * (p - 1) * axis_link(cluster, layout, "pipeline", "send", p).time(t.bytes / t.calls)
    return exposed


def _optimizer_time(heaviest: float, layout: Layout, workload: Workload, cluster: Cluster) -> float:
    """The elementwise update of the ``heaviest`` stage's fp32 parameters on a rank (a ZeRO shard:
    1/replicas, hybrid sharding 1/the node's replicas), on the device, or with offload on the host
    plus the copies of gradients down and parameters up."""
    shard = heaviest / (shard_ranks(layout, cluster.devices_per_node) if layout.zero else 1)
    if not layout.offload:
        return 4 * shard / (cluster.optimizer_rate or cluster.flops / 8)
    host_rate = cluster.optimizer_rate or DEFAULT_HOST_OPTIMIZER_RATE
    copies = 2 * shard * workload.element_bytes / (cluster.host_link or cluster.intra.bandwidth)
    return 4 * shard / host_rate + copies


def predict_time(model: ModelSpec, layout: Layout, workload: Workload, cluster: Cluster) -> TimeEstimate:
    """Seconds of one optimizer step of ``layout`` on ``cluster``: the slowest stage's compute
    and exposed communication, the pipeline bubble behind it, and the optimizer step. Where ranks
    share cores (``ranks_per_core`` k > 1: CPU ranks), a waiting rank's core runs the others'
    work: the step is the mean rank's busy time, or the slowest rank's path run k times faster
    with its bubble, whichever is longer (compute and exposed_comm are then the mean rank's)."""
    plans = stage_plans(model, layout, workload, cluster.devices_per_node if layout.shard == "host" else 0)
    times = [(_stage_time(plan, layout, cluster), count) for plan, count in plans]
    slow = max((t for t, _ in times), key=lambda t: t.compute + t.exposed)
    bubble = _bubble(layout, slow)
    optimizer = _optimizer_time(max(plan.parameters for plan, _ in plans), layout, workload, cluster)
    shared = ranks_per_core(cluster)
    if shared <= 1.0:
        return TimeEstimate(
            slow.compute, slow.comm, slow.exposed, bubble, optimizer, slow.compute + slow.exposed + bubble + optimizer
        )
    ranks = sum(count for _, count in times)
    compute = sum(t.compute * count for t, count in times) / ranks
    exposed = sum(t.exposed * count for t, count in times) / ranks
    path = (slow.compute + slow.exposed + bubble) / shared
    wait = max(0.0, path - compute - exposed)
    return TimeEstimate(compute, slow.comm, exposed, wait, optimizer, compute + exposed + wait + optimizer)


def ranks_per_core(cluster: Cluster) -> float:
    """Ranks sharing one core (calibration measures it for CPU ranks); 1: each rank its own."""
    return cluster.ranks_per_core


def _bubble(layout: Layout, slow: _StageTime) -> float:
    """The idle time of the slowest stage's pipeline: its micro-batch's forward, input-gradient
    (with recomputation) and weight-gradient times (exposed tensor and sequence communication
    shared out in proportion) into the schedule's bubble."""
    if layout.pipeline == 1:
        return 0.0
    w = slow.work
    scale = slow.per_micro / w.total if w.total else 0.0
    f, b, wt = w.forward * scale, (w.backward / 2 + w.recompute) * scale, w.backward / 2 * scale
    return pipeline_bubble(layout.schedule, layout.pipeline, layout.microbatches, layout.chunks, f, b, wt)
