"""An elastic run through the Trainer: a checkpoint every 5 steps, resuming by itself
(``resume="auto"``), ZeRO-1 over every data rank, and a global batch of 16 samples a step
whatever the world (``data.global_batch_size``: 4 ranks take one micro-batch of 4 a step, 2 ranks
two). With a host to lose, on the job's first attempt every rank on that host SIGKILLs its
``tessera run`` (the agent) and then itself at ``KILL_STEP``: the host is gone. The agents left
restart their ranks on the smaller world (``--nnodes 1:2 --max-restarts 1``), which load the
newest checkpoint resharded (the data axis halves) and go on. Rank 0 writes the final weights,
and the world size and first step of this attempt, to ``RUN_DIR``.

usage: elastic_train.py RUN_DIR STEPS [KILL_HOST KILL_STEP]
"""

import json
import os
import signal
import socket
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import tessera
from tessera.checkpoint import full_state_dict, save_weights
from tessera.engine import Hook, Trainer
from tessera.models import NextTokenLoss, gpt

run_dir, steps = Path(sys.argv[1]), int(sys.argv[2])
kill_host, kill_step = (sys.argv[3], int(sys.argv[4])) if len(sys.argv) > 4 else (None, 0)
config = {"zero": {"stage": 1}, "data": {"micro_batch_size": 4, "global_batch_size": 16}}
ctx = tessera.launch_from_torch(config)
cfg = tessera.current_config()
if ctx.rank == 0:  # the world of this attempt
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / f"attempt-{restart}.json").write_text(json.dumps({"world_size": ctx.world_size}))
torch.manual_seed(0)
model = gpt("tiny", vocab_size=64, max_seq_len=16, d_model=32, n_layers=2, n_heads=4)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
tokens = torch.randint(0, 64, (512, 17), generator=torch.Generator().manual_seed(7))
loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=cfg.data.micro_batch_size, shuffle=True)
engine, loader, _, _ = tessera.initialize(model, optimizer, NextTokenLoss(), loader)


class LoseHost(Hook):
    def after_step(self, trainer: Trainer) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if trainer.step == kill_step and socket.gethostname() == kill_host and first_attempt:
            os.write(
                2, f"rank {ctx.rank} on {kill_host}: its agent and itself SIGKILLed at step {kill_step}\n".encode()
            )
            os.kill(os.getppid(), signal.SIGKILL)  # the host's tessera run
            os.kill(os.getpid(), signal.SIGKILL)


trainer = Trainer(engine, [LoseHost()], checkpoint_dir=run_dir / "checkpoints", checkpoint_every=5, resume="auto")
history = trainer.fit(loader, steps=steps)
state = full_state_dict(engine.model)
if ctx.rank == 0:
    save_weights(state, str(run_dir / "final.safetensors"))
    attempt = {"world_size": ctx.world_size, "first_step": history[0]["step"], "last_step": history[-1]["step"],
               "accumulation": engine.micro_batches_per_step, "losses": [row["loss"] for row in history]}  # fmt: skip
    (run_dir / "finished.json").write_text(json.dumps(attempt))
tessera.shutdown()
