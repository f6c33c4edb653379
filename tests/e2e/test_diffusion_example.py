"""examples/diffusion/train_unet.py run as a user runs it (a few steps): the run folder holds the
metrics, the loss curve, the sample grids before and after training, and a diffusers folder that
plain diffusers loads with the trained UNet's weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import diffusers
import torch

from tessera.diffusion import build_parts

REPO = Path(__file__).resolve().parents[2]


def test_the_example_writes_its_run_folder(tmp_path):
    run_dir = tmp_path / "run"
    args = ["--steps", "3", "--batch", "4", "--vae-steps", "2", "--sampling-steps", "2", "--run-dir", str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, str(REPO / "examples/diffusion/train_unet.py"), *args],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3] and all(s["loss"] > 0 for s in steps)
    for name in ("loss.png", "samples-0.png", "samples-3.png", "config.json"):
        assert (run_dir / name).stat().st_size > 0, name
    scores = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in scores] == [0, 3] and all(0 <= s["agreement"] <= 1 for s in scores)
    unet = diffusers.UNet2DConditionModel.from_pretrained(run_dir / "diffusers" / "unet")
    start = build_parts(seed=0).unet.state_dict()  # the script's starting weights
    trained = unet.state_dict()
    assert trained.keys() == start.keys()
    assert not all(torch.equal(trained[k], start[k]) for k in start), "the saved UNet is the untrained one"
    assert (run_dir / "diffusers" / "scheduler" / "scheduler_config.json").exists()
