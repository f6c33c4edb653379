"""Shared fixtures: one rank pool per world size for the whole session; the CUDA lane's switch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from tessera.testing import PoolSet

# Lines that tests want shown at the end of the run (e.g. the pool's per-test overhead).
REPORT: list[str] = []

# tests/cuda is the CUDA lane (`make test-gpu`): collected only with --cuda-lane, so that the
# default run neither collects nor reports it.
CUDA_LANE = Path(__file__).resolve().parent / "cuda"


def pytest_addoption(parser):
    parser.addoption(
        "--cuda-lane",
        action="store_true",
        help="collect tests/cuda (the CUDA lane; `make test-gpu`); without it they are not collected",
    )


def _in_cuda_lane(path: Path) -> bool:
    return path == CUDA_LANE or CUDA_LANE in path.parents


def pytest_configure(config):
    here = config.invocation_params.dir
    asked = [a for a in config.args if _in_cuda_lane((here / a.split("::")[0]).resolve())]
    if not config.getoption("--cuda-lane"):
        if asked:
            raise pytest.UsageError(
                f"{asked[0]} is the CUDA lane: run `make test-gpu` (or pytest --cuda-lane tests/cuda)"
            )
        return
    from tests.cuda.lane import lane_device, lane_unavailable_reason

    reason = lane_unavailable_reason(lane_device())
    if reason is not None:
        raise pytest.UsageError(reason)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _in_cuda_lane(Path(item.path).resolve()):
            item.add_marker(pytest.mark.cuda)


def pytest_ignore_collect(collection_path, config):
    if _in_cuda_lane(collection_path) and not config.getoption("--cuda-lane"):
        return True
    return None


@pytest.fixture(scope="session")
def pools():
    """``pools.run(world_size, fn, *args)`` runs ``fn`` on every rank of a kept-alive pool (forked
    from a server that imported torch once: a replaced pool costs a fork per rank)."""
    pool_set = PoolSet(start_method="forkserver")
    yield pool_set
    pool_set.close()


def pytest_terminal_summary(terminalreporter):
    if REPORT:
        terminalreporter.section("tessera")
        for line in REPORT:
            terminalreporter.write_line(line)
