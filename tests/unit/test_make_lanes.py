"""The Makefile's targets outside ``make test``, as ``make -n -B`` prints them: the CUDA lane runs on
a given python over the source tree with no .venv (a bare GPU machine's python, or any python with
torch for the CPU dry run), and the torch-floor check installs the torch that pyproject.toml allows
at the least."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
NO_VENV = "/nowhere/venv"  # a .venv that is never there: a recipe that builds one names it
BARE = "/bare/bin/python3"
LANE = f"PYTHONPATH=. TESSERA_TEST_DEVICE=cpu {BARE} -m pytest -q -p no:cacheprovider --cuda-lane -m cuda"


def recipe(target: str, *assignments: str) -> list[str]:
    """The commands ``make <target>`` would run, prerequisites included, without running them."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    out = subprocess.run(["make", "-n", "-B", "--no-print-directory", target, f"VENV={NO_VENV}", *assignments],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_the_cuda_lane_runs_on_the_given_python_over_the_tree_without_a_venv():
    assert recipe("test-gpu", f"GPU_PYTHON={BARE}", "GPU_DEVICE=cpu") == [f"{LANE} tests/cuda"]


def test_gpu_check_runs_the_same_lane_then_the_probe_without_a_venv():
    lines = recipe("gpu-check", f"GPU_PYTHON={BARE}", "GPU_DEVICE=cpu", "GPU_REPORT=out")
    assert not [line for line in lines if NO_VENV in line], lines
    assert f"{LANE} --junitxml=out/lane.xml tests/cuda" in lines
    assert lines[-1].startswith(f"PYTHONPATH=. {BARE} benchmarks/gpu_probe.py --device cpu --out out/probe.json")


def test_the_torch_floor_check_installs_pyprojects_oldest_torch_and_runs_the_lane_and_the_collectives():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = [m.group(1) for d in deps if (m := re.fullmatch(r"torch\s*>=\s*([\d.]+)", d))]
    assert len(floors) == 1, deps
    lines = recipe("check-torch-floor", "FLOOR_VENV=floor")
    assert not [line for line in lines if NO_VENV in line], lines
    installs = [line for line in lines if " -m pip install " in line and "torch==" in line]
    assert len(installs) == 1 and f" torch=={floors[0]} " in installs[0], installs
    assert "PYTHONPATH=. TESSERA_TEST_DEVICE=cpu floor/bin/python -m pytest" in "\n".join(lines)
    assert "floor/bin/python -m pytest -q -p no:cacheprovider tests/dist/test_comm.py" in lines
    assert "floor/bin/tessera check" in lines
    assert not [line for line in recipe("test") if "floor" in line], "make test leaves the floor check out"
