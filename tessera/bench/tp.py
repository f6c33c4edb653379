"""``tessera bench tp``: one transformer block (hidden 1024) in every tensor-parallel mode.

Per mode and world size: step time (forward, backward, SGD step), model-state bytes per rank,
activation bytes per rank (the tensors saved for backward, through saved-tensor hooks) and
communicated bytes per step (the comm ledger). 1D runs against torch's own
``parallelize_module`` (ColwiseParallel / RowwiseParallel on the same block), in alternating
blocks of steps in the same pool; the other modes are reported against tessera's 1D on the same
ranks.

Without ``tokens`` the rows are the table of docs/benchmarks.md at ``[4, 32, 1024]``, each mode as
it ran before ``parallel.tensor.keep_blocks``: 2D and 2.5D send their SUMMA blocks again in
backward, 3D keeps its gathered weight. With ``tokens`` (batch x sequence per tensor group, the
sequence fixed at 32) every mode runs at every token count with ``keep_blocks`` off and on
(``-keep`` marks the rows of 2D/2.5D with it on, ``-regather`` those of 3D with it off), and
:func:`crossover_rows` derives from the ``comm_bytes`` rows the token count past which each mode
moves fewer bytes than 1D on the same ranks.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tessera.bench.pools import rank_pool
from tessera.bench.report import Row, print_rows, write_rows
from tessera.bench.timing import alternate
from tessera.errors import ConfigError

if TYPE_CHECKING:
    from tessera.testing import PoolSet

HIDDEN = 1024
HEADS = 16


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor counts its local shard
    return local.untyped_storage().data_ptr(), local.untyped_storage().nbytes()


def _saved_bytes(fn: Any, module: nn.Module) -> tuple[Any, int]:
    """Run ``fn()`` counting the bytes of every tensor autograd saves for backward, parameters
    of ``module`` excluded (they are model state, not activations)."""
    total = 0
    seen: set[tuple[int, int]] = {_storage_key(p) for p in module.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        key = _storage_key(t)
        if key not in seen:
            seen.add(key)
            total += key[1]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total


def _repeat(step: Any, steps: int) -> None:
    for _ in range(steps):
        step()


def _block() -> nn.Module:
    from tessera.models.transformer import Block

    torch.manual_seed(0)
    return Block(HIDDEN, HEADS, 4 * HIDDEN, 0.0, 1e-5, causal=True)


def _rank_body(
    layout: dict[str, Any], batch: int, seq: int, blocks: int, steps: int, with_torch: bool
) -> dict[str, Any]:
    from tessera import comm
    from tessera import nn as tnn
    from tessera.memory import model_state_bytes
    from tessera.testing import use_layout

    ctx = use_layout(**layout)
    world = ctx.group("world")
    block = _block()
    opt = torch.optim.SGD(block.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x_full = torch.randn(batch, seq, HIDDEN, generator=g)
    x = tnn.split_activation(x_full).requires_grad_()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        block(x).square().mean().backward()
        opt.step()

    step()  # warm-up
    _, activation = _saved_bytes(lambda: block(x), block)
    with comm.ledger() as led:
        step()
    result: dict[str, Any] = {
        "param_bytes": model_state_bytes(block)["parameters"],
        "activation_bytes": activation,
        "comm_bytes": led.bytes(),
    }
    if not with_torch:
        result["times"] = alternate({"tessera": lambda: _repeat(step, steps)}, blocks, steps, world)["tessera"]
        return result

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from tessera.context import set_context

    set_context(None)  # build the reference block with plain torch layers
    ref = _block()
    set_context(ctx)
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    plan = {"attn.qkv": ColwiseParallel(), "attn.out": RowwiseParallel(),
            "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}  # fmt: skip
    parallelize_module(ref, mesh, plan)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-3)
    x_ref = x_full.clone().requires_grad_()

    def ref_step() -> None:
        ref_opt.zero_grad(set_to_none=True)
        ref(x_ref).square().mean().backward()
        ref_opt.step()

    ref_step()
    _, result["torch_activation_bytes"] = _saved_bytes(lambda: ref(x_ref), ref)
    times = alternate({"tessera": lambda: _repeat(step, steps), "torch": lambda: _repeat(ref_step, steps)},
                      blocks, steps, world)  # fmt: skip
    result["times"], result["torch_times"] = times["tessera"], times["torch"]
    return result


CASES: list[tuple[str, int, dict[str, Any]]] = [
    ("1d", 4, dict(tensor=4, mode="1d")),
    ("2d", 4, dict(tensor=4, mode="2d")),
    ("2.5d-d1", 4, dict(tensor=4, mode="2.5d", depth=1)),
    ("1d", 8, dict(tensor=8, mode="1d")),
    ("2.5d-d2", 8, dict(tensor=8, mode="2.5d", depth=2)),
    ("3d", 8, dict(tensor=8, mode="3d", keep_blocks=True)),
]

# the token sweep: each mode with keep_blocks off and on
SWEEP: list[tuple[str, int, dict[str, Any]]] = [
    ("1d", 4, dict(tensor=4, mode="1d")),
    ("2d", 4, dict(tensor=4, mode="2d")),
    ("2d-keep", 4, dict(tensor=4, mode="2d", keep_blocks=True)),
    ("1d", 8, dict(tensor=8, mode="1d")),
    ("2.5d-d2", 8, dict(tensor=8, mode="2.5d", depth=2)),
    ("2.5d-d2-keep", 8, dict(tensor=8, mode="2.5d", depth=2, keep_blocks=True)),
    ("3d-regather", 8, dict(tensor=8, mode="3d")),
    ("3d", 8, dict(tensor=8, mode="3d", keep_blocks=True)),
]

# crossover token counts of the seed code (A B in every Linear, SUMMA blocks and 3D weight sent
# again or kept as above), measured with the comm ledger on this block (issue #13); the ledger
# formulas of tests/dist/test_tp_ledger.py give the same numbers
SEED_CROSSOVER = {"2d": 12_361, "2.5d-d2": 2_813, "3d": 1_028}

_NAME = re.compile(r"^block h(\d+) (\S+) tp(\d+) b(\d+)x(\d+)$")


def _label(case: str, world: int, batch: int, seq: int) -> str:
    return f"block h{HIDDEN} {case} tp{world} b{batch}x{seq}"


def _timing(tokens: int, blocks: int, steps: int) -> tuple[int, int]:
    """Blocks and steps per block at ``tokens``: fewer where a step takes seconds."""
    if tokens <= 128:
        return blocks, steps
    return (4, 1) if tokens <= 1024 else (2, 1)


def _measure(cases: list[tuple[str, int, dict[str, Any]]], world: int, batch: int, seq: int, blocks: int,
             steps: int, pool: Any) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Each case of this world size on ``pool``, or with ``pool`` None on a pool of its own (large
    batches: processes keep the memory of earlier cases, and eight of them share the machine)."""
    from tessera.testing import RankPool

    measured = {}
    for name, size, layout in cases:
        if size != world:
            continue
        print(f"  {name} tp{world} b{batch}x{seq}", file=sys.stderr, flush=True)
        with_torch = layout["mode"] == "1d"
        own = RankPool(world) if pool is None else None
        try:
            runner = own or pool
            measured[name] = runner.run(_rank_body, layout, batch, seq, blocks, steps, with_torch, timeout=3600)[0]
        finally:
            if own is not None:
                own.close()
    return measured


