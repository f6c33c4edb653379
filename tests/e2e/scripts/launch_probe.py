"""Started by the e2e tests under torchrun, "Slurm" or "OpenMPI" environments: launch, all-reduce
along every axis, print one line per rank."""

import os
import sys

import torch

import tessera
from tessera import comm

launcher, config = sys.argv[1], sys.argv[2]
overrides = sys.argv[3:]
if launcher == "torch":
    ctx = tessera.launch_from_torch(config, overrides=overrides)
elif launcher == "slurm":
    ctx = tessera.launch_from_slurm(config, "127.0.0.1", sys.argv[3])
elif launcher == "openmpi":
    ctx = tessera.launch_from_openmpi(config, "127.0.0.1", sys.argv[3])
else:
    raise SystemExit(f"unknown launcher {launcher}")
assert tessera.get_context() is ctx
t = torch.tensor([float(ctx.rank + 1)])
comm.all_reduce(t, "world")
line = (
    f"RESULT rank={ctx.rank} world={ctx.world_size} sum={t.item():g} tensor={ctx.size('tensor')} "
    f"data={ctx.size('data')} threads={torch.get_num_threads()}\n"
)
os.write(1, line.encode())  # one write: lines from several ranks share the pipe
tessera.shutdown()
