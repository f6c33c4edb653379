"""The comm ledger of the tensor modes against their formulas, per (op, axis) and to the byte.

Every 2D / 2.5D Linear shape in both SUMMA forms with ``keep_blocks`` off and on, the LayerNorm
statistics, 3D's Linear with its gathered weight kept or gathered again, and a whole transformer
block in every mode, which is the sum of its layers' formulas (docs/tensor-parallel.md, "Costs").
Alongside, the activation bytes each setting saves for backward: what ``keep_blocks`` trades.

The formulas are written here from the algorithms, not taken from the code: ``E`` bytes per
element, sizes per rank padded as the layers pad them.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import pytest
import torch

from tessera import comm
from tessera.parallel.tensor import tp3d
from tessera.testing import use_layout
from tests.dist.test_tp2d import NARROWING, SHAPES, Setup

E = 4  # fp32
Costs = dict[tuple[str, str], Fraction]

LAYOUTS = {
    "2d": (4, dict(tensor=4, mode="2d")),
    "2.5d-d1": (4, dict(tensor=4, mode="2.5d", depth=1)),
    "2.5d-d2": (8, dict(tensor=8, mode="2.5d", depth=2)),
}
CUBE = dict(tensor=8, mode="3d")
INPUT, WEIGHT, OUTPUT = "3d_input", "3d_weight", "3d_output"


def ring(p: int) -> Fraction:
    return Fraction(p - 1, p)


def add(costs: Costs, op: str, axis: str, n: Fraction | int) -> None:
    if n:
        costs[(op, axis)] = costs.get((op, axis), Fraction(0)) + n


def merged(*parts: Costs) -> Costs:
    out: Costs = {}
    for part in parts:
        for (op, axis), n in part.items():
            add(out, op, axis, n)
    return out


def blocks(full: int, parts: int, groups: int = 1) -> int:
    """Units per rank of a dimension of ``groups`` fused parts, each padded and split ``parts`` ways."""
    return groups * math.ceil(full // groups / parts)


# ---- the formulas ------------------------------------------------------------------------------


def summa_linear(axes: tuple[str, str, str | None], q: int, d: int, tokens: int, fin: int, fout: int,
                 form: str, keep: bool, bias: bool = True, groups: int = 1) -> Costs:  # fmt: skip
    """One Linear forward + backward on a SUMMA grid: ``tokens`` rows of this rank's input block.
    "ab" moves X and W (the output stays), "abt" Y and W (the input stays); keep_blocks drops the
    second broadcast of what the forward received."""
    row, col, dep = axes
    x, y = tokens * blocks(fin, q) * E, tokens * blocks(fout, q, groups) * E
    w, b = blocks(fin, q) * blocks(fout, q, groups) * E, (blocks(fout, q, groups) * E if bias else 0)
    again = 1 if keep else 2
    c: Costs = {}
    add(c, "broadcast", col, again * (q - 1) * w)  # W blocks: forward (and for dX)
    add(c, "reduce", col, (q - 1) * w)  # dW shares
    if form == "ab":
        add(c, "broadcast", row, again * (q - 1) * x)  # X blocks: forward (and for dW)
        add(c, "reduce", row, (q - 1) * x)  # dX shares
    else:
        add(c, "reduce", row, (q - 1) * y)  # Y shares
        add(c, "broadcast", row, (q - 1) * y)  # dY blocks, once for dX and dW
    add(c, "all_reduce", col, 2 * ring(q) * b)  # bias gradient over the batch blocks
    if dep is not None:
        add(c, "all_reduce", dep, 2 * ring(d) * (w + b))  # parameter gradients over the grids
    return c


def summa_layer_norm(axes: tuple[str, str, str | None], q: int, d: int, tokens: int, hidden: int) -> Costs:
    """Mean and variance all-reduced along the row forward and backward ([tokens, 1] each), and the
    weight and bias gradients over the batch blocks."""
    row, col, dep = axes
    h = blocks(hidden, q) * E
    c: Costs = {}
    add(c, "all_reduce", row, 4 * 2 * ring(q) * tokens * E)
    add(c, "all_reduce", col, 2 * 2 * ring(q) * h)
    if dep is not None:
        add(c, "all_reduce", dep, 2 * 2 * ring(d) * h)
    return c


def summa_form(fin: int, fout: int, q: int, groups: int = 1) -> str:
    """The form a Linear takes by itself: the wider side stays put."""
    return "abt" if blocks(fout, q, groups) < blocks(fin, q) else "ab"


def cube_linear(q: int, tokens: int, fin: int, fout: int, keep: bool, bias: bool = True, groups: int = 1) -> Costs:
    """Agarwal's 3D Linear: ``tokens`` rows of this rank's batch block; in and out padded to
    multiples of q^2 (per part). Off, keep_blocks gathers the weight again in backward."""
    f_in, f_out = blocks(fin, q * q), blocks(fout, q * q, groups)
    x_o, w_o, y_o = tokens * q * f_in * E, q * f_out * q * f_in * E, tokens * q * f_out * E
    c: Costs = {}
    add(c, "all_gather", INPUT, ring(q) * x_o)
    add(c, "reduce_scatter", INPUT, ring(q) * x_o)
    add(c, "all_gather", WEIGHT, (1 if keep else 2) * ring(q) * w_o)
    add(c, "reduce_scatter", WEIGHT, ring(q) * w_o)
    add(c, "reduce_scatter", OUTPUT, ring(q) * y_o)
    add(c, "all_gather", OUTPUT, ring(q) * y_o)
    add(c, "all_reduce", WEIGHT, 2 * ring(q) * f_out * E if bias else 0)
    return c


def cube_layer_norm(q: int, tokens: int, hidden: int) -> Costs:
    """Mean, variance (forward) and the two gradient sums (backward) all-reduced over both hidden
    axes; weight and bias gradients over the batch blocks."""
    c: Costs = {}
    for axis in (INPUT, OUTPUT):
        add(c, "all_reduce", axis, 2 * ring(q) * (1 + 1 + 2) * tokens * E)
    add(c, "all_reduce", WEIGHT, 2 * 2 * ring(q) * blocks(hidden, q * q) * E)
    return c


# ---- measuring -------------------------------------------------------------------------------------


def _storage(t: torch.Tensor) -> tuple[int, int]:
    return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()


def measured(module: torch.nn.Module, x: torch.Tensor) -> tuple[Costs, int]:
    """Ledger of one forward and backward of ``module`` on ``x`` per (op, axis), and the bytes the
    forward saved for backward (parameters excluded)."""
    seen = {_storage(p) for p in module.parameters()}
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if _storage(t) not in seen:
            seen.add(_storage(t))
            saved += _storage(t)[1]
        return t

    with comm.ledger() as led:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = module(x)
        (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(20))).sum().backward()
    return {key: Fraction(v["bytes"]) for key, v in led.summary().items()}, saved


def _local_input(rows: int, seq: int, width: int) -> torch.Tensor:
    return torch.randn(rows, seq, width, generator=torch.Generator().manual_seed(19)).requires_grad_()


# ---- bodies ------------------------------------------------------------------------------------------


def body_summa_linear(layout: dict[str, Any], batch: int, seq: int, fin: int, fout: int, groups: int) -> bool:
    s = Setup(layout)
    q, d = s.q, s.parts // s.q
    axes = (s.hidden_axis, s.batch_axes[-1], s.dep_axis)
    rows = math.ceil(batch / s.parts)
    for form in ("ab", "abt"):
        for keep in (False, True):
            layer = s.layer("Linear", fin, fout, out_groups=groups, form=form, keep_blocks=keep)
            got, saved = measured(layer, _local_input(rows, seq, blocks(fin, q)))
            expected = summa_linear(axes, q, d, rows * seq, fin, fout, form, keep, groups=groups)
            assert got == expected, (form, keep, got, expected)
            x, w = rows * seq * blocks(fin, q) * E, blocks(fin, q) * blocks(fout, q, groups) * E
            # saved: X; kept, also the q-1 weight blocks received and, in "ab", the q-1 input blocks
            assert saved == x + keep * (q - 1) * (w + (x if form == "ab" else 0)), (form, keep, saved)
    return True


def body_summa_layer_norm(layout: dict[str, Any], batch: int, seq: int, hidden: int) -> bool:
    s = Setup(layout)
    rows = math.ceil(batch / s.parts)
    got, _ = measured(s.layer("LayerNorm", hidden), _local_input(rows, seq, blocks(hidden, s.q)))
    axes = (s.hidden_axis, s.batch_axes[-1], s.dep_axis)
    expected = summa_layer_norm(axes, s.q, s.parts // s.q, rows * seq, hidden)
    assert got == expected, (got, expected)
    return True


def body_cube(batch: int, seq: int, fin: int, fout: int, groups: int) -> bool:
    ctx = use_layout(**CUBE)
    q, rows = ctx.size(INPUT), math.ceil(batch / ctx.size(INPUT))
    for keep in (True, False):
        layer = tp3d.Linear3D(fin, fout, out_groups=groups, keep_blocks=keep, ctx=ctx)
        got, saved = measured(layer, _local_input(rows, seq, blocks(fin, q * q)))
        assert got == cube_linear(q, rows * seq, fin, fout, keep, groups=groups), (keep, got)
        x_o = rows * seq * q * blocks(fin, q * q) * E
        w_o = q * blocks(fout, q * q, groups) * q * blocks(fin, q * q) * E
        assert saved == x_o + keep * w_o, (keep, saved)  # the gathered input (and weight)
    got, _ = measured(tp3d.LayerNorm3D(fin, ctx=ctx), _local_input(rows, seq, blocks(fin, q * q)))
    assert got == cube_layer_norm(q, rows * seq, fin), got
    return True


def body_block(layout: dict[str, Any], batch: int, seq: int, hidden: int, ff: int) -> tuple[bool, int]:
    """A pre-norm transformer block built with tessera.nn (config's keep_blocks) against the sum of
    its layers' formulas; returns the bytes."""
    from tessera import nn as tnn
    from tessera.models.transformer import Block

    ctx = use_layout(**layout)
    torch.manual_seed(0)
    block = Block(hidden, 8, ff, 0.0, 1e-5, causal=True)
    x_full = torch.randn(batch, seq, hidden, generator=torch.Generator().manual_seed(1))
    x = tnn.split_activation(x_full).detach().requires_grad_()
    got, _ = measured(block, x)
    mode, keep = ctx.dims.tensor_mode, ctx.dims.keep_blocks
    linears = [(hidden, 3 * hidden, 3), (hidden, hidden, 1), (hidden, ff, 1), (ff, hidden, 1)]
    if mode == "1d":  # the col layers all-reduce dX, the row layers Y: [b, s, h] each
        expected: Costs = {("all_reduce", "tensor"): 4 * 2 * ring(ctx.size("tensor")) * batch * seq * hidden * E}
    elif mode == "3d":
        q = ctx.size(INPUT)
        tokens = math.ceil(batch / q) * seq
        parts = [cube_linear(q, tokens, i, o, keep, groups=g) for i, o, g in linears]
        expected = merged(*parts, *[cube_layer_norm(q, tokens, hidden)] * 2)
    else:
        grid = tnn.hidden_parts(), tnn.batch_parts()
        q, d = grid[0], grid[1] // grid[0]
        axes = ("2d_row", "2d_col", None) if mode == "2d" else ("2.5d_row", "2.5d_col", "2.5d_dep")
        tokens = math.ceil(batch / (d * q)) * seq
        parts = [summa_linear(axes, q, d, tokens, i, o, summa_form(i, o, q, g), keep, groups=g) for i, o, g in linears]
        expected = merged(*parts, *[summa_layer_norm(axes, q, d, tokens, hidden)] * 2)
    assert got == expected, (mode, keep, got, expected)
    return True, int(sum(got.values()))


# ---- tests ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("shape", SHAPES + NARROWING)
def test_summa_linear_ledger_per_axis_in_every_form(pools, name, shape, groups):
    world, layout = LAYOUTS[name]
    batch, seq, fin, fout = shape
    assert pools.run(world, body_summa_linear, layout, batch, seq, fin, groups * fout, groups) == [True] * world


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("hidden", [8, 15])
def test_summa_layer_norm_ledger_per_axis(pools, name, hidden):
    world, layout = LAYOUTS[name]
    assert pools.run(world, body_summa_layer_norm, layout, 5, 2, hidden) == [True] * world


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("shape", [(4, 3, 16, 32), (5, 2, 29, 50), (3, 2, 31, 23)])
def test_cube_linear_and_layer_norm_ledger_with_the_weight_kept_or_gathered_again(pools, shape, groups):
    batch, seq, fin, fout = shape
    assert pools.run(8, body_cube, batch, seq, fin, groups * fout, groups) == [True] * 8


BLOCK_LAYOUTS = {
    "1d-tp4": (4, dict(tensor=4, mode="1d")),
    "2d-tp4": (4, dict(tensor=4, mode="2d")),
    "2d-tp4-keep": (4, dict(tensor=4, mode="2d", keep_blocks=True)),
    "1d-tp8": (8, dict(tensor=8, mode="1d")),
    "2.5d-tp8-d2": (8, dict(tensor=8, mode="2.5d", depth=2)),
    "2.5d-tp8-d2-keep": (8, dict(tensor=8, mode="2.5d", depth=2, keep_blocks=True)),
    "3d-tp8": (8, dict(tensor=8, mode="3d")),
    "3d-tp8-keep": (8, dict(tensor=8, mode="3d", keep_blocks=True)),
}


@pytest.mark.parametrize("name", list(BLOCK_LAYOUTS))
def test_a_transformer_block_moves_the_sum_of_its_layers_formulas(pools, name):
    world, layout = BLOCK_LAYOUTS[name]
    results = pools.run(world, body_block, layout, 8, 3, 16, 64)
    assert all(ok for ok, _ in results) and len({n for _, n in results}) == 1
