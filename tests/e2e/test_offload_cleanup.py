"""Nothing left behind in ``gemini.offload_dir``: after a normal end, a budget error at the first
step and an error raised in training, for ``tessera train`` and for a user script that calls
only ``tessera.shutdown()``; and the folder a SIGKILLed run left is removed by the next run."""

from __future__ import annotations

import json
import sys

import pytest

from tests.e2e.test_cli import HERE, results, run, run_together, tessera_cmd

SCRIPT = HERE / "scripts" / "offload_run.py"

# tessera train's tiny GPT on 2 ranks, its chunks through the device, host and disk tiers
TRAIN = ["--set", "trainer.steps=3", "--set", "trainer.eval_every=3", "--set", "trainer.progress_bar=false",
         "--set", "data.max_bytes=100000", "--set", "data.micro_batch_size=4", "--set", "data.seq_len=32",
         "--set", "gemini.placement=auto", "--set", "gemini.device_budget=8MiB", "--set", "gemini.host_budget=600000"]  # fmt: skip
# room at start for a chunk and a layer's working set (1.25 MiB), not for the activations the first
# step traces as well (5.4 MiB in all)
TRAIN_BUDGET_ERROR = ["--set", "gemini.device_budget=2MiB"]
SCRIPT_BUDGET_ERROR = ["gemini.device_budget=200000"]  # 0.10 MiB at start, 0.37 MiB with the activations
# the weights thrown far by the first step: the second step's loss is not finite
TRAIN_RAISES = ["--set", "optimizer.lr=1e30", "--set", "schedule.warmup_steps=0"]
# the script on one process: budgets for a whole chunk per rank, with parts on disk
ALONE = ["gemini.device_budget=500000", "gemini.host_budget=120000"]


def left_in(folder) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def train_command(tmp_path, *extra: str) -> list[str]:
    offload = tmp_path / "offload"
    return [*tessera_cmd(), "train", "--nproc", "2", "--output-dir", str(tmp_path / "run"), *TRAIN,
            "--set", f"gemini.offload_dir={offload}", *extra]  # fmt: skip


def script_command(tmp_path, mode: str, *overrides: str) -> list[str]:
    return [*tessera_cmd(), "run", "--nproc-per-node", "2", "--no-dry-run", "--run-dir", str(tmp_path / "run"),
            str(SCRIPT), str(tmp_path / "offload"), mode, *overrides]  # fmt: skip


# every launch of the tests below, by name: (how it is made, its arguments)
LAUNCHES = {
    "train-end": (train_command, ()),
    "train-budget": (train_command, TRAIN_BUDGET_ERROR),
    "train-raise": (train_command, TRAIN_RAISES),
    "script-end": (script_command, ("end",)),
    "script-budget": (script_command, ("end", *SCRIPT_BUDGET_ERROR)),
    "script-raise": (script_command, ("raise",)),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The six launches, started together (independent: each picks its own port and folders):
    by name, its folder and its output."""
    folders = {name: tmp_path_factory.mktemp(name) for name in LAUNCHES}
    outs = run_together(*(make(folders[n], *args) for n, (make, args) in LAUNCHES.items()), timeout=300)
    return {name: (folders[name], out) for name, out in zip(LAUNCHES, outs)}


def test_tessera_train_leaves_no_offload_files_after_a_normal_end(launched):
    tmp_path, out = launched["train-end"]
    assert out.returncode == 0, out.stdout + out.stderr
    memory = json.loads((tmp_path / "run" / "memory.json").read_text())
    assert memory["strategy"] == "gemini(auto)" and memory["disk_written_bytes"] > 0, "the disk tier was used"
    assert left_in(tmp_path / "offload") == []


@pytest.mark.parametrize(
    ("case", "extra", "error"),
    [("budget", TRAIN_BUDGET_ERROR, "cannot hold the traced activations"), ("raise", TRAIN_RAISES, "non-finite loss")],
    ids=["budget-error", "raised-in-training"],
)
def test_tessera_train_leaves_no_offload_files_after_an_error(launched, case, extra, error):
    tmp_path, out = launched[f"train-{case}"]
    assert out.returncode != 0 and error in out.stderr, out.stdout + out.stderr
    assert "error on rank 0 (the same on rank 1)" in out.stderr, out.stderr
    if case == "raise":
        assert "step=1 loss=" in out.stderr and "at step 1" in out.stderr, "the first step trained, the second raised"
    assert left_in(tmp_path / "offload") == []


def test_a_script_that_ends_with_shutdown_leaves_no_offload_files(launched):
    tmp_path, out = launched["script-end"]
    assert out.returncode == 0, out.stdout + out.stderr
    rows = results(out.stdout)
    held = [int(r["files"]) for r in rows if "files" in r]
    assert len(held) == 8 and min(held) > 0, "each rank's disk tier held files from the start to the end"
    assert [r["left"] for r in rows if "left" in r] == ["0", "0"], "none left once shutdown returned"
    assert left_in(tmp_path / "offload") == []


@pytest.mark.parametrize(
    ("mode", "name", "error"),
    [
        ("end", "script-budget", "cannot hold the traced activations"),
        ("raise", "script-raise", "the loss failed at step 2"),
    ],
    ids=["budget-error", "raised-in-training"],
)
def test_a_script_that_raises_before_its_shutdown_leaves_no_offload_files(launched, mode, name, error):
    tmp_path, out = launched[name]
    assert out.returncode != 0 and error in out.stderr, out.stdout + out.stderr
    rows = results(out.stdout)
    held = [int(r["files"]) for r in rows if "files" in r]
    assert len(held) == (2 if mode == "end" else 4) and min(held) > 0, "the disk tier held files when the error came"
    assert not any("left" in r for r in rows), "the script never reached its shutdown"
    assert left_in(tmp_path / "offload") == []


def test_the_folder_a_killed_run_left_is_removed_by_the_next_run(tmp_path):
    offload = tmp_path / "offload"
    killed = run([sys.executable, str(SCRIPT), str(offload), "kill", *ALONE], timeout=300)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    [left] = offload.iterdir()
    assert left.name.startswith("rank0-") and any(p.suffix == ".bin" for p in left.rglob("*")), left_in(offload)
    again = run([sys.executable, str(SCRIPT), str(offload), "end", *ALONE], timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert [r["left"] for r in results(again.stdout) if "left" in r] == ["0"]
    assert left_in(offload) == []
