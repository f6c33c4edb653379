"""The getting-started example (docs/getting-started.md); tests/e2e runs it."""

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tessera

ctx = tessera.launch_from_torch(
    sys.argv[1] if len(sys.argv) > 1 else "examples/my_config.py"
)  # one call per process; validates the config

model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))  # same seed on every rank
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = TensorDataset(torch.randn(4096, 32), torch.randint(0, 10, (4096,)))
loader = DataLoader(data, batch_size=32, shuffle=True)  # batch_size is per rank (a micro-batch)

engine, loader, _, _ = tessera.initialize(model, optimizer, nn.CrossEntropyLoss(), loader)

engine.train()
for epoch in range(3):
    loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
    for x, y in loader:
        engine.zero_grad()
        loss = engine.criterion(engine(x), y)
        engine.backward(loss)
        engine.step()
    if ctx.rank == 0:
        print(epoch, loss.item())
tessera.shutdown()
