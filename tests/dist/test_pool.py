"""The rank pool and the comm watchdog: failures name the rank, hangs end, pools recover."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from tessera import comm
from tessera.testing import RankFailure, use_layout
from tests.conftest import REPORT

WATCHDOG_S = 2.0


def body_noop():
    return None


def body_rank_of_pool():
    return use_layout().rank


def body_skip_a_collective():
    ctx = use_layout()
    t = torch.ones(3)
    with comm.watchdog(WATCHDOG_S):
        if ctx.rank != 1:  # rank 1 skips the all-reduce its peers wait in
            comm.all_reduce(t, "data")
    return True


def test_a_skipped_collective_fails_within_the_watchdog_timeout_and_the_pool_recovers(pools):
    assert pools.run(2, body_rank_of_pool) == [0, 1]
    start = time.monotonic()
    with pytest.raises(RankFailure) as err:
        pools.run(2, body_skip_a_collective, timeout=300)
    elapsed = time.monotonic() - start
    print(f"the skipped collective surfaced after {elapsed:.1f} s (watchdog timeout {WATCHDOG_S:g} s)")
    message = str(err.value)
    assert "rank 0: all_reduce on axis 'data'" in message
    assert "did not complete within the watchdog timeout of 2s" in message
    assert "CommTimeoutError" in message
    # the watchdog (not the pool's own 300 s timeout) ended it: a liveness bound with a wide margin
    # over the few seconds it takes here
    assert elapsed < 60, elapsed
    assert pools.run(2, body_rank_of_pool) == [0, 1]  # a fresh pool took over


def body_raise_on_rank(bad_rank):
    if use_layout().rank == bad_rank:
        raise ValueError("boom on purpose")
    return True


def test_an_exception_names_its_rank(pools):
    with pytest.raises(RankFailure) as err:
        pools.run(4, body_raise_on_rank, 2)
    assert "failed on rank(s) [2]" in str(err.value)
    assert "ValueError: boom on purpose" in str(err.value)
    assert pools.run(4, body_raise_on_rank, -1) == [True] * 4


def body_hang_on_rank(bad_rank):
    if use_layout().rank == bad_rank:
        time.sleep(30)
    return True


def test_a_hang_fails_after_the_timeout_naming_the_rank(pools):
    with pytest.raises(RankFailure) as err:
        pools.run(2, body_hang_on_rank, 1, timeout=3)
    assert "rank 1" in str(err.value) and "did not finish" in str(err.value)
    assert pools.run(2, body_hang_on_rank, -1) == [True, True]


def test_a_trivial_four_rank_test_is_cheap_once_the_pool_is_up(pools):
    pools.run(4, body_noop)  # make sure the pool is up
    times = []
    for _ in range(9):
        start = time.perf_counter()
        pools.run(4, body_noop)
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    line = f"trivial 4-rank test on a warm pool: median {median * 1000:.1f} ms over {len(times)} runs"
    print(line)
    REPORT.append(line)
    assert median < 0.5, line
