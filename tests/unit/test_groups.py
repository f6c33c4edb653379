"""Group tables are pure functions of the layout: checked here without any process."""

from __future__ import annotations

import itertools

import pytest

from tessera.context import BASE_AXES, EXPERT_AXES, ParallelDims, group_table, group_tables
from tessera.errors import ConfigError

TENSOR_LAYOUTS = [
    ("1d", 1, 1), ("1d", 2, 1), ("1d", 4, 1), ("1d", 8, 1),
    ("2d", 4, 1), ("2d", 9, 1), ("2d", 16, 1),
    ("2.5d", 4, 1), ("2.5d", 8, 2), ("2.5d", 18, 2), ("2.5d", 16, 4),
    ("3d", 8, 1), ("3d", 27, 1),
]  # fmt: skip


def layouts(max_world: int = 32):
    for (mode, tp, depth), pp, sp in itertools.product(TENSOR_LAYOUTS, (1, 2, 4), (1, 2)):
        for dp in (1, 2, 4):
            world = dp * pp * sp * tp
            if world <= max_world:
                yield ParallelDims(world, dp, pp, sp, tp, mode, depth)
                if dp > 1 and mode == "1d":  # experts spread over part or all of the data axis
                    yield ParallelDims(world, dp, pp, sp, tp, mode, depth, expert=2)


ALL = list(layouts())


def test_enough_layouts_are_covered():
    modes = {d.tensor_mode for d in ALL}
    assert modes == {"1d", "2d", "2.5d", "3d"}
    assert max(d.world_size for d in ALL) == 32
    assert any(d.tensor_mode == "2.5d" and d.tensor_depth == 2 and d.pipeline > 1 and d.data > 1 for d in ALL)


@pytest.mark.parametrize(
    "dims",
    ALL,
    ids=lambda d: (
        f"w{d.world_size}-dp{d.data}-pp{d.pipeline}-sp{d.sequence}-{d.tensor_mode}{d.tensor}d{d.tensor_depth}"
        + (f"-ep{d.expert}" if d.expert > 1 else "")
    ),
)
def test_group_tables(dims: ParallelDims):
    tables = group_tables(dims)
    world = set(range(dims.world_size))
    # every axis partitions the world into groups of the axis size
    for axis, groups in tables.items():
        members = [r for g in groups for r in g]
        assert sorted(members) == sorted(world), axis
        assert all(len(g) == dims.axis_size(axis) for g in groups), axis
        assert all(list(g) == sorted(g) for g in groups)
    # groups of two independent axes through one rank meet only in that rank
    independent = [a for a in BASE_AXES if a != "tensor"]
    for a, b in itertools.combinations(independent, 2):
        for rank in range(dims.world_size):
            ga = next(g for g in tables[a] if rank in g)
            gb = next(g for g in tables[b] if rank in g)
            assert set(ga) & set(gb) == {rank}, (a, b, rank)
    # tensor sub-axes live inside the tensor group, expert ones inside the data group
    for sub in dims.axes[len(BASE_AXES) :]:
        parent = "data" if sub in EXPERT_AXES else "tensor"
        for g in tables[sub]:
            assert set(g) <= set(next(t for t in tables[parent] if g[0] in t))
    # the two expert sub-axes split the data group: their groups through a rank meet only there
    # and their sizes multiply to the data degree
    assert dims.axis_size("expert") * dims.axis_size("expert_data") == dims.data
    for rank in range(dims.world_size):
        ge = next(g for g in tables["expert"] if rank in g)
        gd = next(g for g in tables["expert_data"] if rank in g)
        assert set(ge) & set(gd) == {rank}
    check_rank_order(dims, tables)
    check_grid(dims, tables)


def check_rank_order(dims, tables):
    """Tensor innermost, then sequence, pipeline, data outermost."""
    tp, sp, pp = dims.tensor, dims.sequence, dims.pipeline
    assert tables["tensor"][0] == tuple(range(tp))
    assert tables["sequence"][0] == tuple(range(0, sp * tp, tp))
    assert tables["pipeline"][0] == tuple(range(0, pp * sp * tp, sp * tp))
    assert tables["data"][0] == tuple(range(0, dims.world_size, pp * sp * tp))


