"""The command line and the launchers, run as a user would run them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tessera.testing import free_port

HERE = Path(__file__).resolve().parent
PROBE = HERE / "scripts" / "launch_probe.py"


def tessera_cmd() -> list[str]:
    script = Path(sys.executable).parent / "tessera"
    return [str(script)] if script.exists() else [sys.executable, "-m", "tessera.cli"]


def run(args: list[str], env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=full_env)


def run_together(*commands: list[str], timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """``run`` each of ``commands`` at once (independent launches: each picks its own port), in order."""
    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda args: run(args, timeout=timeout), commands))


def results(text: str) -> list[dict[str, str]]:
    rows = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in text.splitlines() if line.startswith("RESULT")]
    return sorted(rows, key=lambda r: int(r["rank"]))


def test_help_lists_the_subcommands():
    out = run([*tessera_cmd(), "--help"])
    assert out.returncode == 0, out.stderr
    for sub in ("run", "train", "check", "bench"):
        assert sub in out.stdout


# `tessera check` is run as README.md and docs/getting-started.md write it, its output checked, by
# tests/e2e/test_docs.py


def test_run_launches_through_torchrun_with_overrides(tmp_path):
    config = tmp_path / "layout.py"
    config.write_text("parallel = dict(tensor=dict(size=1, mode='1d'))\n")
    out = run([*tessera_cmd(), "run", "--nproc-per-node", "2", "--master-port", str(free_port()),
               str(PROBE), "torch", str(config), "parallel.tensor.size=2"])  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    rows = results(out.stdout)
    assert [r["rank"] for r in rows] == ["0", "1"]
    assert all(r["sum"] == "3" and r["tensor"] == "2" and r["data"] == "1" for r in rows), rows
    assert all(r["threads"] == "1" for r in rows), "one intra-op thread per rank by default"


def test_bad_config_fails_on_every_rank_before_the_group_starts(tmp_path):
    config = tmp_path / "bad.py"
    config.write_text("paralel = dict(data=2)\n")
    out = run([*tessera_cmd(), "run", "--nproc-per-node", "2", "--master-port", str(free_port()),
               str(PROBE), "torch", str(config)], timeout=60)  # fmt: skip
    assert out.returncode != 0
    assert "unknown config key 'paralel'; did you mean 'parallel'?" in out.stderr


def _spawn_pair(launcher: str, env_for_rank, tmp_path: Path) -> list[dict[str, str]]:
    config = tmp_path / "c.yaml"
    config.write_text("parallel:\n  data: 2\n")
    port = str(free_port())
    procs = [
        subprocess.Popen([sys.executable, str(PROBE), launcher, str(config), port], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, **env_for_rank(rank)})
        for rank in range(2)
    ]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (stdout, stderr) in zip(procs, outs):
        assert p.returncode == 0, stdout + stderr
    return results("".join(o for o, _ in outs))


def test_launch_from_slurm_environment(tmp_path):
    rows = _spawn_pair(
        "slurm",
        lambda r: {"SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(r)},
        tmp_path,
    )
    assert [(r["rank"], r["world"], r["sum"]) for r in rows] == [("0", "2", "3"), ("1", "2", "3")]


def test_launch_from_openmpi_environment(tmp_path):
    rows = _spawn_pair(
        "openmpi",
        lambda r: {
            "OMPI_COMM_WORLD_RANK": str(r),
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": str(r),
        },
        tmp_path,
    )
    assert [(r["rank"], r["world"], r["sum"]) for r in rows] == [("0", "2", "3"), ("1", "2", "3")]


def test_launch_from_torch_outside_a_launcher_runs_as_a_world_of_one(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    config = tmp_path / "c.toml"
    config.write_text("seed = 3\n")
    out = subprocess.run([sys.executable, str(PROBE), "torch", str(config)], capture_output=True, text=True,
                         env=env, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert [(r["rank"], r["world"], r["sum"]) for r in results(out.stdout)] == [("0", "1", "1")]
    assert "no launcher (RANK is not set): running as one process" in out.stderr
    needs_two = tmp_path / "two.toml"
    needs_two.write_text("[parallel]\ndata = 2\n")
    out = subprocess.run([sys.executable, str(PROBE), "torch", str(needs_two)], capture_output=True, text=True,
                         env=env, timeout=60)  # fmt: skip
    assert out.returncode != 0
    assert "needs 2 processes" in out.stderr and "tessera run --nproc-per-node 2 launch_probe.py" in out.stderr
    missing = subprocess.run([sys.executable, str(PROBE), "torch", "nope.py"], capture_output=True,
                             text=True, env=env, timeout=60, cwd=tmp_path)  # fmt: skip
    assert f"config file 'nope.py' does not exist (looked for {tmp_path / 'nope.py'} or " in missing.stderr
