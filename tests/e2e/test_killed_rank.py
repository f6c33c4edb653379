"""A run survives a killed rank: ``tessera run --nproc-per-node 2 --max-restarts 1`` of a
Trainer script that checkpoints every 2 steps; rank 1 is SIGKILLed at step 5, torchrun
restarts the ranks, they resume from step 4 by themselves, and the job ends with weights
bitwise equal to an uninterrupted 8-step run's (started beside it, at the same time)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from safetensors.torch import load_file

from tessera.testing import free_port
from tests.e2e.test_cli import HERE, results, tessera_cmd

SCRIPT = HERE / "scripts" / "resilient_train.py"


def start(tmp_path: Path, name: str, port: int, kill_step: int, *extra: str) -> subprocess.Popen:
    """``tessera run`` of the script on 2 ranks (no dry run: the script's config is fixed), in a
    session of its own, its output into ``<name>.out`` and ``<name>.err``."""
    cmd = [*tessera_cmd(), "run", "--nproc-per-node", "2", "--master-port", str(port), "--no-dry-run",
           "--run-dir", str(tmp_path / f"{name}-run"), *extra, str(SCRIPT), str(tmp_path / f"{name}-ckpt"),
           str(tmp_path / f"{name}.safetensors"), str(kill_step)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(tmp_path / f"{name}.out", "w") as out, open(tmp_path / f"{name}.err", "w") as err:
        return subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env, start_new_session=True)


def test_a_killed_rank_restarts_and_the_run_finishes_as_if_uninterrupted(tmp_path):
    ports = [free_port(), free_port()]
    while ports[1] == ports[0]:
        ports[1] = free_port()
    started = time.monotonic()
    procs = {
        "uninterrupted": start(tmp_path, "uninterrupted", ports[0], 0),
        "killed": start(tmp_path, "killed", ports[1], 5, "--max-restarts", "1"),
    }
    codes = {}
    try:
        for name, proc in procs.items():
            codes[name] = proc.wait(timeout=300)
            print(f"{name}: exit {codes[name]} after {time.monotonic() - started:.1f} s")
    finally:
        for proc in procs.values():
            if proc.poll() is None:  # timed out: its ranks too (each run is a session of its own)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    out = {name: (tmp_path / f"{name}.out").read_text() for name in procs}
    err = {name: (tmp_path / f"{name}.err").read_text() for name in procs}
    assert codes["uninterrupted"] == 0, err["uninterrupted"][-3000:]
    assert results(out["uninterrupted"])[0]["first_step"] == "1"
    assert codes["killed"] == 0, err["killed"][-3000:]
    assert "rank 1: SIGKILL at step 5" in err["killed"]
    assert "resumed from" in err["killed"] and "step-00000004" in err["killed"], err["killed"][-3000:]
    assert results(out["killed"])[-1]["first_step"] == "5"  # the restarted attempt began after step 4
    expected = load_file(str(tmp_path / "uninterrupted.safetensors"))
    got = load_file(str(tmp_path / "killed.safetensors"))
    assert expected.keys() == got.keys()
    for key in expected:
        assert (expected[key] == got[key]).all(), key
    # keep_last=2: only the two newest checkpoints remain
    kept = sorted(p.name for p in (tmp_path / "killed-ckpt").iterdir())
    assert kept == ["step-00000006", "step-00000008"], kept