def _rows(measured: dict[str, dict[str, Any]], world: int, batch: int, seq: int, params: bool) -> list[Row]:
    base = measured["1d"]
    full_param_bytes = 4 * sum(p.numel() for p in _block().parameters())
    rows: list[Row] = []
    for name, result in measured.items():
        label = _label(name, world, batch, seq)
        t = statistics.median(result["times"])
        if name == "1d":
            rows.append(
                Row(label, "step_time_s", t, "torch parallelize_module", statistics.median(result["torch_times"]))
            )
            rows.append(Row(label, "activation_bytes", result["activation_bytes"], "torch parallelize_module",
                            result["torch_activation_bytes"]))  # fmt: skip
        else:
            rows.append(Row(label, "step_time_s", t, f"tessera 1d tp{world}", statistics.median(base["times"])))
            rows.append(Row(label, "activation_bytes", result["activation_bytes"], f"tessera 1d tp{world}",
                            base["activation_bytes"]))  # fmt: skip
        if params:
            rows.append(Row(label, "param_bytes", result["param_bytes"], "single device", full_param_bytes))
        rows.append(Row(label, "comm_bytes", result["comm_bytes"], f"tessera 1d tp{world}", base["comm_bytes"]))
    return rows


def crossover_rows(rows: list[Row]) -> list[Row]:
    """For each mode in ``rows``, the token count (batch x sequence) past which its ``comm_bytes``
    fall below 1D's on the same ranks. Both are affine in the tokens (a weight term plus a
    per-token term): the line through each mode's smallest and largest token count, which must
    pass through the others, against 1D's. No row where the mode never gets below 1D."""
    points: dict[tuple[str, int], dict[int, float]] = {}
    for row in rows:
        match = _NAME.match(row.name)
        if row.metric == "comm_bytes" and match:
            case, world, batch, seq = match[2], int(match[3]), int(match[4]), int(match[5])
            points.setdefault((case, world), {})[batch * seq] = row.value
    out = []
    for (case, world), line in sorted(points.items()):
        base = points.get(("1d", world))
        if case == "1d" or base is None or len(line) < 2 or base.keys() != line.keys():
            continue
        a, b = _affine(line, case)
        a1, b1 = _affine(base, "1d")
        if b >= b1:
            continue  # never cheaper than 1D as the tokens grow
        crossing = max(0.0, (a - a1) / (b1 - b))
        mode = case.removesuffix("-keep").removesuffix("-regather")
        seed = SEED_CROSSOVER.get(mode)
        if seed is not None:
            name = f"block h{HIDDEN} {case} tp{world}"
            out.append(Row(name, "crossover_tokens", crossing, "seed: A B, issue #13", seed))
    return out


