"""Cutting a model into pipeline parts: which layers each stage (or chunk) holds.

A model is a sequence of ``L`` blocks (:func:`blocks_of`). A pipeline of ``p`` stages with ``v``
chunks per rank cuts it into ``p * v`` contiguous, non-empty parts, numbered from input to loss;
rank ``r`` holds parts ``r, r+p, ..., r+(v-1)p`` (:func:`chunks_of_rank`). A cut is given as
*boundaries*: the first layer index of every part but the first, ``p*v - 1`` strictly increasing
integers in ``1 .. L-1``, as in the config field ``parallel.pipeline.boundaries``. Part ``k``
holds layers ``chunk_ranges(boundaries, L)[k] = (start, end)``, end exclusive.

Four ways to choose the cut (``parallel.pipeline.partition``): ``uniform`` (equal layer counts),
``parameters`` (balanced parameter counts), ``time`` (balanced measured forward+backward time)
and ``explicit`` (given boundaries, validated). The balanced ones minimise the heaviest part
exactly (:func:`partition_by_cost`).
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import torch
from torch import nn

from tessera.context.placement import full_numel
from tessera.errors import TesseraError

METHODS = ("uniform", "parameters", "time", "explicit")

Sample: TypeAlias = torch.Tensor | tuple[torch.Tensor, ...] | Callable[[], Any]
"""Input of the first layer: a tensor, a tuple of tensors, or a function returning one (called once)."""

Layers: TypeAlias = Sequence[nn.Module] | nn.ModuleList | nn.Sequential
"""The blocks to cut, in order from input to loss (:func:`blocks_of`)."""


class PartitionError(TesseraError, ValueError):
    """A model cannot be cut as asked: too few layers, bad boundaries, unknown method."""


def _check_parts(parts: int, num_layers: int) -> None:
    if parts < 1:
        raise PartitionError(f"a pipeline needs at least 1 part, got parts={parts}")
    if parts > num_layers:
        raise PartitionError(
            f"pipeline of {parts} parts (stages x chunks per rank) needs at least {parts} layers, "
            f"the model has {num_layers}: every stage and chunk holds at least one layer"
        )


def partition_by_cost(costs: Sequence[float], parts: int) -> list[int]:
    """Cut per-layer ``costs`` (length L, each finite and >= 0) into ``parts`` contiguous
    non-empty parts whose largest total cost is as small as possible; returns the ``parts - 1``
    boundaries (first layer index of every part but the first).

    Exact: the optimal bottleneck is one of the O(L^2) contiguous sums, found by binary search
    with a greedy feasibility test. Ties: among all optimal cuts, the one with the earliest
    boundaries (lexicographically smallest), so slack goes to the later parts and the early
    stages, which hold the most in-flight activations under 1F1B, stay the lightest.
    """
    costs = [float(c) for c in costs]
    num_layers = len(costs)
    _check_parts(parts, num_layers)
    bad = [i for i, c in enumerate(costs) if not (math.isfinite(c) and c >= 0)]
    if bad:
        raise PartitionError(f"layer costs must be finite and >= 0; layer {bad[0]} costs {costs[bad[0]]}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def span(start: int, end: int) -> float:
        # Every comparison uses this one expression, so the search and the cut agree to the last bit.
        return prefix[end] - prefix[start]

    def parts_needed(cap: float) -> list[int]:
        """needed[s]: fewest parts for layers s..L-1 under cap (greedy is optimal); L+1 if impossible."""
        needed = [num_layers + 1] * num_layers + [0]
        end = num_layers  # the farthest end of a first part from start; it only moves left as start does
        for start in range(num_layers - 1, -1, -1):
            while end > start and span(start, end) > cap:
                end -= 1
            if end > start:
                needed[start] = min(num_layers + 1, 1 + needed[end])
        return needed

    # The optimal bottleneck is one of these sums; the largest (the whole model in one part) always fits.
    candidates = sorted({span(i, j) for i in range(num_layers) for j in range(i + 1, num_layers + 1)})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if parts_needed(candidates[mid])[0] <= parts:
            hi = mid
        else:
            lo = mid + 1
    cap = candidates[lo]

    # Earliest cut: each boundary at the first place from which the rest still fits in the parts left.
    needed = parts_needed(cap)
    boundaries: list[int] = []
    start = 0
    for k in range(parts - 1):
        left = parts - k - 1
        end = next(e for e in range(start + 1, num_layers - left + 1) if span(start, e) <= cap and needed[e] <= left)
        boundaries.append(end)
        start = end
    return boundaries


def uniform(num_layers: int, parts: int) -> list[int]:
    """Equal layer counts; the first ``num_layers % parts`` parts hold one layer more.

    ``uniform(10, 4) == [3, 6, 8]`` (parts of 3, 3, 2, 2 layers)."""
    _check_parts(parts, num_layers)
    size, extra = divmod(num_layers, parts)
    boundaries, start = [], 0
    for k in range(parts - 1):
        start += size + (1 if k < extra else 0)
        boundaries.append(start)
    return boundaries


def _numel(param: torch.Tensor) -> int:
    # A tensor-parallel shard counts as its full parameter, so a cut does not depend on the layout.
    return full_numel(param)


def parameter_counts(layers: Layers) -> list[int]:
    """Parameter elements of each layer; a parameter shared by several layers counts in the first."""
    seen: set[int] = set()
    counts = []
    for layer in layers:
        count = 0
        for param in layer.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                count += _numel(param)
        counts.append(count)
    return counts


def by_parameters(layers: Layers, parts: int) -> list[int]:
    """Boundaries balancing parameter counts (:func:`parameter_counts`) over ``parts`` parts."""
    return partition_by_cost(parameter_counts(layers), parts)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    raise TypeError(f"layer inputs and outputs must be tensors or tuples of tensors, got {type(value).__name__}")


def _detached(value: Any) -> Any:
    """The value cut from its graph; floating tensors require grad so the backward reaches them."""
    if isinstance(value, torch.Tensor):
        out = value.detach()
        return out.requires_grad_(True) if out.is_floating_point() else out
    if isinstance(value, (tuple, list)):
        return tuple(_detached(v) for v in value)
    return value


def _synchronize(tensors: Sequence[torch.Tensor]) -> None:
    if any(t.is_cuda for t in tensors):
        torch.cuda.synchronize()


def _forward_backward(layer: nn.Module, inputs: Any) -> tuple[float, Any]:
    """Seconds of one forward and backward of ``layer`` on ``inputs``, and its output.

    The backward uses ``torch.autograd.grad``, so no ``.grad`` of the model is touched."""
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    _synchronize(_tensors(args))
    begin = time.perf_counter()
    output = layer(*args)
    outs = [t for t in _tensors(output) if t.requires_grad]
    wrt = [t for t in _tensors(args) if t.requires_grad] + [p for p in layer.parameters() if p.requires_grad]
    if outs and wrt:
        torch.autograd.grad(outs, wrt, [torch.ones_like(t) for t in outs], allow_unused=True)
    _synchronize(outs or _tensors(args))
    return time.perf_counter() - begin, output


def layer_times(layers: Layers, sample: Sample, repeats: int = 3, warmup: int = 1) -> list[float]:
    """Median seconds of forward + backward of each layer, run in order on ``sample`` (each layer
    fed the previous one's output), after ``warmup`` untimed runs; ``repeats`` timed runs."""
    if repeats < 1:
        raise PartitionError(f"repeats={repeats} must be at least 1")
    inputs = _detached(sample() if callable(sample) else sample)
    times = []
    with torch.enable_grad():
        for layer in layers:
            for _ in range(warmup):
                _forward_backward(layer, inputs)
            runs = [_forward_backward(layer, inputs) for _ in range(repeats)]
            times.append(statistics.median(seconds for seconds, _ in runs))
            inputs = _detached(runs[-1][1])
    return times


def by_time(layers: Layers, parts: int, sample: Sample, repeats: int = 3) -> list[int]:
    """Boundaries balancing measured forward + backward time (:func:`layer_times`) over ``parts``."""
    _check_parts(parts, len(layers))
    return partition_by_cost(layer_times(layers, sample, repeats), parts)


def explicit(boundaries: Sequence[int], num_layers: int, parts: int) -> list[int]:
    """Check given boundaries: ``parts - 1`` strictly increasing integers in ``1 .. num_layers - 1``."""
    _check_parts(parts, num_layers)
    bounds = list(boundaries)
    if len(bounds) != parts - 1:
        raise PartitionError(f"{parts} parts need {parts - 1} boundaries, got {len(bounds)}: {bounds}")
    if any(not isinstance(b, int) or isinstance(b, bool) for b in bounds):
        raise PartitionError(f"boundaries must be integers, got {bounds}")
    if any(b <= a for a, b in itertools.pairwise(bounds)):
        raise PartitionError(f"boundaries {bounds} must be strictly increasing (every part holds a layer)")
    if bounds and not (1 <= bounds[0] and bounds[-1] <= num_layers - 1):
        raise PartitionError(f"boundaries {bounds} must lie in 1..{num_layers - 1} for a model of {num_layers} layers")
    return bounds


def partition(
    layers: Layers,
    parts: int,
    method: str,
    boundaries: Sequence[int] | None = None,
    sample: Sample | None = None,
) -> list[int]:
    """Boundaries cutting ``layers`` into ``parts`` (stages x chunks per rank) by ``method``, one of
    ``uniform``, ``parameters``, ``time`` (needs ``sample``, the first layer's input) or
    ``explicit`` (needs ``boundaries``) -- the values of ``parallel.pipeline.partition``."""
    if method not in METHODS:
        raise PartitionError(f"unknown partition method {method!r}; methods: {', '.join(METHODS)}")
    if boundaries is not None and method != "explicit":
        raise PartitionError(f"boundaries are only used with method 'explicit' (method is {method!r})")
    if method == "uniform":
        return uniform(len(layers), parts)
    if method == "parameters":
        return by_parameters(layers, parts)
    if method == "time":
        if sample is None:
            raise PartitionError("method 'time' needs a sample input of the first layer to time the layers on")
        return by_time(layers, parts, sample)
    if boundaries is None:
        raise PartitionError(f"method 'explicit' needs boundaries: {parts - 1} increasing layer indices")
    return explicit(boundaries, len(layers), parts)


def chunk_ranges(boundaries: Sequence[int], num_layers: int) -> list[tuple[int, int]]:
    """``(start, end)`` layer range of each part, end exclusive: ``chunk_ranges([3, 6], 8) ==
    [(0, 3), (3, 6), (6, 8)]``."""
    explicit(boundaries, num_layers, len(boundaries) + 1)
    edges = [0, *boundaries, num_layers]
    return list(itertools.pairwise(edges))


def chunks_of_rank(rank: int, p: int, v: int = 1) -> list[int]:
    """Parts held by pipeline rank ``rank`` of ``p`` with ``v`` chunks each: ``r, r+p, ..., r+(v-1)p``."""
    if p < 1 or v < 1:
        raise PartitionError(f"p={p} stages and v={v} chunks per rank must both be at least 1")
    if not 0 <= rank < p:
        raise PartitionError(f"rank {rank} is not a pipeline rank of {p} (0..{p - 1})")
    return [rank + k * p for k in range(v)]


def blocks_of(model: nn.Module) -> nn.ModuleList | nn.Sequential:
    """The model's sequence of blocks to cut: an ``nn.Sequential`` itself, else its ``blocks``,
    ``layers`` or ``h`` ModuleList (``tessera.models`` GPT and ViT have ``blocks``)."""
    if isinstance(model, nn.Sequential):
        return model
    for name in ("blocks", "layers", "h"):
        blocks = getattr(model, name, None)
        if isinstance(blocks, (nn.ModuleList, nn.Sequential)):
            return blocks
    raise TypeError(
        f"cannot find the blocks of {type(model).__name__} to cut into pipeline stages: the model must be an "
        "nn.Sequential or have an nn.ModuleList attribute named 'blocks', 'layers' or 'h'"
    )
