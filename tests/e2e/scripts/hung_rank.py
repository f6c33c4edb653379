"""Started by tests/e2e/test_hung_rank.py under ``tessera run --nproc-per-node 3``: every rank
all-reduces over the data axis once a step; at step 3 rank 2 stops and sleeps for good, as a hung
rank would, while the others wait for it in the all-reduce. The argument is a marker that lets the
test find the processes afterwards."""

import os
import sys
import time

import torch

import tessera
from tessera import comm

HUNG_RANK, HUNG_STEP = 2, 3

ctx = tessera.launch_from_torch()
assert sys.argv[1:2], "usage: hung_rank.py MARKER"
for step in range(HUNG_STEP + 2):
    if ctx.rank == HUNG_RANK and step == HUNG_STEP:
        os.write(1, f"HUNG rank={ctx.rank} step={step} at={time.time():.3f}\n".encode())  # one write: a shared pipe
        while True:
            time.sleep(60)
    total = comm.all_reduce(torch.ones(1), "data")
    assert total.item() == ctx.size("data")
os.write(1, f"DONE rank={ctx.rank}\n".encode())  # not reached: the watchdog ends the others at step 3
