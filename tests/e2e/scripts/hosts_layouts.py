"""One job's ranks, started by ``tessera run`` on each host: train each named layout of
:data:`LAYOUTS` for :data:`STEPS` steps (the golden runs' model, data and optimizer), then rank 0
alone trains the same model in a world of one, the single-process reference. Rank 0 saves every
run's losses and final full weights, and which host each rank ran on, to ``argv[1]``.

Usage (on each host): ``tessera run --nnodes 2 --nproc-per-node 2 ... hosts_layouts.py OUT NAME...``
"""

from __future__ import annotations

import socket
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import tessera
from tessera import comm
from tessera.checkpoint import full_state_dict
from tessera.models import NextTokenLoss, gpt
from tessera.testing import use_layout
from tests.golden.strategies import GoldenRun, dataset, start

STEPS = 10
PP = dict(accumulation=1, microbatches=4)
#: the layouts of 2 hosts x 2 ranks (the tensor, sequence and pipeline pairs, inner to outer)
LAYOUTS: dict[str, GoldenRun] = {
    "dp4": GoldenRun(4, data=4),
    "tp2-dp2": GoldenRun(4, data=2, tensor=2),
    "pp2-tp2": GoldenRun(4, tensor=2, pipeline=2, schedule="1f1b", **PP),  # the stages on two hosts
    "zero3-dp4": GoldenRun(4, data=4, zero_stage=3),
    "sp2-ring-dp2": GoldenRun(4, data=2, sequence=2, sequence_mode="ring"),
}
SINGLE = GoldenRun(1)


def alone(run: GoldenRun) -> tuple[Any, torch.nn.Module, DataLoader]:
    """``start`` without making the layout: the world of one that rank 0 already made."""
    torch.manual_seed(0)
    model = gpt(**run.model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    engine, loader, _, _ = tessera.initialize(model, optimizer, NextTokenLoss(),
                                              DataLoader(dataset(), batch_size=run.micro_batch()))  # fmt: skip
    assert loader is not None
    return engine, model, loader


def train(run: GoldenRun, single: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as offload:
        engine, model, loader = alone(run) if single else start(run, offload)
        it, losses = iter(loader), []
        for _ in range(STEPS):
            try:
                losses.append(engine.train_batch(it))
            except StopIteration:  # the golden data are 8 steps long: go round again
                it = iter(loader)
                losses.append(engine.train_batch(it))
        weights = {k: v.clone() for k, v in full_state_dict(model).items()}
        engine.strategy.close()
    return {"losses": losses, "weights": weights}


def main(out: str, names: list[str]) -> None:
    ctx = tessera.launch_from_torch()
    world = ctx.group("world")
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    results: dict[str, Any] = {"hosts": hosts}
    for name in names:
        results[name] = train(LAYOUTS[name])
    if use_layout(config=SINGLE.config(), ranks=[0]) is not None:  # a world of one on rank 0
        results["single"] = train(SINGLE, single=True)
    comm.barrier(world)
    if dist.get_rank() == 0:
        torch.save(results, out)
    tessera.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
