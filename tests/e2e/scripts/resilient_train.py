"""An 8-step run through the Trainer with a checkpoint every 2 steps that resumes by itself
(``resume="auto"``), on 2 ranks (data parallel, ZeRO-1: each rank checkpoints its shard of the
optimizer state and its place in the data). With a kill step, rank 1 SIGKILLs itself there on
the job's first attempt; ``tessera run --max-restarts 1`` then restarts every rank, and the run
continues from its last checkpoint. tests/e2e/test_killed_rank.py compares the final weights
with an uninterrupted run.

usage: resilient_train.py CHECKPOINT_DIR WEIGHTS_OUT KILL_STEP (0: never)
"""

import os
import signal
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

import tessera
from tessera.checkpoint import full_state_dict, save_weights
from tessera.engine import Hook, Trainer
from tessera.models import NextTokenLoss, gpt

KILLED_RANK, STEPS, CHECKPOINT_EVERY = 1, 8, 2

checkpoint_dir, weights_out, kill_step = sys.argv[1], sys.argv[2], int(sys.argv[3])
ctx = tessera.launch_from_torch({"parallel": {"data": 2}, "zero": {"stage": 1}})
torch.manual_seed(0)
model = gpt("tiny", vocab_size=64, max_seq_len=16, d_model=32, n_layers=2, n_heads=4, dropout=0.1)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.8)
tokens = torch.randint(0, 64, (256, 17), generator=torch.Generator().manual_seed(7))
loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4, shuffle=True)
engine, loader, _, scheduler = tessera.initialize(model, optimizer, NextTokenLoss(), loader, lr_scheduler=scheduler)


class KillOnce(Hook):
    def after_step(self, trainer: Trainer) -> None:
        trainer.engine.lr_scheduler.step()
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if trainer.step == kill_step and ctx.rank == KILLED_RANK and first_attempt:
            os.write(2, f"rank {KILLED_RANK}: SIGKILL at step {kill_step}\n".encode())
            os.kill(os.getpid(), signal.SIGKILL)


trainer = Trainer(
    engine, [KillOnce()], checkpoint_dir=checkpoint_dir, checkpoint_every=CHECKPOINT_EVERY, keep_last=2, resume="auto"
)
history = trainer.fit(loader, steps=STEPS)
state = full_state_dict(engine.model)
if ctx.rank == 0:
    save_weights(state, weights_out)
    os.write(1, f"RESULT rank=0 first_step={history[0]['step']} last_loss={history[-1]['loss']:.6f}\n".encode())
tessera.shutdown()
