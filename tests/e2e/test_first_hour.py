"""A newcomer's first hour: mistakes caught before any process starts (one line, exit code 2),
one spelling of the process count, errors of every rank reported once, and scripts that run as
one process without a launcher."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.e2e.test_cli import PROBE, results, run, run_together, tessera_cmd

REPO = Path(__file__).resolve().parents[2]

BAD_LAYOUT = (
    "import tessera\n"
    "tessera.launch_from_torch({'parallel': {'tensor': {'size': 3}}})\n"
    "raise SystemExit('the dry validation should have stopped here')\n"
)

CASES = {
    "tensor=3 on 4": (["train", "--set", "parallel.tensor.size=3"], "tensor=3 = 3 does not divide world size 4"),
    "data=8 on 4": (["train", "--set", "parallel.data=8"], "= 8, but the world size is 4"),
    "tensor=4 on --nproc 2": (
        ["train", "--nproc", "2", "--set", "parallel.tensor.size=4"],
        "does not divide world size 2",
    ),
    "tensor=4 on --nproc-per-node 2": (
        ["train", "--nproc-per-node", "2", "--set", "parallel.tensor.size=4"],
        "does not divide world size 2 (tessera train starts 2 processes: --nproc-per-node)",
    ),
    "--set without =": (["train", "--set", "trainer.steps", "100"], "did you mean --set trainer.steps=100?"),
    "run --set without =": (["run", "--set", "trainer.steps", "100", "x.py"], "did you mean --set trainer.steps=100?"),
    "run --config on 4": (
        ["run", "--nproc", "4", "--config", "{tmp}/layout.toml", "x.py"],
        "tensor=3 = 3 does not divide world size 4 (tessera run starts 4 processes",
    ),
    "run, config found by a dry validation": (
        ["run", "--nproc-per-node", "4", "{tmp}/bad_layout.py"],
        "tensor=3 = 3 does not divide world size 4",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_mistakes_are_caught_before_any_process_starts(case, tmp_path, capsys):
    argv, expected = CASES[case]
    (tmp_path / "layout.toml").write_text("[parallel.tensor]\nsize = 3\n")
    (tmp_path / "bad_layout.py").write_text(BAD_LAYOUT)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    start = time.perf_counter()
    out = run([*tessera_cmd(), *argv], timeout=120)
    wall = time.perf_counter() - start
    with capsys.disabled():  # the wall time is reported, not asserted
        print(f"\n  [{case}] exit {out.returncode} after {wall:.2f} s: {out.stderr.strip()[:100]}")
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tessera {argv[0]}: error: "), out.stderr
    assert expected in lines[0]
    assert not (tmp_path / "runs").exists()


def test_version_and_help_answer_without_importing_torch():
    out = run([*tessera_cmd(), "--version"])
    assert out.returncode == 0 and out.stdout.strip() == "tessera 0.1.0"
    probe = "import sys; from tessera.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
    probe += "print('torch loaded' if 'torch' in sys.modules else 'no torch')"
    out = run([sys.executable, "-c", probe])
    assert out.stdout.strip().endswith("no torch") and "train" in out.stdout
    out = run([*tessera_cmd(), "bench", "--help"])
    for target in ("dp", "tp", "pp", "zero"):
        assert f"\n  {target} " in out.stdout and "about" in out.stdout
    assert "pip install -e '.[bench]'" in out.stdout


def test_run_counts_processes_from_the_flag_or_the_config(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("seed = 1\n")
    named = tmp_path / "named.toml"
    named.write_text("[launch]\nnproc_per_node = 2\n")  # --config: its process count, and --set reaches the ranks
    alone, out = run_together(
        [*tessera_cmd(), "run", str(PROBE), "torch", str(config)],  # no flag: one process
        [
            *tessera_cmd(),
            "run",
            "--config",
            str(named),
            "--set",
            "parallel.tensor.size=2",
            str(PROBE),
            "torch",
            str(named),
        ],
    )
    assert alone.returncode == 0, alone.stderr
    assert [(r["rank"], r["world"]) for r in results(alone.stdout)] == [("0", "1")]
    assert out.returncode == 0, out.stderr
    assert [(r["rank"], r["world"], r["tensor"]) for r in results(out.stdout)] == [("0", "2", "2"), ("1", "2", "2")]


def test_an_error_on_every_rank_is_printed_once_and_logged_per_rank(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text(
        "import tessera\nctx = tessera.launch_from_torch()\n"
        "raise ValueError(f'the data folder is empty ({ctx.world_size} ranks)')\n"
    )
    run_dir = tmp_path / "run"
    out = run([*tessera_cmd(), "run", "--nproc-per-node", "4", "--run-dir", str(run_dir), str(script)])
    assert out.returncode == 1
    message = "error on rank 0 (the same on ranks 1-3): ValueError: the data folder is empty (4 ranks)"
    assert out.stderr.count("the data folder is empty") == 1 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    for rank in range(4):
        log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert log.startswith("Traceback") and "boom.py" in log and log.strip().endswith("(4 ranks)")


def test_a_script_runs_without_a_launcher_as_under_tessera_run_with_one_process():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    with ThreadPoolExecutor(1) as other:  # one process each: both at once
        plain = other.submit(subprocess.run, [sys.executable, "examples/my_train.py"], capture_output=True, text=True,
                             cwd=REPO, env={**env, "OMP_NUM_THREADS": "1"}, timeout=300)  # fmt: skip
        launched = run([*tessera_cmd(), "run", "--nproc-per-node", "1", str(REPO / "examples" / "my_train.py"),
                        str(REPO / "examples" / "my_config.py")], timeout=300)  # fmt: skip
        alone = plain.result()
    assert alone.returncode == 0, alone.stderr
    assert launched.returncode == 0, launched.stderr
    losses = [line for line in alone.stdout.splitlines() if line[:1].isdigit()]
    assert len(losses) == 3 and losses == [line for line in launched.stdout.splitlines() if line[:1].isdigit()]
