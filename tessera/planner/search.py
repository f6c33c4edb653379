"""The layout search: every layout of the cluster's devices that can run, pruned early and cheaply,
estimated (:func:`tessera.planner.estimate`), ranked by predicted step time, and explained.

The search walks *shapes* (data, tensor with its mode, sequence with its mode, pipeline: their
product is the device count), then each shape's ZeRO stage and offload, pipeline schedule,
micro-batch size and activation checkpointing, the micro-batch count following from the global
batch. It never estimates a layout that cannot run (divisibility of heads, hidden width, layers,
batch and sequence by the split; :meth:`Layout.problems`), nor one whose model states alone,
divided as evenly as the layout allows, exceed the device memory. Without ``exhaustive`` it also
skips *dominated* layouts: a heavier checkpointing or an optimizer offload of a layout that fits
without it only adds time (recomputation, host copies), and GPipe with at least as many
micro-batches as stages is 1F1B's bubble and traffic with more micro-batches in flight.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tessera.errors import ConfigError
from tessera.planner.estimate import Estimate, MemoryEstimate, estimate
from tessera.planner.layout import Checkpointing, Layout, Schedule, SequenceMode, TensorMode
from tessera.planner.spec import Cluster, ModelSpec, Workload

SCHEDULES: tuple[Schedule, ...] = ("gpipe", "1f1b", "interleaved", "zero_bubble")
#: lightest recomputation first: each next one keeps less and recomputes more
CHECKPOINTING: tuple[Checkpointing, ...] = ("none", "selective", "full")
TENSOR_MODES: tuple[TensorMode, ...] = ("1d", "2d", "2.5d", "3d")
SEQUENCE_MODES: tuple[SequenceMode, ...] = ("ring", "ring_qk", "all_to_all")
#: ring_qk moves what ring moves and keeps whole score rows besides: searched only when asked
DEFAULT_SEQUENCE_MODES: tuple[SequenceMode, ...] = ("ring", "all_to_all")
GIB = 2**30


@dataclass(frozen=True)
class Limits:
    """What the search may choose; the defaults allow everything tessera runs.

    ``tensor_within_node``: tensor groups stay inside a node unless no such layout fits.
    ``exhaustive``: estimate every layout that fits (no dominance pruning; slower).
    ``pins``: fields every layout must have, e.g. ``{"pipeline": 1, "zero": 3}``."""

    tensor_modes: tuple[TensorMode, ...] = TENSOR_MODES
    schedules: tuple[Schedule, ...] = SCHEDULES
    sequence_modes: tuple[SequenceMode, ...] = DEFAULT_SEQUENCE_MODES
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    checkpointing: tuple[Checkpointing, ...] = CHECKPOINTING
    offload: bool = True
    max_sequence: int = 8
    max_micro_batch: int | None = None
    interleaved_chunks: int = 2
    tensor_within_node: bool = True
    exhaustive: bool = False
    pins: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Baseline:
    """A named family of layouts shown beside the ranking: its best member (fastest that fits,
    else the one needing least memory) is found whether or not it fits. ``pins`` fix fields of
    :class:`Layout` (``"data": "world"`` means all devices); ``limits`` narrow the rest."""

    name: str
    pins: dict[str, Any]
    reported: bool = False  # a layout a paper reported (shown as such)


@dataclass
class SearchStats:
    """How many layouts each stage of the search saw or dropped, and the time it took."""

    shapes: int = 0
    rejected: int = 0  # cannot run: Layout.problems() and the model's divisibility
    pruned_states: int = 0  # model states alone exceed device memory (no estimate made)
    too_big: int = 0  # estimated memory exceeds the device (memory only, no time)
    dominated: int = 0  # a lighter variant fits: skipped without estimating
    estimated: int = 0
    fitting: int = 0
    widened: bool = False  # tensor groups had to span nodes
    seconds: float = 0.0

    def describe(self) -> str:
        return (
            f"{self.shapes} shapes; {self.estimated} layouts estimated, {self.fitting} fit; skipped: "
            f"{self.rejected} cannot run, {self.pruned_states} by the model-state bound, {self.too_big} over memory, "
            f"{self.dominated} dominated; {self.seconds:.2f} s"
        )


# ---- enumeration ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def _root(n: int, power: int) -> int | None:
    r = round(n ** (1 / power))
    return next((c for c in (r - 1, r, r + 1) if c >= 1 and c**power == n), None)


def tensor_variants(model: ModelSpec, t: int, modes: Sequence[TensorMode]) -> Iterator[tuple[TensorMode, int, bool]]:
    """(mode, depth, sequence_parallel) of ``t`` tensor ranks whose split divides the model:
    1d needs the heads (query and key/value), hidden and MLP widths to divide by t; the grid
    modes the same by q (3d: the hidden widths by q^2, its activation split)."""
    heads, kv, h, ff = model.n_heads, model.kv_heads, model.d_model, model.ff_dim

    def splits(q: int, width_split: int) -> bool:
        return heads % q == 0 and kv % q == 0 and h % width_split == 0 and ff % width_split == 0

    if t == 1:
        yield "1d", 1, False
        return
    if "1d" in modes and splits(t, t):
        yield "1d", 1, False
        yield "1d", 1, True
    q2 = _root(t, 2)
    if "2d" in modes and q2 and q2 > 1 and splits(q2, q2):
        yield "2d", 1, False
    if "2.5d" in modes:
        for depth in divisors(t)[1:]:
            q = _root(t // depth, 2)
            if q and q > 1 and splits(q, q):
                yield "2.5d", depth, False
    q3 = _root(t, 3)
    if "3d" in modes and q3 and q3 > 1 and splits(q3, q3 * q3):
        yield "3d", 1, False


def sequence_fits(model: ModelSpec, seq: int, s: int, mode: SequenceMode, tensor: int) -> bool:
    """Whether ``s`` sequence ranks split this model's sequence: ring attention splits it into 2s
    zigzag halves, ring_qk into s; all_to_all exchanges heads (query and key/value) over them."""
    if mode == "ring":
        return seq % (2 * s) == 0
    if mode == "ring_qk":
        return seq % s == 0
    return seq % s == 0 and model.n_heads % (tensor * s) == 0 and model.kv_heads % (tensor * s) == 0


def shapes(
    model: ModelSpec, cluster: Cluster, workload: Workload, limits: Limits, *, within_node: bool
) -> Iterator[Layout]:
    """Every (data, tensor + mode, sequence + mode, pipeline) of the cluster's devices that the
    model's sizes and the global batch divide; the other fields at their defaults."""
    world, per_node = cluster.devices, min(cluster.devices_per_node, cluster.devices)
    seq = workload.seq_len or model.seq_len
    for t in divisors(world):
        if within_node and per_node % t:
            continue  # a tensor group that spans nodes: only when nothing else fits
        for mode, depth, sp in tensor_variants(model, t, limits.tensor_modes):
            if sp and seq % t:
                continue  # sequence-parallel regions split the tokens t ways
            for s in divisors(world // t):
                if s > limits.max_sequence or (s > 1 and mode != "1d"):
                    break
                for seq_mode in limits.sequence_modes if s > 1 else ("ring",):
                    if s > 1 and not sequence_fits(model, seq, s, seq_mode, t):
                        continue
                    for p in divisors(world // (t * s)):
                        if p > model.n_layers:
                            break
                        d = world // (t * s * p)
                        if workload.global_batch % d:
                            continue
                        yield Layout(data=d, tensor=t, tensor_mode=mode, depth=depth, sequence_parallel=sp,
                                     pipeline=p, sequence=s, sequence_mode=seq_mode)  # fmt: skip


def batch_parts(layout: Layout) -> int:
    """How many ways the tensor mode splits a micro-batch's samples (2d: q rows, 2.5d: depth x q,
    3d: q); a micro-batch that does not divide would be padded."""
    return {"2d": layout.grid, "2.5d": layout.depth * layout.grid, "3d": layout.grid}.get(layout.tensor_mode, 1)


def schedules_of(model: ModelSpec, shape: Layout, limits: Limits) -> list[tuple[Schedule, int]]:
    """(schedule, chunks) choices of a shape: one without a pipeline, else each schedule whose
    parts (stages x chunks) the model's layers can fill."""
    if shape.pipeline == 1:
        return [("1f1b", 1)]
    out: list[tuple[Schedule, int]] = []
    for schedule in limits.schedules:
        chunks = limits.interleaved_chunks if schedule == "interleaved" else 1
        if schedule == "interleaved" and (chunks < 2 or shape.pipeline * chunks > model.n_layers):
            continue
        out.append((schedule, chunks))
    return out


def micro_batches(per_replica: int, shape: Layout, schedule: Schedule, limits: Limits) -> list[int]:
    """Micro-batch sizes of a replica's ``per_replica`` samples a step: divisors that the tensor
    mode's batch split divides and that leave the schedule enough micro-batches."""
    parts = batch_parts(shape)
    out = []
    for mb in divisors(per_replica):
        if limits.max_micro_batch is not None and mb > limits.max_micro_batch:
            break
        m = per_replica // mb
        if mb % parts:
            continue
        if shape.pipeline > 1 and schedule != "gpipe" and m < shape.pipeline:
            break  # larger micro-batches leave even fewer
        if schedule == "interleaved" and m % shape.pipeline:
            continue  # micro-batches go through the chunks in groups of p
        out.append(mb)
    return out


def layout_problems(model: ModelSpec, layout: Layout, workload: Workload) -> list[str]:
    """Why the search leaves ``layout`` out (empty when it is in its space): it cannot run
    (:meth:`Layout.problems`, the model's sizes and the batch), or it is a ZeRO stage with no data
    axis to shard over (only stage 1 with offload is kept there: the optimizer on the host)."""
    out = layout.problems()
    if out:
        return out
    if layout.zero and layout.data == 1 and not (layout.zero == 1 and layout.offload):
        out.append("ZeRO shards over the data axis, which has one rank here")
    seq = workload.seq_len or model.seq_len
    if (layout.tensor_mode, layout.depth, layout.sequence_parallel) not in set(
        tensor_variants(model, layout.tensor, TENSOR_MODES)
    ):
        out.append(f"the model's heads and widths do not split {layout.tensor} ways in {layout.tensor_mode}")
    if layout.sequence > 1 and not sequence_fits(model, seq, layout.sequence, layout.sequence_mode, layout.tensor):
        out.append(f"the sequence of {seq} tokens does not split {layout.sequence} ways ({layout.sequence_mode})")
    if layout.sequence_parallel and seq % layout.tensor:
        out.append(f"sequence-parallel regions need the {seq} tokens to divide by {layout.tensor}")
    if layout.pipeline * layout.chunks > model.n_layers:
        out.append(f"{layout.pipeline * layout.chunks} pipeline parts for {model.n_layers} layers")
    if layout.schedule == "interleaved" and layout.pipeline > 1 and layout.microbatches % layout.pipeline:
        out.append("interleaved needs the micro-batches to be a multiple of the stages")
    if layout.micro_batch % batch_parts(layout):
        out.append(f"micro-batch {layout.micro_batch} does not split {batch_parts(layout)} ways ({layout.tensor_mode})")
    if layout.global_batch != workload.global_batch:
        out.append(f"global batch {layout.global_batch}, not the workload's {workload.global_batch}")
    return out


# ---- the search ------------------------------------------------------------------------------------

SHAPE_FIELDS = ("data", "tensor", "tensor_mode", "depth", "sequence_parallel", "pipeline", "sequence", "sequence_mode")


class _Search:
    """One search over a model, cluster and workload; keeps every estimate it makes."""

    def __init__(self, model: ModelSpec, cluster: Cluster, workload: Workload, limits: Limits) -> None:
        self.model, self.cluster, self.workload, self.limits = model, cluster, workload, limits
        self.params = model.num_parameters()
        self.stats = SearchStats()
        self.fitting: list[Estimate] = []
        self.closest: tuple[int, Layout] | None = None  # least peak memory seen among those that do not fit
        self.floors: list[tuple[float, Layout]] = []  # groups pruned by the bound: their bound and lightest layout
        self.memories: dict[Layout, MemoryEstimate] = {}

    def memory(self, layout: Layout) -> MemoryEstimate:
        """:func:`~tessera.planner.memory.predict_memory` of ``layout``, once per layout."""
        from tessera.planner.memory import predict_memory

        found = self.memories.get(layout)
        if found is None:
            found = self.memories[layout] = predict_memory(self.model, layout, self.workload)
        return found

    def pinned(self, layout: Layout, names: Sequence[str] | None = None) -> bool:
        pins = self.limits.pins
        return all(getattr(layout, k) == v for k, v in pins.items() if names is None or k in names)

    def run(self, *, within_node: bool) -> None:
        for shape in shapes(self.model, self.cluster, self.workload, self.limits, within_node=within_node):
            if not self.pinned(shape, SHAPE_FIELDS):
                continue
            self.stats.shapes += 1
            for zero in self.limits.zero_stages:
                offloads = self.offloads(shape, zero)
                for offload in list(offloads):
                    floor = self.states_floor(shape, zero, offload)
                    if floor > self.cluster.device_memory:
                        self.stats.pruned_states += 1
                        offloads.remove(offload)
                        self.floors.append((floor, replace(shape, zero=zero, offload=offload)))
                if offloads:
                    self.walk_group(shape, zero, offloads)

    def offloads(self, shape: Layout, zero: int) -> list[bool]:
        """Optimizer offload choices of a ZeRO stage on this shape. ZeRO shards over the data axis:
        without one, only stage 1 with offload (ZeRO-Offload on one replica) is worth running."""
        if zero >= 2 and shape.pipeline > 1:
            return []
        choices = [False, True] if zero and self.limits.offload else [False]
        if shape.data == 1 and zero:
            choices = [True] if zero == 1 and self.limits.offload else []
        return choices

    def states_floor(self, shape: Layout, zero: int, offload: bool) -> float:
        """A lower bound of the fullest rank's model-state bytes: its share were the parameters split
        perfectly evenly by tensor and pipeline, in the compute dtype, the fp32 optimizer moments on
        the device unless offloaded, each divided over the data axis as ZeRO's stage shards it."""
        share = self.params / (shape.splits[0] * shape.pipeline)
        e, d = self.workload.element_bytes, shape.data
        weights = share * e / (d if zero >= 3 else 1)
        grads = share * e / (d if zero >= 2 else 1)
        moments = 0.0 if offload else share * 4 * self.workload.optimizer_states / (d if zero >= 1 else 1)
        return 0.999 * (weights + grads + moments)

    def walk_group(self, shape: Layout, zero: int, offloads: list[bool]) -> None:
        """Schedules and micro-batch sizes of one shape and ZeRO stage. Memory grows with the
        micro-batch while several accumulate (the gradients of a step of one micro-batch are not
        kept alongside its activations), so a variant over memory is not tried at larger sizes
        except the one-micro-batch step; and when every checkpointing of the smallest micro-batch is
        over memory with offload (if any), so is every other variant."""
        per_replica = self.workload.global_batch // shape.data
        for schedule, chunks in schedules_of(self.model, shape, self.limits):
            sizes = micro_batches(per_replica, shape, schedule, self.limits)
            if schedule == "gpipe" and "1f1b" in self.limits.schedules and not self.limits.exhaustive:
                # with m >= p micro-batches GPipe is 1F1B's bubble and traffic with more of them in flight
                kept = [mb for mb in sizes if per_replica // mb < shape.pipeline]
                self.stats.dominated += len(sizes) - len(kept)
                sizes = kept
            if not sizes or not self.lightest_fits(shape, zero, offloads, schedule, chunks, sizes, per_replica):
                continue
            over: set[tuple[bool, str]] = set()
            fitted: set[tuple[bool, str]] = set()
            for mb in sizes:
                m = per_replica // mb
                base = replace(shape, zero=zero, schedule=schedule, chunks=chunks, microbatches=m, micro_batch=mb)
                self.walk_variants(base, offloads, over if m > 1 else set(), fitted)

    def lightest_fits(
        self,
        shape: Layout,
        zero: int,
        offloads: list[bool],
        schedule: Schedule,
        chunks: int,
        sizes: list[int],
        per: int,
    ) -> bool:
        """Whether some checkpointing of the smallest micro-batch (or of the one-micro-batch step)
        fits with offload if any; when none does, the group is counted over memory untried.
        (Checkpointing is tried in full: a recomputed block's transient can outweigh what it saves.)"""
        for mb in dict.fromkeys((sizes[0], sizes[-1])):
            for ckpt in self.limits.checkpointing:
                light = replace(shape, zero=zero, offload=offloads[-1], checkpoint=ckpt, schedule=schedule,
                                chunks=chunks, microbatches=per // mb, micro_batch=mb)  # fmt: skip
                if light.problems():
                    return True  # let the walk count it
                memory = self.memory(light)
                if self.memory_fits(memory.peak, memory.host):
                    return True
                if self.closest is None or memory.peak < self.closest[0]:
                    self.closest = (memory.peak, light)
            if sizes[-1] != per:
                break  # the largest micro-batch still accumulates: no exception to try
        self.stats.too_big += len(sizes) * len(offloads) * len(self.limits.checkpointing)
        return False

    def walk_variants(
        self, base: Layout, offloads: list[bool], over: set[tuple[bool, str]], fitted: set[tuple[bool, str]]
    ) -> None:
        """Checkpointing and offload of one layout, lightest first. Without ``exhaustive``, the first
        that fits ends each offload's walk, and offload is tried only where it lets a lighter
        checkpointing fit: the rest add time (recomputation, host copies) and save memory not needed.
        ``over``/``fitted``: the (offload, checkpointing) found over memory / fitting at a smaller
        micro-batch; the fitted are estimated at once (likely to fit again: one memory prediction)."""
        ckpts = self.limits.checkpointing
        lightest: int | None = None  # index of the lightest checkpointing that fits without offload
        for offload in offloads:
            for i, ckpt in enumerate(ckpts):
                if not self.limits.exhaustive and offload and lightest is not None and i >= lightest:
                    self.stats.dominated += len(ckpts) - i
                    break
                if (offload, ckpt) in over:
                    self.stats.too_big += 1
                    continue
                layout = replace(base, offload=offload, checkpoint=ckpt)
                if not self.pinned(layout):
                    continue
                if layout.problems():
                    self.stats.rejected += 1
                    continue
                if (offload, ckpt) in fitted:
                    est = estimate(self.model, layout, self.workload, self.cluster)
                    peak, host = est.memory.peak, est.memory.host
                else:
                    est = None
                    memory = self.memory(layout)
                    peak, host = memory.peak, memory.host
                if not self.memory_fits(peak, host):
                    self.stats.too_big += 1
                    over.add((offload, ckpt))
                    if self.closest is None or peak < self.closest[0]:
                        self.closest = (peak, layout)
                    continue
                fitted.add((offload, ckpt))
                self.add(est or estimate(self.model, layout, self.workload, self.cluster))
                if not self.limits.exhaustive:
                    lightest = i if not offload else lightest
                    self.stats.dominated += len(ckpts) - i - 1
                    break

    def memory_fits(self, peak: int, host: int) -> bool:
        host_memory = self.cluster.host_memory
        return peak <= self.cluster.device_memory and (host_memory is None or host <= host_memory)

    def add(self, est: Estimate) -> None:
        self.stats.estimated += 1
        if est.fits:
            self.stats.fitting += 1
            self.fitting.append(est)
        elif self.closest is None or est.memory.peak < self.closest[0]:
            self.closest = (est.memory.peak, est.layout)

    def nearest_miss(self) -> Estimate | None:
        """When nothing fits: the layout that misses the device memory by least (the lightest variant
        of the groups with the lowest model-state bounds are estimated for it)."""
        candidates = [self.closest[1]] if self.closest else []
        per_layout = self.workload.global_batch
        for _, group in sorted(self.floors, key=lambda f: f[0])[:16]:
            mb = min(micro_batches(per_layout // group.data, group, "gpipe", self.limits), default=None)
            if mb is None:
                continue
            light = replace(group, schedule="gpipe", checkpoint=self.limits.checkpointing[-1], micro_batch=mb,
                            microbatches=per_layout // (group.data * mb))  # fmt: skip
            if not light.problems():
                candidates.append(light)
        if not candidates:
            return None
        best = min(candidates, key=lambda lay: self.memory(lay).peak)
        return estimate(self.model, best, self.workload, self.cluster)


def rank_key(est: Estimate) -> tuple[float, int, str]:
    """Faster first; ties: less memory, then the name (a deterministic order on every rank)."""
    return (est.time.step, est.memory.peak, est.layout.name())


def search(model: ModelSpec, cluster: Cluster, workload: Workload, limits: Limits) -> _Search:
    """Run the search: tensor groups within a node first, across nodes when nothing fits so."""
    found = _Search(model, cluster, workload, limits)
    found.run(within_node=limits.tensor_within_node)
    if not found.fitting and limits.tensor_within_node and cluster.devices > cluster.devices_per_node:
        found = _Search(model, cluster, workload, limits)
        found.run(within_node=False)
        found.stats.widened = True
    found.fitting.sort(key=rank_key)
    return found


def default_baselines(model: ModelSpec, cluster: Cluster) -> list[Baseline]:
    """Pure ZeRO-3 data parallelism over every device, and 1D tensor parallelism as wide as a node
    allows (the widest size that divides the model) with data parallelism over the rest."""
    world = cluster.devices
    out = [Baseline("pure ZeRO-3", {"data": world, "zero": 3})]
    per_node = min(cluster.devices_per_node, world)
    widths = [t for t in divisors(per_node) if t > 1 and any(v[0] == "1d" for v in tensor_variants(model, t, ("1d",)))]
    if widths:
        t = widths[-1]
        pins = {"tensor": t, "tensor_mode": "1d", "sequence_parallel": False, "pipeline": 1, "sequence": 1, "zero": 0}
        out.append(Baseline(f"pure 1D tp{t}", pins))
    return out


def best_of_family(
    model: ModelSpec, cluster: Cluster, workload: Workload, baseline: Baseline, limits: Limits
) -> Estimate | None:
    """The fastest layout of ``baseline``'s family that fits, else the one that needs least memory
    (None when the family has no layout that can run)."""
    pins = {k: (cluster.devices if v == "world" else v) for k, v in baseline.pins.items()}
    family = replace(
        limits, pins=pins, tensor_within_node=False, max_sequence=max(limits.max_sequence, cluster.devices)
    )
    found = _Search(model, cluster, workload, family)
    found.run(within_node=False)
    if found.fitting:
        return min(found.fitting, key=rank_key)
    return found.nearest_miss()


# ---- the plan and its reasons ------------------------------------------------------------------------


def fmt_bytes(n: float, digits: int = 1) -> str:
    return f"{n / GIB:,.{digits}f} GiB" if n >= 0.1 * GIB else f"{n / 2**20:,.{digits}f} MiB"


def fmt_over(need: float, limit: float) -> tuple[str, str]:
    """``need`` and ``limit`` with enough digits to tell them apart."""
    digits = next((d for d in (1, 2, 3) if fmt_bytes(need, d) != fmt_bytes(limit, d)), 3)
    return fmt_bytes(need, digits), fmt_bytes(limit, digits)


def fmt_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} us"


def axis_span(layout: Layout, axis: str) -> int:
    """Consecutive ranks one group of ``axis`` spans (tensor innermost, then sequence, pipeline, data)."""
    inner = {"tensor": 1, "sequence": layout.tensor, "pipeline": layout.tensor * layout.sequence}
    size = {"tensor": layout.tensor, "sequence": layout.sequence, "pipeline": layout.pipeline, "data": layout.data}
    return layout.world if axis == "data" else inner[axis] * size[axis]


def link_of(layout: Layout, axis: str, cluster: Cluster) -> str:
    if axis in cluster.axis_links:
        return "measured link"
    return "across nodes" if axis_span(layout, axis) > cluster.devices_per_node else "within a node"


def _traffic_words(model: ModelSpec, layout: Layout, workload: Workload, axis: str) -> str:
    """The two largest ops on ``axis`` (its sub-axes summed: 2d rows and columns are the tensor
    axis) in one step on the busiest rank, as the ledger counts them: ``all-gathers of 140.0 GiB``."""
    from tessera.planner.timing import base_axis, step_traffic

    ops: dict[str, float] = {}
    for t in step_traffic(model, layout, workload).values():
        if base_axis(t.axis) == axis:
            ops[t.op] = ops.get(t.op, 0.0) + t.bytes
    top = sorted(((nbytes, op) for op, nbytes in ops.items() if nbytes > 0), reverse=True)[:2]
    return " + ".join(f"{op.replace('_', '-')}s of {fmt_bytes(nbytes)}" for nbytes, op in top)


def _comm_part(a: Estimate, b: Estimate, plan: Plan) -> str:
    """Exposed communication of ``a`` against ``b``, and the axis whose traffic time fell most."""
    text = f"exposed communication {fmt_time(a.time.exposed_comm)} vs {fmt_time(b.time.exposed_comm)}"
    gains = {ax: b.time.comm.get(ax, 0.0) - a.time.comm.get(ax, 0.0) for ax in set(a.time.comm) | set(b.time.comm)}
    if not gains or max(gains.values()) <= 0:
        return text
    ax = max(sorted(gains), key=lambda k: gains[k])
    before, after = b.time.comm.get(ax, 0.0), a.time.comm.get(ax, 0.0)
    words = _traffic_words(plan.model, b.layout, plan.workload, ax)
    theirs = f"{words} a step {link_of(b.layout, ax, plan.cluster)}" if words else link_of(b.layout, ax, plan.cluster)
    if after == 0:
        return text + f" (no {ax}-axis traffic vs {fmt_time(before)}: {theirs})"
    return text + f" ({ax}-axis traffic {fmt_time(after)} vs {fmt_time(before)}: {theirs})"


def why(a: Estimate, b: Estimate, label: str, plan: Plan) -> str:
    """Why ``a`` ranks above ``b``, in terms of the estimate's parts: memory when ``b`` does not fit,
    else the parts of the step time that differ most."""
    if a.layout == b.layout:
        return f"it is the {label} layout"
    if not b.fits:
        need, available = fmt_over(b.memory.peak, plan.cluster.device_memory)
        return f"vs {label}: fits ({label} needs {need} per rank, {available} available)"
    gain = b.time.step - a.time.step
    if gain <= 0:
        less = b.memory.peak - a.memory.peak
        if less <= 0:
            return f"vs {label}: a tie (the same step time and memory)"
        return f"vs {label}: the same step time, {fmt_bytes(less)} less memory per rank"
    parts = {
        "exposed communication": b.time.exposed_comm - a.time.exposed_comm,
        "bubble": b.time.bubble - a.time.bubble,
        "compute": b.time.compute - a.time.compute,
        "optimizer": b.time.optimizer - a.time.optimizer,
    }
    main = [k for k in sorted(parts, key=lambda k: -parts[k]) if parts[k] > 0.1 * gain][:2]
    words = {
        "exposed communication": lambda: _comm_part(a, b, plan),
        "bubble": lambda: f"pipeline bubble {fmt_time(a.time.bubble)} vs {fmt_time(b.time.bubble)}",
        "compute": lambda: f"compute {fmt_time(a.time.compute)} vs {fmt_time(b.time.compute)} (recomputation)",
        "optimizer": lambda: f"optimizer step {fmt_time(a.time.optimizer)} vs {fmt_time(b.time.optimizer)}",
    }
    detail = "; ".join(words[k]() for k in main) or "a little in every part"
    share = 100 * gain / b.time.step
    return f"vs {label}: {share:.2g}% shorter step ({fmt_time(a.time.step)} vs {fmt_time(b.time.step)}): {detail}"


@dataclass(frozen=True)
class Row:
    """One line of the table: a ranked layout (``rank`` 1, 2, ...) or a baseline (``rank`` None)."""

    rank: int | None
    estimate: Estimate
    label: str
    why: str


@dataclass
class Plan:
    """The outcome of :func:`plan`: every layout that fits, fastest first (``ranked``), the best
    layout of each baseline family (``baselines``: name -> estimate, None when the family cannot
    run), and when nothing fits the layout that misses by least (``nearest``)."""

    model: ModelSpec
    cluster: Cluster
    workload: Workload
    ranked: list[Estimate]
    baselines: dict[str, Estimate | None]
    stats: SearchStats
    top: int = 10
    nearest: Estimate | None = None
    reported: frozenset[str] = frozenset()

    @property
    def best(self) -> Estimate:
        """The fastest layout that fits; ConfigError saying by how much the nearest misses if none does."""
        if self.ranked:
            return self.ranked[0]
        limit = self.cluster.device_memory
        if self.nearest is None:
            raise ConfigError(f"no layout of {self.cluster.devices} devices can run {self.model.name}")
        need, available = fmt_over(self.nearest.memory.peak, limit)
        raise ConfigError(
            f"no layout of {self.model.name} fits {self.cluster.devices} devices of {available}: the nearest, "
            f"{self.nearest.layout.name()}, needs {need} per rank ({fmt_bytes(self.nearest.memory.peak - limit)} over; "
            "more devices, more memory, a smaller global batch or sequence would help)"
        )

    def reasons(self, index: int = 0) -> list[str]:
        """Why ``ranked[index]`` wins: against the next one and against each baseline."""
        a = self.ranked[index]
        out = []
        if index + 1 < len(self.ranked):
            out.append(why(a, self.ranked[index + 1], f"#{index + 2}", self))
        for name, b in self.baselines.items():
            if b is not None:
                out.append(why(a, b, name, self))
        return out

    def rows(self) -> list[Row]:
        rows = []
        shown = self.ranked[: self.top]
        for i, est in enumerate(shown):
            label = ", ".join(n for n, b in self.baselines.items() if b is not None and b.layout == est.layout)
            nxt = why(est, self.ranked[i + 1], f"#{i + 2}", self) if i + 1 < len(self.ranked) else "the last that fits"
            rows.append(Row(i + 1, est, label, nxt))
        best = self.ranked[0] if self.ranked else None
        for name, b in self.baselines.items():
            if b is None or any(b.layout == r.estimate.layout for r in rows):
                continue
            reason = why(best, b, name, self) if best is not None else "nothing fits"
            rows.append(Row(None, b, name, reason.removeprefix(f"vs {name}: ")))
        return rows

    def table(self, markdown: bool = False) -> str:
        """The ranked table (plain text, or markdown), baselines below the ranked rows."""
        head = ["rank", "layout", "peak mem/rank", "step", "samples/s", "comm exposed", "bubble", "fits", "why"]
        body = []
        for row in self.rows():
            e = row.estimate
            rank = str(row.rank) if row.rank is not None else ("paper" if row.label in self.reported else "base")
            name = e.layout.name() + (f" [{row.label}]" if row.label else "")
            body.append([rank, name, fmt_bytes(e.memory.peak), fmt_time(e.time.step), f"{e.samples_per_s:,.1f}",
                         fmt_time(e.time.exposed_comm), fmt_time(e.time.bubble), "yes" if e.fits else "NO", row.why])  # fmt: skip
        if markdown:
            lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            lines += ["| " + " | ".join(cell.replace("|", "/") for cell in r) + " |" for r in body]
            return "\n".join(lines)
        widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head) - 1)]
        fmt = "  ".join(f"{{:{'>' if i in (2, 3, 4, 5, 6) else '<'}{w}}}" for i, w in enumerate(widths)) + "  {}"
        return "\n".join(fmt.format(*r) for r in [head, *body])

    def summary(self) -> str:
        """One or two lines: the chosen layout, its prediction and why."""
        best = self.best
        head = (
            f"{best.layout.name()}: predicted {fmt_time(best.time.step)} a step, {best.samples_per_s:,.1f} samples/s, "
            f"{fmt_bytes(best.memory.peak)} per rank of {fmt_bytes(self.cluster.device_memory)}"
        )
        reasons = self.reasons(0)
        return head + ("\n  " + "; ".join(reasons) if reasons else "")


def plan(
    model: ModelSpec,
    cluster: Cluster,
    workload: Workload,
    *,
    top: int = 10,
    limits: Limits | None = None,
    baselines: Sequence[Baseline] | None = None,
) -> Plan:
    """Search the layouts of ``model`` on ``cluster`` for ``workload`` (see the module docstring).

    ``baselines``: named families shown beside the ranking (default: :func:`default_baselines`);
    a :class:`Baseline` with ``reported=True`` is a layout a paper reported."""
    limits = limits or Limits()
    start = time.perf_counter()
    found = search(model, cluster, workload, limits)
    families = list(default_baselines(model, cluster) if baselines is None else baselines)
    named = {b.name: best_of_family(model, cluster, workload, b, limits) for b in families}
    stats = found.stats
    stats.seconds = time.perf_counter() - start
    nearest = found.nearest_miss() if not found.fitting else None
    reported = frozenset(b.name for b in families if b.reported)
    return Plan(model, cluster, workload, found.fitting, named, stats, top, nearest, reported)
