"""A user script that trains under Gemini with a disk tier and, like most, calls only
tessera.shutdown() at its end: it never closes its engine itself. tests/e2e/test_offload_cleanup.py
runs it to its end, into a budget error, into an error of its own, and into a SIGKILL.

``python offload_run.py OFFLOAD_DIR MODE [KEY=VALUE ...]``; MODE: ``end`` (train 3 steps),
``raise`` (the loss raises at step 2) or ``kill`` (SIGKILL at step 2). Prints ``RESULT`` lines:
the files of this rank's disk tier after initialize and after each step, and those left in
OFFLOAD_DIR after shutdown.
"""

import os
import signal
import sys
from pathlib import Path

import torch

import tessera
from tessera.models import NextTokenLoss, gpt

offload, mode, *overrides = sys.argv[1:]
GEMINI = {
    "offload_dir": offload,
    "placement": "auto",
    "chunk_mb": 0.02,
    "device_budget": 450_000,
    "host_budget": 60_000,
}
ctx = tessera.launch_from_torch({"gemini": GEMINI}, overrides=overrides)


def files(mine: bool = True) -> int:
    pattern = f"rank*-{os.getpid()}/**/*" if mine else "**/*"
    return sum(p.is_file() for p in Path(offload).glob(pattern))


def say(text: str) -> None:
    os.write(1, f"RESULT rank={ctx.rank} {text}\n".encode())  # one write: the ranks share the pipe


class Loss(NextTokenLoss):
    """The model's loss, failing at step 2 when MODE is ``raise``."""

    calls = 0

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        Loss.calls += 1
        if mode == "raise" and Loss.calls == 2:
            raise RuntimeError("the loss failed at step 2")
        return super().forward(logits, targets)


torch.manual_seed(0)
model = gpt("tiny", vocab_size=64, max_seq_len=16, d_model=32, n_layers=2, n_heads=4)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
engine, *_ = tessera.initialize(model, optimizer, Loss())
say(f"step=0 files={files()}")
tokens = torch.randint(0, 64, (3, 4, 17), generator=torch.Generator().manual_seed(ctx.rank))
for step, batch in enumerate(tokens, start=1):
    if mode == "kill" and step == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    engine.train_batch(iter([(batch[:, :-1], batch[:, 1:])]))
    say(f"step={step} files={files()}")
tessera.shutdown()
say(f"left={files(mine=False)}")
