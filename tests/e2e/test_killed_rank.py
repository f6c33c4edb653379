"""A run survives a killed rank: ``tessera run --nproc-per-node 4 --max-restarts 1`` of a
Trainer script that checkpoints every 5 steps; rank 2 is SIGKILLed at step 12, torchrun
restarts the ranks, they resume from step 10 by themselves, and the job ends with weights
bitwise equal to an uninterrupted 20-step run's."""

from __future__ import annotations

import time

from safetensors.torch import load_file

from tessera.testing import free_port
from tests.e2e.test_cli import HERE, results, run, tessera_cmd

SCRIPT = HERE / "scripts" / "resilient_train.py"


def launch(tmp_path, name: str, kill_step: int, *extra: str):
    out_file = tmp_path / f"{name}.safetensors"
    cmd = [*tessera_cmd(), "run", "--nproc-per-node", "4", "--master-port", str(free_port()), *extra,
           str(SCRIPT), str(tmp_path / f"{name}-ckpt"), str(out_file), str(kill_step)]  # fmt: skip
    started = time.monotonic()
    out = run(cmd, timeout=300)
    print(f"{name}: exit {out.returncode} after {time.monotonic() - started:.1f} s")
    return out, out_file


def test_a_killed_rank_restarts_and_the_run_finishes_as_if_uninterrupted(tmp_path):
    plain, plain_weights = launch(tmp_path, "uninterrupted", 0)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert results(plain.stdout)[0]["first_step"] == "1"
    killed, killed_weights = launch(tmp_path, "killed", 12, "--max-restarts", "1")
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "rank 2: SIGKILL at step 12" in killed.stderr
    assert "resumed from" in killed.stderr and "step-00000010" in killed.stderr, killed.stderr[-3000:]
    assert results(killed.stdout)[-1]["first_step"] == "11"  # the restarted attempt began after step 10
    expected, got = load_file(str(plain_weights)), load_file(str(killed_weights))
    assert expected.keys() == got.keys()
    for key in expected:
        assert (expected[key] == got[key]).all(), key
    # keep_last=2: only the two newest checkpoints remain
    kept = sorted(p.name for p in (tmp_path / "killed-ckpt").iterdir())
    assert kept == ["step-00000015", "step-00000020"], kept
