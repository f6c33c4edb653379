"""The layout search: every layout of the cluster's devices that can run, pruned early and cheaply,
estimated (:func:`tessera.planner.estimate`), ranked by predicted step time, and explained.

Three modules: the candidates (``enumeration.py``: the limits, shapes, schedules and micro-batch
sizes), the search over them (here: pruning, estimating, ranking, the baselines and :func:`plan`),
and the explanation (``explanation.py``: the table, the reasons, the counts). This module also
gives the names of the other two that callers import from it.

The search walks *shapes* (data, tensor with its mode, sequence with its mode, pipeline: their
product is the device count), then each shape's ZeRO stage and offload, pipeline schedule,
micro-batch size and activation checkpointing, the micro-batch count following from the global
batch. It never estimates a layout that cannot run (divisibility of heads, hidden width, layers,
batch and sequence by the split; a combination the layout rules refuse: :meth:`Layout.problems`,
``tessera.context.rules``), nor one whose model states alone,
divided as evenly as the layout allows, exceed the device memory. Without ``exhaustive`` it also
skips *dominated* layouts: a heavier checkpointing or an optimizer offload of a layout that fits
without it only adds time (recomputation, host copies), and GPipe with at least as many
micro-batches as stages is 1F1B's bubble and traffic with more micro-batches in flight.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from tessera.context.rules import Combination, refusals
from tessera.planner.adapters import frozen_bytes, trainable_parameters
from tessera.planner.enumeration import (
    CHECKPOINTING,
    DEFAULT_SEQUENCE_MODES,
    SCHEDULES,
    SEQUENCE_MODES,
    TENSOR_MODES,
    Limits,
    batch_parts,
    divisors,
    layout_problems,
    micro_batches,
    schedules_of,
    sequence_fits,
    shapes,
    tensor_variants,
)
from tessera.planner.estimate import Estimate, MemoryEstimate, estimate
from tessera.planner.explanation import GIB, Plan, Row, SearchStats, fmt_bytes, fmt_over, fmt_time, why
from tessera.planner.layout import Layout, Schedule
from tessera.planner.spec import Cluster, ModelSpec, Workload

__all__ = [
    "CHECKPOINTING",
    "DEFAULT_SEQUENCE_MODES",
    "GIB",
    "SCHEDULES",
    "SEQUENCE_MODES",
    "TENSOR_MODES",
    "Baseline",
    "Limits",
    "Plan",
    "Row",
    "SearchStats",
    "batch_parts",
    "best_of_family",
    "default_baselines",
    "divisors",
    "fmt_bytes",
    "fmt_over",
    "fmt_time",
    "layout_problems",
    "micro_batches",
    "plan",
    "rank_key",
    "schedules_of",
    "search",
    "sequence_fits",
    "shapes",
    "tensor_variants",
    "why",
]


@dataclass(frozen=True)
class Baseline:
    """A named family of layouts shown beside the ranking: its best member (fastest that fits,
    else the one needing least memory) is found whether or not it fits. ``pins`` fix fields of
    :class:`Layout` (``"data": "world"`` means all devices); ``limits`` narrow the rest."""

    name: str
    pins: dict[str, Any]
    reported: bool = False  # a layout a paper reported (shown as such)


SHAPE_FIELDS = ("data", "tensor", "tensor_mode", "depth", "sequence_parallel", "pipeline", "sequence", "sequence_mode")


class _Search:
    """One search over a model, cluster and workload; keeps every estimate it makes."""

    def __init__(self, model: ModelSpec, cluster: Cluster, workload: Workload, limits: Limits) -> None:
        self.model, self.cluster, self.workload, self.limits = model, cluster, workload, limits
        self.params = trainable_parameters(model)  # what gets gradients and optimizer states
        self.frozen = frozen_bytes(model)  # LoRA's frozen base: weights only, never data-sharded
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
        if refusals(Combination(pipeline=shape.pipeline, zero=zero), ("strategy",)):  # e.g. ZeRO-2/3 with stages
            return []
        choices = [False, True] if zero and self.limits.offload else [False]
        if shape.data == 1 and zero:
            choices = [True] if zero == 1 and self.limits.offload else []
        return choices

    def states_floor(self, shape: Layout, zero: int, offload: bool) -> float:
        """A lower bound of the fullest rank's model-state bytes: its share were the parameters split
        perfectly evenly by tensor and pipeline, in the compute dtype, the fp32 optimizer moments on
        the device unless offloaded, each divided over the data axis as ZeRO's stage shards it; a
        frozen base's weights split by tensor and pipeline only."""
        split = shape.splits[0] * shape.pipeline
        share = self.params / split
        e, d = self.workload.element_bytes, shape.data
        weights = share * e / (d if zero >= 3 else 1)
        grads = share * e / (d if zero >= 2 else 1)
        moments = 0.0 if offload else share * 4 * self.workload.optimizer_states / (d if zero >= 1 else 1)
        return 0.999 * (weights + grads + moments + self.frozen / split)

    def walk_group(self, shape: Layout, zero: int, offloads: list[bool]) -> None:
        """Schedules and micro-batch sizes of one shape and ZeRO stage. Memory grows with the
        micro-batch while several accumulate (the gradients of a step of one micro-batch are not
        kept alongside its activations), so a variant over memory is not tried at larger sizes
        except the one-micro-batch step; and when every checkpointing of the smallest micro-batch is
        over memory with offload (if any), so is every other variant."""
        per_replica = self.workload.global_batch // shape.data
        for schedule, chunks in schedules_of(self.model, shape, self.limits):
            sizes = micro_batches(per_replica, shape, schedule, self.limits, chunks)
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
