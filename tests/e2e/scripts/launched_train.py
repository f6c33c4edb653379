"""Started by tests/e2e/test_mpi_slurm.py under ``mpirun`` or ``srun``: a small MLP trained in fp32
under data parallelism over every rank the launcher started. Rank 0 saves to ``argv[2]`` which
launcher tessera saw, each rank's host, the loss of every step and the final weights;
:func:`reference` is the same training as plain single-process PyTorch (the answer every rank
count must give).

Usage: ``launched_train.py auto|openmpi|slurm OUT`` (``auto``: ``launch_from_torch``, which takes
whichever launcher started the process; the others: ``launch_from_openmpi`` / ``launch_from_slurm``
with the host and port they derive).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STEPS = 6
GLOBAL_BATCH = 32
SEED = 0


def data() -> TensorDataset:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(STEPS * GLOBAL_BATCH, 16, generator=gen)
    return TensorDataset(x, (x[:, :4].sum(dim=1) > 0).long() + 2 * (x[:, 4] > 0).long())


def model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def optimizer(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(net.parameters(), lr=1e-2)


def reference() -> dict[str, Any]:
    """Plain PyTorch in one process: the global batch of each step, in the data's order."""
    net = model()
    opt = optimizer(net)
    losses = []
    for x, y in DataLoader(data(), batch_size=GLOBAL_BATCH):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in net.state_dict().items()}}


def main(how: str, out: str) -> None:
    import torch.distributed as dist

    import tessera
    from tessera import job_env
    from tessera.checkpoint import full_state_dict

    config = {"seed": SEED}
    if how == "auto":
        ctx = tessera.launch_from_torch(config)
    elif how == "openmpi":
        ctx = tessera.launch_from_openmpi(config)
    elif how == "slurm":
        ctx = tessera.launch_from_slurm(config)
    else:
        raise SystemExit(f"unknown launch {how!r}: auto, openmpi or slurm")
    job = job_env.detect(os.environ)
    net = model()
    shard = DataLoader(data(), batch_size=GLOBAL_BATCH // ctx.world_size)  # one rank's part of each step's batch
    engine, loader, _, _ = tessera.initialize(net, optimizer(net), nn.CrossEntropyLoss(), shard)
    assert loader is not None
    it = iter(loader)
    losses = [engine.train_batch(it) for _ in range(STEPS)]
    hosts: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(hosts, os.uname().nodename)
    weights = {k: v.clone() for k, v in full_state_dict(net).items()}
    if ctx.rank == 0:
        launcher = job.launcher if job is not None else None
        torch.save({"launcher": launcher, "master": job.host if job else None, "hosts": hosts,
                    "losses": losses, "weights": weights}, out)  # fmt: skip
    tessera.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