def _affine(line: dict[int, float], case: str) -> tuple[float, float]:
    """``(a, b)`` of ``bytes = a + b * tokens`` through the smallest and largest token count."""
    lo, hi = min(line), max(line)
    slope = (line[hi] - line[lo]) / (hi - lo)
    a = line[lo] - slope * lo
    for tokens, value in line.items():
        if abs(a + slope * tokens - value) > 1e-6 * max(1.0, value):
            raise ValueError(f"{case}: comm bytes {value} at {tokens} tokens are off the line through the others")
    return a, slope


def run(
    batch: int = 4,
    seq: int = 32,
    blocks: int = 6,
    steps: int = 2,
    ranks: int | None = None,
    tokens: list[int] | None = None,
    pools: PoolSet | None = None,
) -> list[Row]:
    """The default table (``tokens`` None: ``[batch, seq]``), or the sweep over ``tokens`` (each
    a multiple of ``seq``) with its crossover rows. Each world size runs on a fresh pool, or on
    ``pools``' (:func:`~tessera.bench.pools.rank_pool`)."""
    cases = CASES if tokens is None else SWEEP
    sizes = [batch * seq] if tokens is None else sorted(tokens)
    for count in sizes:
        if count % seq:
            raise ConfigError(f"--tokens: {count} is not a multiple of the sequence length {seq}")
    rows: list[Row] = []
    for world in (4, 8):
        if ranks is not None and world != ranks:
            continue
        with rank_pool(world, pools) as pool:
            for count in sizes:
                n_blocks, n_steps = (blocks, steps) if tokens is None else _timing(count, blocks, steps)
                shared = pool if count <= 1024 else None
                measured = _measure(cases, world, count // seq, seq, n_blocks, n_steps, shared)
                rows += _rows(measured, world, count // seq, seq, params=count == sizes[0])
    return rows if tokens is None else rows + crossover_rows(rows)


def parse_tokens(text: str | None) -> list[int] | None:
    """``"128,1024"`` -> ``[128, 1024]``; None stays None."""
    if text is None:
        return None
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise ConfigError(f"--tokens takes comma-separated integers, got {text!r}") from exc
    if not counts or min(counts) < 1:
        raise ConfigError(f"--tokens takes positive token counts, got {text!r}")
    return counts


def main(args: argparse.Namespace) -> int:
    rows = run(ranks=getattr(args, "ranks", None), tokens=parse_tokens(getattr(args, "tokens", None)))
    print_rows(rows)
    if args.out:
        write_rows(rows, args.out)
    return 0
