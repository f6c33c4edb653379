"""The first 20 steps of the default ``tessera train`` run (tiny GPT, 4 processes, byte corpus).

``trainer.steps=20`` ends the run early without changing its numbers: the schedule warms up
over 20 steps, so the learning rates of the first 20 steps do not depend on the total. The
losses and learning rates come from the run folder's ``metrics.jsonl`` (JSON writes floats with
``repr``, which round-trips exactly), the final weights from its ``model.safetensors``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from tests.golden.numerics import numerics_class
from tests.golden.record import hex_floats, weights_fingerprint

NAME = "tessera-train-default-20-steps"
STEPS = 20
OVERRIDES = [f"trainer.steps={STEPS}", "trainer.progress_bar=false"]


def command(run_dir: Path) -> list[str]:
    args = [sys.executable, "-m", "tessera.cli", "train", "--output-dir", str(run_dir)]
    for item in OVERRIDES:
        args += ["--set", item]
    return args


def definition() -> dict[str, Any]:
    return {"command": "tessera train " + " ".join(f"--set {o}" for o in OVERRIDES), "steps": STEPS}


def compute(run_dir: Path, timeout: float = 300) -> tuple[str, dict[str, Any]]:
    """Run ``tessera train`` into ``run_dir``; return the numerics class (its ranks inherit this
    process's environment, so they share its class) and the run's numbers."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(command(run_dir), capture_output=True, text=True, timeout=timeout, env=env)
    if out.returncode != 0:
        raise AssertionError(f"tessera train failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "final" not in m]
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1)), [m["step"] for m in steps]
    final = [m for m in lines if "final" in m]
    return numerics_class(), {
        "losses": hex_floats([m["loss"] for m in steps]),
        "lrs": hex_floats([m["lr"] for m in steps]),
        "final_eval_losses": hex_floats([m["eval_loss"] for m in final]),
        "final_weights": weights_fingerprint(load_file(str(run_dir / "model.safetensors"))),
    }
