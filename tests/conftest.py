"""Shared fixtures: one rank pool per world size for the whole session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from tessera.testing import PoolSet

# Lines that tests want shown at the end of the run (e.g. the pool's per-test overhead).
REPORT: list[str] = []


@pytest.fixture(scope="session")
def pools():
    """``pools.run(world_size, fn, *args)`` runs ``fn`` on every rank of a kept-alive pool."""
    pool_set = PoolSet()
    yield pool_set
    pool_set.close()


def pytest_terminal_summary(terminalreporter):
    if REPORT:
        terminalreporter.section("tessera")
        for line in REPORT:
            terminalreporter.write_line(line)
