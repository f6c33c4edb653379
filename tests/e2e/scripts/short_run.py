"""A short ZeRO-1 training run that ends with tessera.shutdown(), keeping its engine until the
interpreter exits as a user script does. tests/e2e/test_teardown.py starts it again and again:
every rank must exit 0."""

import os
import sys

import torch

import tessera
from tessera.models import NextTokenLoss, gpt

ctx = tessera.launch_from_torch({"zero": {"stage": 1}}, overrides=sys.argv[1:])
torch.manual_seed(0)
model = gpt("tiny", vocab_size=64, max_seq_len=16, d_model=32, n_layers=2, n_heads=4)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
engine, *_ = tessera.initialize(model, optimizer, NextTokenLoss())
tokens = torch.randint(0, 64, (3, 4, 17), generator=torch.Generator().manual_seed(ctx.rank))
losses = [engine.train_batch(iter([(batch[:, :-1], batch[:, 1:])])) for batch in tokens]
os.write(1, f"RESULT rank={ctx.rank} loss={losses[-1]:.4f}\n".encode())  # one write: the ranks share the pipe
tessera.shutdown()