def check_grid(dims, tables):
    """2d/2.5d/3d sub-axes form the q x q grids and q x q x q cubes of their algorithms."""
    q = dims.tensor_q
    lines = lambda axis: {frozenset(g) for g in tables[axis]}
    for tensor_group in tables["tensor"]:
        t = list(tensor_group)
        if dims.tensor_mode == "2d":
            grid = [[t[i * q + j] for j in range(q)] for i in range(q)]
            assert {frozenset(row) for row in grid} <= lines("2d_row")
            assert {frozenset(col) for col in zip(*grid)} <= lines("2d_col")
        elif dims.tensor_mode == "2.5d":
            d = dims.tensor_depth
            grids = [[[t[k * q * q + i * q + j] for j in range(q)] for i in range(q)] for k in range(d)]
            for grid in grids:
                assert {frozenset(row) for row in grid} <= lines("2.5d_row")
                assert {frozenset(col) for col in zip(*grid)} <= lines("2.5d_col")
            stacks = {frozenset(grids[k][i][j] for k in range(d)) for i in range(q) for j in range(q)}
            assert stacks <= lines("2.5d_dep")
        elif dims.tensor_mode == "3d":
            cube = [[[t[w * q * q + n * q + o] for o in range(q)] for n in range(q)] for w in range(q)]
            r = range(q)
            assert {frozenset(cube[w][n][o] for o in r) for w in r for n in r} <= lines("3d_output")
            assert {frozenset(cube[w][n][o] for n in r) for w in r for o in r} <= lines("3d_input")
            assert {frozenset(cube[w][n][o] for w in r) for n in r for o in r} <= lines("3d_weight")


def test_expert_axes_split_data():
    """Experts spread over the innermost part of the data index: expert groups are consecutive
    data ranks, expert_data groups stride over them."""
    dims = ParallelDims(8, data=4, tensor=2, expert=2)
    assert group_table(dims, "data") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert group_table(dims, "expert") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert group_table(dims, "expert_data") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    single = ParallelDims(4, data=4)
    assert group_table(single, "expert") == [(0,), (1,), (2,), (3,)]
    assert group_table(single, "expert_data") == group_table(single, "data")
    with pytest.raises(ConfigError, match="must divide the data-parallel degree 4"):
        ParallelDims(8, data=4, tensor=2, expert=3)


def test_sub_axis_sizes():
    assert ParallelDims(8, tensor=8, tensor_mode="2.5d", tensor_depth=2).axis_size("2.5d_dep") == 2
    assert ParallelDims(8, tensor=8, tensor_mode="2.5d", tensor_depth=2).axis_size("2.5d_row") == 2
    assert ParallelDims(27, tensor=27, tensor_mode="3d").axis_size("3d_input") == 3
    assert ParallelDims(16, tensor=16, tensor_mode="2d").axis_size("2d_col") == 4


def test_explicit_small_tables():
    dims = ParallelDims(8, data=2, tensor=4, tensor_mode="2d")
    assert group_table(dims, "2d_row") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert group_table(dims, "2d_col") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert group_table(dims, "data") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert group_table(dims, ("data", "2d_row")) == [(0, 1, 4, 5), (2, 3, 6, 7)]
    dims = ParallelDims(8, tensor=8, tensor_mode="2.5d", tensor_depth=2)
    assert group_table(dims, "2.5d_dep") == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_axis_index_and_coordinates():
    dims = ParallelDims(16, data=2, pipeline=2, tensor=4, tensor_mode="2d")
    assert dims.coordinates(13) == {"data": 1, "pipeline": 1, "sequence": 0, "2d_i": 0, "2d_j": 1}
    assert dims.axis_index("2d_row", 13) == 1 and dims.axis_index("2d_col", 13) == 0
    assert dims.axis_index("tensor", 13) == 1 and dims.axis_index("pipeline", 13) == 1


def test_unknown_axis_and_bad_dims():
    dims = ParallelDims(4, tensor=4, tensor_mode="2d")
    with pytest.raises(KeyError, match="'3d_input' does not exist.*2d_row"):
        group_table(dims, "3d_input")
    with pytest.raises(ConfigError, match="does not divide world size 6"):
        ParallelDims(6, tensor=4)
    with pytest.raises(ConfigError, match="must be a cube"):
        ParallelDims(4, tensor=4, tensor_mode="3d")
