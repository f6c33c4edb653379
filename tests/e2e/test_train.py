"""`tessera train` as a user runs it: a short run writes the four artefacts of a run folder and
resumes from its checkpoint bitwise; runs under 2D tensor, sequence and pipeline parallelism."""

from __future__ import annotations

import json

import pytest

from tessera.checkpoint import load_weights
from tessera.models import gpt
from tests.e2e.test_cli import run, run_together, tessera_cmd

QUICK = ["--set", "trainer.steps=3", "--set", "trainer.eval_every=3", "--set", "trainer.progress_bar=false",
         "--set", "data.max_bytes=100000", "--set", "data.micro_batch_size=4"]  # fmt: skip
LAYOUTS = {
    "2d": ["--nproc", "4", "--set", "parallel.tensor.size=4", "--set", "parallel.tensor.mode=2d"],
    # the sequence axis alone: 2 ranks
    "sp": ["--nproc", "2", "--set", "parallel.sequence.size=2", "--set", "parallel.sequence.mode=ring",
           "--set", "activation_checkpoint.mode=selective"],
    "pp": ["--nproc", "2", "--set", "parallel.pipeline.size=2", "--set", "parallel.pipeline.microbatches=2"],
}  # fmt: skip


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    """The three layouts' short runs, started together (independent launches): their run folders
    and outputs by name."""
    root = tmp_path_factory.mktemp("layouts")
    commands = [[*tessera_cmd(), "train", *LAYOUTS[name], "--output-dir", str(root / name), *QUICK] for name in LAYOUTS]
    outs = run_together(*commands, timeout=300)
    return {name: (root / name, out) for name, out in zip(LAYOUTS, outs)}


def test_train_rejects_a_bad_config_before_starting_processes():
    out = run([*tessera_cmd(), "train", "--set", "paralel.data=2"], timeout=60)
    assert out.returncode == 2 and "did you mean 'parallel'" in out.stderr
    out = run([*tessera_cmd(), "train", "--set", "parallel.sequence.mode=ulysses"], timeout=60)
    assert out.returncode == 2 and "parallel.sequence.mode" in out.stderr, out.stderr
    out = run([*tessera_cmd(), "train", "--set", "parallel.pipeline.size=8"], timeout=60)  # tiny GPT: 6 layers
    assert out.returncode == 2 and "has only 6 layers" in out.stderr, out.stderr


def test_train_runs_under_2d_tensor_parallelism(layout_runs):
    run_dir, out = layout_runs["2d"]
    assert out.returncode == 0, out.stdout + out.stderr
    config = json.loads((run_dir / "config.json").read_text())
    assert config["parallel"]["tensor"] == {
        "size": 4,
        "mode": "2d",
        "depth": 1,
        "sequence_parallel": False,
        "keep_blocks": False,
    }
    weights = load_weights(run_dir / "model.safetensors")
    reference = gpt("tiny").state_dict()
    assert {k: tuple(v.shape) for k, v in weights.items()} == {k: tuple(v.shape) for k, v in reference.items()}


def test_train_runs_under_sequence_parallelism(layout_runs):
    run_dir, out = layout_runs["sp"]
    assert out.returncode == 0, out.stdout + out.stderr
    config = json.loads((run_dir / "config.json").read_text())
    assert config["parallel"]["sequence"] == {"size": 2, "mode": "ring"}
    assert config["activation_checkpoint"] == {"mode": "selective", "every": 1}
    weights = load_weights(run_dir / "model.safetensors")
    reference = gpt("tiny").state_dict()
    assert {k: tuple(v.shape) for k, v in weights.items()} == {k: tuple(v.shape) for k, v in reference.items()}


def test_train_runs_with_pipeline_stages(layout_runs):
    run_dir, out = layout_runs["pp"]
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "final" not in m] == [1, 2, 3]
    weights = load_weights(run_dir / "model.safetensors")
    assert weights.keys() == gpt("tiny").state_dict().keys()


# the progress bar (stderr is a pipe here: "auto" would draw none) and the logs every 3 steps do
# not change the numbers
SHORT = ["--set", "trainer.eval_every=3", "--set", "trainer.log_every=3", "--set", "trainer.progress_bar=true",
         "--set", "trainer.checkpoint_every=3",
         "--set", "data.max_bytes=100000", "--set", "data.micro_batch_size=4", "--set", "model.options={'dropout': 0.1}"]  # fmt: skip


def test_a_short_run_writes_the_run_folder_and_resumes_from_its_checkpoint_bitwise(tmp_path):
    """A short run writes the four artefacts of a run folder (and, checkpointing, its checkpoints)
    and reports FLOPs per token and MFU against a peak it measures once (the resumed run reads it).
    `tessera train --resume` continues it from its sharded checkpoint: 6 steps straight, and 3
    steps resumed from the checkpoint at step 3, end with the same weights, bit for bit."""
    first, second = tmp_path / "first", tmp_path / "second"
    cache = {"XDG_CACHE_HOME": str(tmp_path / "cache")}  # the peak: measured by the first run, read by the second
    out = run([*tessera_cmd(), "train", "--nproc", "2", "--output-dir", str(first), "--set", "trainer.steps=6", *SHORT],
              env=cache, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(p.name for p in first.iterdir()) == [
        "checkpoints",
        "config.json",
        "loss.png",
        "metrics.jsonl",
        "model.safetensors",
    ]
    config = json.loads((first / "config.json").read_text())
    assert config["world_size"] == 2 and config["trainer"]["steps"] == 6 and config["model"]["preset"] == "tiny"
    lines = [json.loads(line) for line in (first / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "final" not in m] == [1, 2, 3, 4, 5, 6]
    assert "eval_loss" in lines[2] and "eval_loss" in lines[-1]
    per_token = gpt("tiny").flops_per_token(128)
    assert all(m["flops_per_token"] == per_token and m["mfu"] > 0 for m in lines if "final" not in m)
    assert "fp32 (" in out.stderr and "1 thread; measured)" in out.stderr and " mfu=" in out.stderr
    assert (first / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    weights = load_weights(first / "model.safetensors")
    assert weights.keys() == gpt("tiny").state_dict().keys()
    assert "train: 100%" in out.stderr, "a progress bar on rank 0"
    assert "loss" in out.stderr and "wrote" in out.stderr
    assert sorted(p.name for p in (first / "checkpoints").iterdir()) == ["step-00000003", "step-00000006"]
    out = run([*tessera_cmd(), "train", "--nproc", "2", "--resume", str(first / "checkpoints" / "step-00000003"),
               "--output-dir", str(second), "--set", "trainer.steps=6", *SHORT], env=cache, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "resumed from" in out.stderr
    assert "1 thread; cached)" in out.stderr
    lines = [json.loads(line) for line in (second / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "final" not in m] == [4, 5, 6]
    expected, got = load_weights(first / "model.safetensors"), load_weights(second / "model.safetensors")
    assert all(bool((expected[k] == got[k]).all()) for k in expected)


def test_train_resume_without_a_checkpoint_fails_before_starting(tmp_path):
    out = run([*tessera_cmd(), "train", "--resume", "--set", f"trainer.output_dir={tmp_path}"], timeout=60)
    assert out.returncode == 2
    assert f"--resume latest: no complete checkpoint under {tmp_path}" in out.stderr
