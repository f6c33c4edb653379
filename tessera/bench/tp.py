"""``tessera bench tp``: one transformer block (hidden 1024) in every tensor-parallel mode.

Per mode and world size: step time (forward, backward, SGD step), model-state bytes per rank,
activation bytes per rank (the tensors saved for backward, through saved-tensor hooks) and
communicated bytes per step (the comm ledger). 1D runs against torch's own
``parallelize_module`` (ColwiseParallel / RowwiseParallel on the same block), in alternating
blocks of steps in the same pool; the other modes are reported against tessera's 1D on the same
ranks.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch
from torch import nn

from tessera.bench.report import Row, print_rows, write_rows
from tessera.bench.timing import alternate

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
    ("3d", 8, dict(tensor=8, mode="3d")),
]


def run(batch: int = 4, seq: int = 32, blocks: int = 6, steps: int = 2, ranks: int | None = None) -> list[Row]:
    from tessera.testing import RankPool

    rows: list[Row] = []
    for world in (4, 8):
        if ranks is not None and world != ranks:
            continue
        pool = RankPool(world)
        try:
            measured = {}
            for name, size, layout in CASES:
                if size != world:
                    continue
                with_torch = layout["mode"] == "1d"
                measured[name] = pool.run(_rank_body, layout, batch, seq, blocks, steps, with_torch, timeout=1800)[0]
        finally:
            pool.close()
        base = measured["1d"]
        full_param_bytes = 4 * sum(p.numel() for p in _block().parameters())
        for name, result in measured.items():
            label = f"block h{HIDDEN} {name} tp{world} b{batch}x{seq}"
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
            rows.append(Row(label, "param_bytes", result["param_bytes"], "single device", full_param_bytes))
            rows.append(Row(label, "comm_bytes", result["comm_bytes"], f"tessera 1d tp{world}", base["comm_bytes"]))
    return rows


def main(args: argparse.Namespace) -> int:
    rows = run(ranks=getattr(args, "ranks", None))
    print_rows(rows)
    if args.out:
        write_rows(rows, args.out)
    return 0
