"""Cutting models into pipeline parts: the cost split is optimal (checked against brute force) with
earliest boundaries on ties, every method gives valid boundaries, bad input raises a clear error."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from tessera.models import gpt
from tessera.parallel.pipeline.partition import (
    PartitionError,
    blocks_of,
    by_parameters,
    by_time,
    chunk_ranges,
    chunks_of_rank,
    explicit,
    parameter_counts,
    partition,
    partition_by_cost,
    uniform,
)


def bottleneck(costs: list[float], boundaries: list[int]) -> float:
    return max(sum(costs[a:b]) for a, b in chunk_ranges(boundaries, len(costs)))


def brute_force(costs: list[float], parts: int) -> tuple[float, list[int]]:
    """Smallest bottleneck over all cuts, and the earliest (lexicographically smallest) cut reaching it."""
    best: tuple[float, list[int]] | None = None
    for cut in itertools.combinations(range(1, len(costs)), parts - 1):
        value = bottleneck(costs, list(cut))
        if best is None or value < best[0]:
            best = (value, list(cut))
    assert best is not None
    return best


def test_partition_by_cost_is_optimal_and_earliest_against_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(300):
        num_layers = rng.randint(1, 9)
        parts = rng.randint(1, num_layers)
        # Small integers make ties common, so the tie-break is exercised as much as optimality.
        costs = [float(rng.randint(0, 6)) for _ in range(num_layers)]
        got = partition_by_cost(costs, parts)
        value, earliest = brute_force(costs, parts)
        assert len(got) == parts - 1
        assert bottleneck(costs, got) == value, (costs, parts, got)
        assert got == earliest, (costs, parts, got)


def test_partition_by_cost_random_float_costs() -> None:
    rng = random.Random(1)
    for _ in range(100):
        num_layers = rng.randint(2, 8)
        parts = rng.randint(2, num_layers)
        costs = [rng.uniform(0.0, 10.0) for _ in range(num_layers)]
        assert bottleneck(costs, partition_by_cost(costs, parts)) == pytest.approx(brute_force(costs, parts)[0])


def test_partition_by_cost_examples() -> None:
    assert partition_by_cost([1, 1, 1, 1], 2) == [2]
    assert partition_by_cost([10, 1, 1, 1, 1], 2) == [1]
    assert partition_by_cost([1, 1, 1, 1, 10], 3) == [1, 4]  # ties: earliest boundaries, lighter early parts
    assert partition_by_cost([5.0], 1) == []
    assert partition_by_cost([0, 0, 0], 3) == [1, 2]


def test_partition_by_cost_errors() -> None:
    with pytest.raises(ValueError, match="needs at least 5 layers, the model has 4"):
        partition_by_cost([1, 1, 1, 1], 5)
    with pytest.raises(ValueError, match="at least 1 part"):
        partition_by_cost([1, 1], 0)
    with pytest.raises(ValueError, match="finite and >= 0; layer 1"):
        partition_by_cost([1, -1], 1)
    with pytest.raises(ValueError, match="finite"):
        partition_by_cost([1, float("nan")], 1)


def test_uniform_gives_the_extra_layers_to_the_first_parts() -> None:
    assert uniform(8, 4) == [2, 4, 6]
    assert uniform(10, 4) == [3, 6, 8]
    assert uniform(5, 5) == [1, 2, 3, 4]
    assert uniform(7, 1) == []
    sizes = [b - a for a, b in chunk_ranges(uniform(11, 3), 11)]
    assert sizes == [4, 4, 3]
    with pytest.raises(PartitionError, match="needs at least 4 layers, the model has 3"):
        uniform(3, 4)


def test_by_parameters_balances_uneven_layers() -> None:
    # Weights of 16x16, 16x16, 16x64, 64x16, 16x16: one wide pair in the middle.
    widths = [16, 16, 16, 64, 16, 16]
    model = nn.Sequential(*(nn.Linear(a, b, bias=False) for a, b in itertools.pairwise(widths)))
    counts = parameter_counts(model)
    assert counts == [256, 256, 1024, 1024, 256]
    boundaries = by_parameters(model, 2)
    assert boundaries == [3]  # 256+256+1024 | 1024+256
    assert by_parameters(model, 3) == [1, 3]  # 256 | 1280 | 1280; [2, 3] is as good but later
    assert max(sum(counts[a:b]) for a, b in chunk_ranges(by_parameters(model, 3), 5)) == 1280
    assert max(sum(counts[a:b]) for a, b in chunk_ranges(uniform(5, 3), 5)) == 2048


def test_by_parameters_counts_a_shared_parameter_in_its_first_layer() -> None:
    first, second = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
    second.weight = first.weight
    layers = [first, second, nn.Linear(8, 8, bias=False)]
    assert parameter_counts(layers) == [64, 0, 64]


def test_by_time_gives_the_expensive_layer_its_own_stage() -> None:
    torch.manual_seed(0)
    small, big = 8, 1024
    layers = nn.Sequential(
        nn.Linear(small, small),
        nn.Linear(small, small),
        nn.Linear(small, big),
        nn.Sequential(*(nn.Linear(big, big) for _ in range(8))),  # ~500x the time of the rest together
        nn.Linear(big, small),
        nn.Linear(small, small),
    )
    sample = torch.randn(256, small)
    boundaries = by_time(layers, 3, sample, repeats=3)
    assert len(boundaries) == 2
    ranges = chunk_ranges(boundaries, len(layers))
    assert (3, 4) in ranges, ranges
    params_before = [p.grad for p in layers.parameters()]
    assert all(g is None for g in params_before)  # timing leaves no gradients behind
    assert (3, 4) in chunk_ranges(partition(layers, 3, "time", sample=lambda: sample), len(layers))


def test_explicit_validates() -> None:
    assert explicit([2, 5], 8, 3) == [2, 5]
    assert explicit([], 8, 1) == []
    with pytest.raises(PartitionError, match="3 parts need 2 boundaries, got 1"):
        explicit([4], 8, 3)
    with pytest.raises(PartitionError, match="strictly increasing"):
        explicit([5, 5], 8, 3)
    with pytest.raises(PartitionError, match="strictly increasing"):
        explicit([5, 2], 8, 3)
    with pytest.raises(PartitionError, match=r"must lie in 1\.\.7"):
        explicit([0, 4], 8, 3)
    with pytest.raises(PartitionError, match=r"must lie in 1\.\.7"):
        explicit([4, 8], 8, 3)
    with pytest.raises(PartitionError, match="integers"):
        explicit([2.5, 4], 8, 3)  # type: ignore[list-item]


def test_partition_dispatches_and_checks_its_arguments() -> None:
    layers = nn.Sequential(*(nn.Linear(4, 4) for _ in range(6)))
    assert partition(layers, 3, "uniform") == [2, 4]
    assert partition(layers, 3, "parameters") == [2, 4]
    assert partition(layers, 3, "explicit", boundaries=[1, 5]) == [1, 5]
    with pytest.raises(PartitionError, match="unknown partition method 'even'"):
        partition(layers, 3, "even")
    with pytest.raises(PartitionError, match="needs boundaries"):
        partition(layers, 3, "explicit")
    with pytest.raises(PartitionError, match="only used with method 'explicit'"):
        partition(layers, 3, "uniform", boundaries=[1, 5])
    with pytest.raises(PartitionError, match="needs a sample"):
        partition(layers, 3, "time")
    with pytest.raises(ValueError, match="pipeline of 8 parts .* needs at least 8 layers, the model has 6"):
        partition(layers, 8, "parameters")


def test_chunk_ranges() -> None:
    assert chunk_ranges([3, 6], 8) == [(0, 3), (3, 6), (6, 8)]
    assert chunk_ranges([], 4) == [(0, 4)]


def test_chunks_of_rank_interleaved() -> None:
    assert [chunks_of_rank(r, 4, 2) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert chunks_of_rank(2, 4) == [2]
    held = sorted(c for r in range(4) for c in chunks_of_rank(r, 4, 3))
    assert held == list(range(12))
    with pytest.raises(PartitionError, match="rank 4 is not a pipeline rank of 4"):
        chunks_of_rank(4, 4, 2)
    with pytest.raises(PartitionError, match="at least 1"):
        chunks_of_rank(0, 4, 0)


def test_blocks_of() -> None:
    model = gpt("tiny", n_layers=4)
    blocks = blocks_of(model)
    assert blocks is model.blocks and len(blocks) == 4
    assert partition(blocks, 2, "parameters") == [2]
    assert partition(blocks, 4, "parameters") == [1, 2, 3]

    sequential = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert blocks_of(sequential) is sequential

    class Layered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(2, 2)])

    assert len(blocks_of(Layered())) == 1
    with pytest.raises(TypeError, match="must be an nn.Sequential or have an nn.ModuleList attribute named 'blocks'"):
        blocks_of(nn.Linear(2, 2))
